"""The scheduler half with a shared store behind it: write-through and fetch
bookkeeping settled once every rank reported, through vLLM's Request and KV manager."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.unit.test_tier_scheduler import (  # noqa: E402
    BS,
    Engine,
    _key,
    _prefill,
    _request,
)
from vllm_cpu_offload.metadata import OffloadWorkerReport  # noqa: E402
from vllm_cpu_offload.remote.store import RemoteStore  # noqa: E402
from vllm_cpu_offload.scheduler.block_pool import BlockState  # noqa: E402
from vllm_cpu_offload.scheduler.remote_lookup import RemoteLookup  # noqa: E402
from vllm_cpu_offload.scheduler.shared_tier import attach_shared_tier  # noqa: E402


class _EmptyStore(RemoteStore):
    """A shared store that holds nothing: the scheduler half's write-through
    bookkeeping without lookups that hit."""

    def exists(self, keys: Any, timeout_s: float) -> list[bool]:
        return [False] * len(keys)

    def put(self, keys: Any, values: Any, timeout_s: float) -> list[bool]:
        return [True] * len(keys)

    def get(self, keys: Any, into: Any, timeout_s: float) -> list[bool]:
        return [False] * len(keys)

    @property
    def description(self) -> str:
        return "empty"


def _with_store(workers: int, **kwargs: Any) -> Engine:
    lookup = RemoteLookup(_EmptyStore(), ["r0", "r1"][:workers], timeout_s=1.0)
    engine = Engine(workers=workers, **kwargs)
    attach_shared_tier(engine.tier, lookup, namespace="")
    return engine


def test_a_store_failed_on_one_rank_keeps_its_blocks_until_every_write_ended() -> None:
    # TP=2 with a shared store: rank 1's store fails, rank 0's succeeds and queues its
    # write-through, which reads the host blocks later. They stay held (not visible,
    # not reusable by another key) until rank 0's write is reported, then go.
    engine = _with_store(2, host_blocks=2)
    request = _request("a", list(range(10)))
    (store,) = _prefill(engine, request).stores
    job = store.job_id
    failed_on_1 = OffloadWorkerReport(
        failed=Counter({job: 1}),
        written=Counter({job: 1}),
        write_stored={job: [False] * 2},
    )
    engine.tier.update_connector_output(failed_on_1)
    engine.report(job)  # rank 0: stored; its write-through is queued
    assert engine.tier.pool.state_of(_key(request, 0)) is BlockState.STORING
    other = _prefill(engine, _request("b", list(range(100, 110))))
    assert not other.stores  # both host blocks are still held
    engine.tier.update_connector_output(
        OffloadWorkerReport(written=Counter({job: 1}), write_stored={job: [True] * 2})
    )
    assert _key(request, 0) not in engine.tier.pool
    assert engine.tier.pool.num_pinned == 0 and engine.tier.stats.failed_stores == 1
    assert _prefill(engine, _request("c", list(range(200, 210)))).stores


def test_an_async_load_failed_on_every_rank_in_one_report_completes() -> None:
    # TP=2: both ranks report the async load failed in the same step (one aggregated
    # report): the job ends, its host blocks are unpinned, and reset_cache drops them.
    engine = Engine(workers=2, async_load_tokens=2 * BS)
    first = _prefill(engine, _request("a", list(range(10))))
    engine.report(first.stores[0].job_id, first.stores[0].job_id)
    engine.admit(_request("x", list(range(50, 55))))  # another request runs
    (x_store,) = engine.step({"x": 5}).stores
    engine.report(x_store.job_id, x_store.job_id)
    twin = _request("b", list(range(10)))
    assert engine.admit(twin) == 2 * BS and engine.tier.load_is_async(twin)
    (async_load,) = engine.step({}).async_loads
    job = async_load.load.job_id
    assert engine.tier.pool.num_pinned == 2
    engine.report(failed=(job, job))
    assert engine.tier.num_jobs_in_flight == 0 and engine.tier.pool.num_pinned == 0
    engine.tier.reset_cache()
    assert len(engine.tier.pool) == 0


def test_a_request_aborted_while_its_async_load_runs_is_not_held_for_stores() -> None:
    # A preempted request with a store still unreported resumes on an async host hit
    # and is aborted while the load runs: vLLM holds its blocks until the load is
    # reported (finished_recving), so the connector must not hold them too (vLLM
    # would free them twice and assert on the second).
    engine = Engine(async_load_tokens=2 * BS)
    first = _prefill(engine, _request("a", list(range(10))))
    engine.report(first.stores[0].job_id)
    engine.admit(_request("x", list(range(50, 55))))
    engine.step({"x": 5})
    request = _request("b", list(range(10)) + [7, 7])
    engine.admit(request)
    (unreported,) = engine.step({"b": 12 - 8}).stores  # b's own block 2
    engine.step({"x": 1}, preempted={"b"})
    request.num_computed_tokens = 0
    assert engine.admit(request) == 2 * BS and engine.tier.load_is_async(request)
    assert engine.step({"x": 1}).async_loads
    assert engine.tier.request_finished(request) is False
    engine.report(unreported.job_id)
    assert engine.tier.update_connector_output(None) == set()
