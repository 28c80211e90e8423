"""DMA block copies: the address tables on any machine, byte-exact copies where CUDA
runs."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import ALL_LAYOUTS, DEVICE, block_bytes, make_kv_caches
from vllm_cpu_offload.worker.copiers import dma
from vllm_cpu_offload.worker.copiers.cuda_runtime import cuda_runtime
from vllm_cpu_offload.worker.copiers.streams import merge_runs
from vllm_cpu_offload.worker.host_buffer import HostBuffer


def _tables(
    layout: str, device_ids: list[int], host_ids: list[int], num_layers: int = 3
):
    caches, block_dim = make_kv_caches(layout, num_layers=num_layers, device="cpu")
    host = HostBuffer.for_kv_caches(caches, num_slots=6, pin=False)
    group = dma._Group(list(caches), list(caches.values()), host, max_pitch=1 << 31)
    tables = dma._Tables(group, torch.tensor(device_ids), torch.tensor(host_ids))
    return caches, block_dim, host, tables


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_layer_tables_address_every_run(layout):
    # Each layer's row lists, in device-id order, the address of every run
    # of every pair.
    device_ids, host_ids = [6, 0, 3], [1, 4, 0]
    caches, _, host, tables = _tables(layout, device_ids, host_ids)
    pairs = sorted(zip(device_ids, host_ids, strict=True))
    for i, (name, t) in enumerate(caches.items()):
        lay = host.layouts[name]
        want_device, want_host = [], []
        for d, h in pairs:
            view = lay.block_view(t, d)
            slot = host.layer_view(name)[h].view(lay.num_chunks, lay.chunk_bytes)
            want_device += [view[c].data_ptr() for c in range(lay.num_chunks)]
            want_host += [slot[c].data_ptr() for c in range(lay.num_chunks)]
        assert tables.device[i].tolist() == want_device
        assert tables.host[i].tolist() == want_host
        assert tables.layer_sizes.tolist() == [lay.chunk_bytes] * len(want_device)


def test_merge_joins_runs_that_continue_on_both_sides():
    # Runs 0-1 continue each other on both sides, 2 jumps on the host side,
    # 3 continues 2.
    device = torch.tensor([100, 110, 120, 130])
    host = torch.tensor([0, 10, 50, 60])
    dsts, srcs, sizes = merge_runs(device, host, 10)
    assert dsts.tolist() == [100, 120]
    assert srcs.tolist() == [0, 50]
    assert sizes.tolist() == [20, 20]


def test_blocks_that_hold_every_layer_merge_into_one_copy_per_block():
    # BLHNC keeps all layers of a block contiguous, as the host block does:
    # one copy each.
    _, _, host, tables = _tables("BLHNC", [4, 1], [0, 5])
    device, on_host, sizes = tables.merged(to_host=False)
    assert sizes.tolist() == [host.block_bytes] * 2
    assert on_host.tolist() == [host.tensor[5].data_ptr(), host.tensor[0].data_ptr()]
    assert device.numel() == 2


def test_consecutive_pairs_of_one_dense_layer_merge():
    # One layer, consecutive device and host blocks: the whole run is one copy.
    _, _, host, tables = _tables("LBHNC", [2, 3, 4], [1, 2, 3], num_layers=1)
    _, _, sizes = tables.merged(to_host=True)
    assert sizes.tolist() == [3 * host.block_bytes]


@pytest.mark.parametrize(
    ("layout", "pitched"),
    [
        ("LBHNC", True),
        ("LBNHC", True),
        ("BLHNC", True),
        ("LHBNC", False),
        ("2N_NHD", False),
    ],
)
def test_whole_blocks_go_pitched_where_layers_sit_at_one_distance(layout, pitched):
    # Layer-compact layouts with one run per layer-block: a block is one 2D copy.
    caches, _ = make_kv_caches(layout, device="cpu")
    host = HostBuffer.for_kv_caches(caches, num_slots=6, pin=False)
    group = dma._Group(list(caches), list(caches.values()), host, max_pitch=1 << 31)
    assert (group.pitches is not None) is pitched
    if pitched:
        first, second = list(caches.values())[:2]
        assert group.pitches == (
            second.data_ptr() - first.data_ptr(),
            host.slot_offsets["layer.1"] - host.slot_offsets["layer.0"],
        )


def test_pitch_above_the_device_limit_falls_back_to_batches():
    caches, _ = make_kv_caches("LBHNC", device="cpu")
    host = HostBuffer.for_kv_caches(caches, num_slots=6, pin=False)
    group = dma._Group(list(caches), list(caches.values()), host, max_pitch=64)
    assert group.pitches is None


cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(
    "dtype", (torch.bfloat16, torch.float16, torch.float8_e4m3fn), ids=str
)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_dma_round_trip_byte_exact(layout, dtype):
    # Store all layers, then load one layer into other blocks: bytes land exactly.
    if not cuda_runtime().available:
        pytest.skip(cuda_runtime().why_unavailable)
    caches, block_dim = make_kv_caches(layout, dtype=dtype)
    host = HostBuffer.for_kv_caches(caches, num_slots=6)
    copier = dma.DmaBlockCopier(caches, host)
    device_ids, host_ids = [6, 0, 3, 4], [1, 4, 0, 5]
    copier.copy(True, torch.tensor(device_ids), torch.tensor(host_ids))
    torch.cuda.synchronize()
    for name, t in caches.items():
        for d, h in zip(device_ids, host_ids, strict=True):
            assert torch.equal(host.layer_view(name)[h], block_bytes(t, block_dim, d))
    originals = {n: t.clone() for n, t in caches.items()}
    copier.copy(False, torch.tensor([1, 2]), torch.tensor([4, 1]), ["layer.1"])
    torch.cuda.synchronize()
    for name, t in caches.items():
        for b in range(t.shape[block_dim]):
            got = block_bytes(t, block_dim, b)
            if name == "layer.1" and b in (1, 2):
                assert torch.equal(got, host.layer_view(name)[{1: 4, 2: 1}[b]])
            else:
                assert torch.equal(got, block_bytes(originals[name], block_dim, b))
