"""Staged whole-block copies: byte-exact on every layout, on CPU (torch + memmove hops)
and, where CUDA runs, on the copy engines and kernels with their streams and events."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import ALL_LAYOUTS, DEVICE, block_bytes, make_kv_caches
from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.worker.copiers.staged import StagedBlockCopier
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.transfer_engine import FinishedJobs, TransferEngine

NUM_BLOCKS, NUM_HOST = 13, 12


def _gathers(layout: str) -> list[str]:
    # On CPU "dma" stands for torch copies. On CUDA, the copy-engine gather needs each
    # layer-block to be one run at a fixed layer distance.
    if DEVICE != "cuda" or layout in ("LBHNC", "LBNHC"):
        return ["dma", "kernel"]
    return ["kernel"]


def _copier(
    layout: str, gather: str, chunk_blocks: int, dtype: torch.dtype = torch.bfloat16
):
    caches, block_dim = make_kv_caches(layout, num_blocks=NUM_BLOCKS, dtype=dtype)
    host = HostBuffer.for_kv_caches(caches, NUM_HOST)
    host.tensor.copy_(torch.randint(0, 256, host.tensor.shape, dtype=torch.uint8))
    if DEVICE == "cuda":
        from vllm_cpu_offload.worker.copiers.cuda_runtime import cuda_runtime

        if not cuda_runtime().available:
            pytest.skip(cuda_runtime().why_unavailable)
    copier = StagedBlockCopier(caches, host, chunk_blocks=chunk_blocks, gather=gather)
    return caches, block_dim, host, copier


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# Eleven pairs over chunks of three: four chunks, the last one short, both halves
# reused; host blocks 7, 8, 9 follow each other in one chunk (their hop merges
# into one run).
DEVICE_IDS = [12, 0, 5, 3, 9, 1, 10, 2, 7, 11, 4]
HOST_IDS = [3, 11, 0, 7, 8, 9, 5, 1, 10, 2, 6]


@pytest.mark.parametrize(
    "dtype", (torch.bfloat16, torch.float16, torch.float8_e4m3fn), ids=str
)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_staged_round_trip_byte_exact(layout, dtype):
    # Store eleven scattered blocks, then load them into other device blocks.
    for gather in _gathers(layout):
        caches, block_dim, host, copier = _copier(
            layout, gather, chunk_blocks=3, dtype=dtype
        )
        before = host.tensor.cpu().clone()
        copier.copy(True, torch.tensor(DEVICE_IDS), torch.tensor(HOST_IDS))
        _sync()
        for name, t in caches.items():
            for d, h in zip(DEVICE_IDS, HOST_IDS, strict=True):
                assert torch.equal(
                    host.layer_view(name)[h].cpu(), block_bytes(t, block_dim, d)
                )
        untouched = sorted(set(range(NUM_HOST)) - set(HOST_IDS))
        assert torch.equal(host.tensor[untouched].cpu(), before[untouched])

        originals = {n: t.clone() for n, t in caches.items()}
        targets = [(DEVICE_IDS[i] + 6) % NUM_BLOCKS for i in range(5)]
        copier.copy(False, torch.tensor(targets), torch.tensor(HOST_IDS[:5]))
        _sync()
        loaded = dict(zip(targets, HOST_IDS[:5], strict=True))
        for name, t in caches.items():
            for b in range(NUM_BLOCKS):
                got = block_bytes(t, block_dim, b)
                if b in loaded:
                    assert torch.equal(got, host.layer_view(name)[loaded[b]].cpu())
                else:
                    assert torch.equal(got, block_bytes(originals[name], block_dim, b))


def test_some_layers_go_direct_and_leave_the_rest():
    # A call for one layer skips staging and copies that layer only.
    caches, block_dim, host, copier = _copier("LBHNC", "dma", chunk_blocks=2)
    before = host.tensor.cpu().clone()
    copier.copy(True, torch.tensor([4, 6, 1]), torch.tensor([2, 0, 5]), ["layer.1"])
    _sync()
    for name, t in caches.items():
        for d, h in ((4, 2), (6, 0), (1, 5)):
            got = host.layer_view(name)[h].cpu()
            if name == "layer.1":
                assert torch.equal(got, block_bytes(t, block_dim, d))
            else:
                start = host.slot_offsets[name]
                assert torch.equal(got, before[h, start : start + got.numel()])


def test_staging_lives_beside_the_caches_and_is_sized_by_chunks():
    caches, _, host, copier = _copier("LBHNC", "dma", chunk_blocks=5)
    assert copier.staging.tensor.device.type == DEVICE
    assert copier.staging.tensor.shape == (20, host.block_bytes)
    assert copier.staging.slot_offsets == host.slot_offsets
    assert not copier.staging.pinned


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_blocks": 0}, "chunk_blocks must be >= 1"),
        ({"gather": "nvlink"}, "gather 'nvlink'"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    caches, _ = make_kv_caches("LBHNC")
    host = HostBuffer.for_kv_caches(caches, 4)
    with pytest.raises(ValueError, match=message):
        StagedBlockCopier(caches, host, **kwargs)


def test_engine_with_a_staged_copier_reports_jobs():
    # A step through the transfer engine: one store and one load job, both land.
    caches, block_dim, host, copier = _copier("LBHNC", "dma", chunk_blocks=2)
    engine = TransferEngine(caches, host, copier=copier)
    engine.start_loads([BlockTransfer(1, [8, 9, 10], [0, 1, 2])])
    for name in caches:
        engine.wait_for_layer_load(name)
    engine.finish_step()
    stores = [BlockTransfer(2, [3, 4, 5], [9, 10, 11])]
    for name in caches:
        engine.store_layer(name, stores)
    engine.finish_step()
    engine.wait_all()
    assert engine.poll_finished() == FinishedJobs(stores={2}, loads={1})
    for name, t in caches.items():
        for d, h in ((8, 0), (9, 1), (10, 2), (3, 9), (4, 10), (5, 11)):
            assert torch.equal(
                block_bytes(t, block_dim, d), host.layer_view(name)[h].cpu()
            )


cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(
    "dtype", (torch.bfloat16, torch.float16, torch.float8_e4m3fn), ids=str
)
def test_cuda_stores_and_loads_in_flight_together(dtype):
    # A store and a load queued on unrelated streams at once use their own staging
    # halves; a second store on a third stream waits for the first one's halves.
    caches, block_dim, host, copier = _copier(
        "LBNHC", "dma", chunk_blocks=2, dtype=dtype
    )
    stored = {n: t.clone() for n, t in caches.items()}
    streams = [torch.cuda.Stream() for _ in range(3)]
    with torch.cuda.stream(streams[0]):
        copier.copy(True, torch.tensor([0, 1, 2, 3, 4]), torch.tensor([0, 1, 2, 3, 4]))
    with torch.cuda.stream(streams[1]):
        copier.copy(
            False, torch.tensor([8, 9, 10, 11, 12]), torch.tensor([7, 8, 9, 10, 11])
        )
    with torch.cuda.stream(streams[2]):
        copier.copy(True, torch.tensor([5, 6, 7]), torch.tensor([5, 6, 11]))
    torch.cuda.synchronize()
    for name, t in caches.items():
        for d in range(7):  # both stores: device block d went to host block d
            got = host.layer_view(name)[d].cpu()
            assert torch.equal(got, block_bytes(stored[name], block_dim, d))
        for d in (8, 9, 10):  # loaded from host blocks no store touched
            assert torch.equal(
                block_bytes(t, block_dim, d), host.layer_view(name)[d - 1].cpu()
            )
