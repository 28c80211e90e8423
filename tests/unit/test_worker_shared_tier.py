"""The worker's seam to the shared store, over a stand-in for the store's thread: how a
fetch's result cuts its load, and when a write-through is reported."""

from __future__ import annotations

from typing import Any, cast

import pytest

pytest.importorskip("vllm")

from tests.fault_injection import FaultInjector  # noqa: E402
from tests.unit.test_tier_worker import _step, _worker  # noqa: E402
from vllm_cpu_offload.block_transfer import (  # noqa: E402
    AsyncLoad,
    BlockTransfer,
    RemoteBlocks,
)
from vllm_cpu_offload.metadata import OffloadStepMetadata  # noqa: E402
from vllm_cpu_offload.worker.remote_io import RemoteIO, RemoteResults  # noqa: E402
from vllm_cpu_offload.worker.shared_tier import SharedTierWorker  # noqa: E402
from vllm_cpu_offload.worker.tier_seams import NoSharedTierWorker  # noqa: E402

K = 2  # slots per host block


class _Thread:
    """Records what the seam hands to the store's thread; `results` is the next poll."""

    def __init__(self) -> None:
        self.fetches: list[RemoteBlocks] = []
        self.writes: list[RemoteBlocks] = []
        self.results = RemoteResults()
        self.waited = 0

    def fetch(self, job: RemoteBlocks) -> None:
        self.fetches.append(job)

    def write(self, job: RemoteBlocks) -> bool:
        self.writes.append(job)
        return True

    def poll(self) -> RemoteResults:
        results, self.results = self.results, RemoteResults()
        return results

    def wait_for_fetch(self, timeout_s: float) -> bool:
        self.waited += 1
        return False


def _tier() -> tuple[SharedTierWorker, _Thread]:
    thread = _Thread()
    io = cast(RemoteIO, cast(Any, thread))
    return SharedTierWorker(
        io, None, blocks_per_host_block=K, idle_fetch_wait_s=0
    ), thread


def _hit() -> AsyncLoad:
    # Slots 0-1 were in host memory; host blocks 1, 2 and 3 (slots 2-7) are fetched.
    return AsyncLoad(
        load=BlockTransfer(5, list(range(10, 18)), list(range(8)), req_id="r"),
        fetch=RemoteBlocks(5, ["a", "b", "c"], [1, 2, 3]),
        fetched_from=2,
        unloadable=[30],
    )


def test_without_a_store_the_hit_loads_what_host_memory_held() -> None:
    # No store: the fetch ends at once, nothing arrived; the host part loads.
    (done,) = NoSharedTierWorker().fetch(_hit()).fetched
    assert done.arrived == [False] * 3
    assert list(done.load.device_block_ids) == [10, 11]
    assert done.unloaded == [*range(12, 18), 30]


def test_a_fetch_loads_up_to_its_first_missing_host_block() -> None:
    # Host block 2 missed: host block 3 arrived but is past the gap, so it stays out.
    tier, thread = _tier()
    assert tier.fetch(_hit()).fetched == [] and thread.fetches == [_hit().fetch]
    assert tier.num_jobs_in_flight == 1
    thread.results = RemoteResults(fetched={5: [True, False, True]})
    (done,) = tier.poll(idle=True).fetched
    assert thread.waited == 1 and tier.num_jobs_in_flight == 0
    assert list(done.load.host_block_ids) == [0, 1, 2, 3]
    assert done.load.req_id == "r" and done.arrived == [True, False, True]
    assert done.unloaded == [*range(14, 18), 30]


def test_a_write_through_starts_only_after_a_good_store() -> None:
    # A failed store writes nothing and is reported at once; a good one is queued.
    tier, thread = _tier()
    tier.plan_writes([RemoteBlocks(1, ["a", "b"], [0, 1]), RemoteBlocks(2, ["c"], [2])])
    assert tier.copy_ended(1, stored=False).written == {1: [False, False]}
    assert tier.copy_ended(2, stored=True).written == {} and len(thread.writes) == 1
    assert tier.copy_ended(3, stored=True).written == {}  # no write planned for it
    thread.results = RemoteResults(written={2: [True]}, stats={"written_blocks": 1})
    assert tier.poll(idle=False).written == {2: [True]}
    assert tier.take_stats() == {"remote_written_blocks": 1}
    assert tier.take_stats() == {}


def test_a_rank_past_the_first_writes_no_replicated_block_and_reports_it_written():
    # MLA: the first rank writes the block's one value; the others' reports must
    # not hold the store job back, nor say a block was written that was not.
    thread = _Thread()
    io = cast(RemoteIO, cast(Any, thread))
    tier = SharedTierWorker(
        io, None, blocks_per_host_block=K, idle_fetch_wait_s=0, writes_through=False
    )
    tier.plan_writes([RemoteBlocks(1, ["a", "b"], [0, 1]), RemoteBlocks(2, ["c"], [2])])
    assert tier.copy_ended(1, stored=True).written == {1: [True, True]}
    assert tier.copy_ended(2, stored=False).written == {2: [False]}
    assert not thread.writes and tier.num_jobs_in_flight == 0


def _whole_hit(unloadable: list[int] | None = None) -> AsyncLoad:
    # Several KV cache groups: slots 0-1 were in host memory, host blocks 1 and 2
    # (a full group's block and a window group's, slots 2-5) are fetched.
    return AsyncLoad(
        load=BlockTransfer(6, list(range(10, 16)), list(range(6)), req_id="w"),
        fetch=RemoteBlocks(6, ["a", "b"], [1, 2]),
        fetched_from=2,
        unloadable=unloadable or [],
        whole=True,
    )


def test_a_whole_load_loads_everything_once_every_block_arrived() -> None:
    tier, thread = _tier()
    tier.fetch(_whole_hit())
    thread.results = RemoteResults(fetched={6: [True, True]})
    (done,) = tier.poll(idle=False).fetched
    assert list(done.load.device_block_ids) == list(range(10, 16))
    assert done.unloaded == [] and not done.failed


def test_a_whole_load_short_of_one_block_loads_nothing_and_fails_its_request() -> None:
    # The window group's block did not arrive: no block is loaded and none is an
    # invalid block (vLLM's hybrid manager takes none); the load says it failed, and
    # the worker fails its request whole (test_tier_worker), vLLM recomputes it.
    tier, thread = _tier()
    tier.fetch(_whole_hit())
    thread.results = RemoteResults(fetched={6: [True, False]})
    (done,) = tier.poll(idle=False).fetched
    assert list(done.load.device_block_ids) == [] and done.unloaded == []
    assert done.arrived == [True, False] and done.job_id == 6 and done.failed
    # A block that got no host block fails it too, every block having arrived.
    tier.fetch(_whole_hit(unloadable=[40]))
    thread.results = RemoteResults(fetched={6: [True, True]})
    (done,) = tier.poll(idle=False).fetched
    assert list(done.load.device_block_ids) == [] and done.unloaded == []
    assert done.failed
    # Without a store nothing arrives: failed at once.
    none = NoSharedTierWorker()
    (done,) = none.fetch(_whole_hit()).fetched
    assert list(done.load.device_block_ids) == [] and done.unloaded == []
    assert done.failed


def test_a_store_failed_by_the_injector_ends_its_write_through() -> None:
    # A store that fails before it is copied writes nothing through, and says so:
    # the scheduler holds its host blocks until every worker reported the write.
    worker, _ = _worker()
    worker.faults = FaultInjector(1.0)
    thread = _WriteRecorder()
    worker.shared = SharedTierWorker(
        cast(RemoteIO, cast(Any, thread)),
        None,
        blocks_per_host_block=1,
        idle_fetch_wait_s=0,
    )
    meta = OffloadStepMetadata(
        stores=[BlockTransfer(1, [5], [2], "a")],
        writes=[RemoteBlocks(1, ["k"], [2])],
    )
    _step(worker, meta)
    report = worker.take_report()
    assert report is not None and dict(report.failed) == {1: 1}
    assert dict(report.written) == {1: 1} and report.write_stored[1] == [False]
    assert not thread.writes and worker.shared.num_jobs_in_flight == 0


class _WriteRecorder:
    """The store's thread, as far as a write-through needs it."""

    def __init__(self) -> None:
        self.writes: list[RemoteBlocks] = []

    def write(self, job: RemoteBlocks) -> bool:
        self.writes.append(job)
        return True

    def poll(self) -> RemoteResults:
        return RemoteResults()
