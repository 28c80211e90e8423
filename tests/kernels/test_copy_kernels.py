"""Byte-exact tests of the Triton block-copy kernels against a torch reference.

Without a GPU they run in Triton's interpreter on CPU tensors (see conftest.py), so the
shapes are tiny: a few layers, a handful of 4-token blocks.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import ALL_LAYOUTS, DEVICE, block_bytes, make_kv_caches
from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier
from vllm_cpu_offload.worker.copiers.triton_kernels import TritonBlockCopier, word_bytes
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.transfer_engine import TransferEngine

DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
# (device ids, host ids): odd sizes, unsorted, with gaps, and a consecutive run.
PAIRS = {
    "one": ([5], [2]),
    "three_unsorted": ([6, 0, 3], [1, 4, 0]),
    "run_and_gap": ([1, 2, 3, 5, 4], [2, 3, 4, 0, 5]),
}
COPIERS = {"triton": TritonBlockCopier, "torch": TorchBlockCopier}


def _setup(layout: str, dtype: torch.dtype):
    caches, block_dim = make_kv_caches(layout, dtype=dtype)
    host = HostBuffer.for_kv_caches(caches, num_slots=6)
    host.tensor.copy_(torch.randint(0, 256, host.tensor.shape, dtype=torch.uint8))
    return caches, block_dim, host


def _ids(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("copier_cls", COPIERS.values(), ids=COPIERS.keys())
@pytest.mark.parametrize("pairs", PAIRS.values(), ids=PAIRS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_store_all_layers(layout, dtype, pairs, copier_cls):
    # Device -> host for every layer in one call: host slots hold each block's bytes.
    caches, block_dim, host = _setup(layout, dtype)
    before = host.tensor.clone()
    device_ids, host_ids = pairs
    copier_cls(caches, host).copy(True, _ids(device_ids), _ids(host_ids))
    for name, t in caches.items():
        for d, h in zip(device_ids, host_ids, strict=True):
            assert torch.equal(
                host.layer_view(name)[h].cpu(), block_bytes(t, block_dim, d)
            )
    untouched = [h for h in range(host.num_slots) if h not in host_ids]
    assert torch.equal(host.tensor[untouched], before[untouched])


@pytest.mark.parametrize("copier_cls", COPIERS.values(), ids=COPIERS.keys())
@pytest.mark.parametrize("pairs", PAIRS.values(), ids=PAIRS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_load_one_layer(layout, dtype, pairs, copier_cls):
    # Host -> device for one layer (layer-wise loads): only that layer's blocks change.
    caches, block_dim, host = _setup(layout, dtype)
    originals = {n: t.clone() for n, t in caches.items()}
    device_ids, host_ids = pairs
    target = "layer.1"
    copier_cls(caches, host).copy(False, _ids(device_ids), _ids(host_ids), [target])
    for name, t in caches.items():
        for b in range(t.shape[block_dim]):
            got = block_bytes(t, block_dim, b)
            if name == target and b in device_ids:
                h = host_ids[device_ids.index(b)]
                assert torch.equal(got, host.layer_view(name)[h].cpu())
            else:
                assert torch.equal(got, block_bytes(originals[name], block_dim, b))


@pytest.mark.parametrize("copier_cls", COPIERS.values(), ids=COPIERS.keys())
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_round_trip_all_layers(layout, copier_cls):
    # Store blocks, wipe the device cache, load them into other blocks: bytes survive.
    caches, block_dim, host = _setup(layout, torch.float16)
    originals = {n: t.clone() for n, t in caches.items()}
    copier = copier_cls(caches, host)
    copier.copy(True, _ids([4, 2, 0]), _ids([5, 1, 3]))
    for t in caches.values():
        t.zero_()
    copier.copy(False, _ids([1, 6, 3]), _ids([5, 1, 3]))
    for name, t in caches.items():
        for src, dst in ((4, 1), (2, 6), (0, 3)):
            assert torch.equal(
                t.select(block_dim, dst), originals[name].select(block_dim, src)
            )
        assert not t.select(block_dim, 0).any()


@pytest.mark.parametrize("copier_cls", COPIERS.values(), ids=COPIERS.keys())
def test_kernel_blocks_grouped_into_manager_blocks(copier_cls):
    # vLLM split each 8-token manager block into two 4-token kernel blocks: ids
    # are manager ids.
    caches, _ = make_kv_caches("LBHNC", num_blocks=8, dtype=torch.bfloat16)
    host = HostBuffer.for_kv_caches(caches, 3, num_blocks=4)
    copier_cls(caches, host).copy(True, _ids([3, 1]), _ids([0, 2]))
    for name, t in caches.items():
        assert torch.equal(
            host.layer_view(name)[0].cpu(),
            t[6:8].contiguous().view(-1).view(torch.uint8).cpu(),
        )
        assert torch.equal(
            host.layer_view(name)[2].cpu(),
            t[2:4].contiguous().view(-1).view(torch.uint8).cpu(),
        )


def test_empty_batch_is_a_no_op():
    caches, _, host = _setup("LBNHC", torch.bfloat16)
    before = host.tensor.clone()
    TritonBlockCopier(caches, host).copy(True, _ids([]), _ids([]))
    assert torch.equal(host.tensor, before)


def test_word_is_widest_common_alignment():
    assert word_bytes(64, 1024, 8) == 8
    assert word_bytes(64, 1024, 12) == 4
    assert word_bytes(6, 1024) == 2
    assert word_bytes(3) == 1


def test_odd_element_counts_copy_as_narrow_words():
    # A 3-element bf16 run (6 bytes) forces 2-byte words; bytes still land exactly.
    caches = {
        "a": torch.randn(5, 3, dtype=torch.float32, device=DEVICE).to(torch.bfloat16)
    }
    host = HostBuffer.for_kv_caches(caches, 4)
    TritonBlockCopier(caches, host).copy(True, _ids([4, 0]), _ids([1, 3]))
    assert torch.equal(
        host.layer_view("a")[1].cpu(), caches["a"][4].view(torch.uint8).cpu()
    )
    assert torch.equal(
        host.layer_view("a")[3].cpu(), caches["a"][0].view(torch.uint8).cpu()
    )


def test_engine_with_triton_copier_reports_jobs():
    # The transfer engine driven by the Triton copier: one step of loads and stores.
    caches, _ = make_kv_caches("LBHNC", dtype=torch.bfloat16)
    host = HostBuffer.for_kv_caches(caches, 6)
    engine = TransferEngine(caches, host, copier=TritonBlockCopier(caches, host))
    stores = [BlockTransfer(1, [0, 1], [0, 1]), BlockTransfer(2, [5], [4])]
    for name in caches:
        engine.store_layer(name, stores)
    engine.finish_step()
    if DEVICE == "cuda":
        engine.wait_all()
    assert engine.poll_finished().stores == {1, 2}
    for name, t in caches.items():
        assert torch.equal(
            host.layer_view(name)[4].cpu(),
            t[5].contiguous().view(-1).view(torch.uint8).cpu(),
        )
