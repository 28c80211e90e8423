"""Replicated KV (MLA) stored once: one host region every tensor-parallel rank maps,
stores copied by the first rank, loads by every rank (the shared store's names:
test_kv_shards.py)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.unit.test_tier_worker import BLOCKS, HOST_BLOCKS, LAYERS, _step  # noqa: E402
from vllm_cpu_offload.metadata import BlockTransfer, OffloadStepMetadata  # noqa: E402
from vllm_cpu_offload.worker.host_buffer import HostBuffer  # noqa: E402
from vllm_cpu_offload.worker.shared_region import SHM_DIR, SharedRegion  # noqa: E402
from vllm_cpu_offload.worker.tier_worker import HostTierWorker  # noqa: E402


def _agreement(ranks: int) -> Callable[[bool], bool]:
    """`agree` for `ranks` threads: every rank's vote, after all voted."""
    votes: list[bool] = []
    barrier = threading.Barrier(ranks)

    def agree(ok: bool) -> bool:
        votes.append(ok)
        barrier.wait()
        return all(votes)

    return agree


def _in_ranks(ranks: int, work: Callable[[int], object]) -> list[object]:
    """Runs `work(rank)` for every rank at once (ranks are threads here)."""
    results: list[object] = [None] * ranks
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def _path(tmp_name: str) -> str:
    return os.path.join(SHM_DIR, f"vllm-cpu-offload-test-{os.getpid()}-{tmp_name}")


def _workers(ranks: int, path: str) -> list[tuple[HostTierWorker, dict]]:
    agree = _agreement(ranks)
    torch.manual_seed(0)
    # The same device KV on every rank, as MLA's latent KV is.
    caches = {f"l{i}": torch.randn(BLOCKS, 16, 64) for i in range(LAYERS)}

    def make(rank: int) -> tuple[HostTierWorker, dict]:
        own = {name: t.clone() for name, t in caches.items()}
        region = SharedRegion(path, agree, leader=rank == 0)
        worker = HostTierWorker(HOST_BLOCKS, BLOCKS, shared_region=region)
        worker.register_kv_caches(own)
        return worker, own

    return _in_ranks(ranks, make)  # type: ignore[return-value]


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")
def test_ranks_map_one_region_the_first_rank_stores_and_every_rank_loads() -> None:
    path = _path("one-region")
    (leader, leader_kv), (replica, replica_kv) = _workers(2, path)
    assert not os.path.exists(path), "the region's file outlives the agreement"
    leader_host, replica_host = leader.engine.host, replica.engine.host  # type: ignore[union-attr]
    assert leader_host.shared and replica_host.shared
    # One memory: a byte written through one rank's view shows in the other's.
    leader_host.tensor[3, 5] = 77
    assert int(replica_host.tensor[3, 5]) == 77
    leader_host.tensor.zero_()

    store = OffloadStepMetadata(stores=[BlockTransfer(1, [5], [2], "a")])
    # The replica copies nothing and reports at once; the leader copies.
    _step(replica, store)
    assert not bool(replica_host.tensor.any())
    _step(leader, store)
    for worker in (leader, replica):
        report = worker.take_report()
        assert report is not None and dict(report.finished) == {1: 1}

    # Every rank loads the block from the one region into its own device blocks.
    load = OffloadStepMetadata(loads=[BlockTransfer(2, [1], [2], "b")])
    for worker, kv in ((leader, leader_kv), (replica, replica_kv)):
        _step(worker, load)
        for t in kv.values():
            assert torch.equal(t[1], t[5])
        report = worker.take_report()
        assert report is not None and dict(report.finished) == {2: 1}


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")
def test_a_rank_that_cannot_map_the_region_makes_every_rank_keep_its_own() -> None:
    path = _path("refused")
    agree = _agreement(2)

    def make(rank: int) -> HostBuffer:
        # Rank 1 votes no, as a rank whose tmpfs is full does.
        vote = agree if rank == 0 else (lambda ok: agree(False))
        region = SharedRegion(path, vote, leader=rank == 0)
        layouts = {"l0": torch.zeros(BLOCKS, 16, 64)}
        return HostBuffer.for_kv_caches(layouts, HOST_BLOCKS, shared_region=region)

    buffers = _in_ranks(2, make)
    assert not os.path.exists(path)
    for buffer in buffers:
        assert isinstance(buffer, HostBuffer) and not buffer.shared
    a, b = buffers
    a.tensor[0, 0] = 9  # type: ignore[union-attr]
    assert int(b.tensor[0, 0]) == 0  # type: ignore[union-attr]
