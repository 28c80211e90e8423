"""The scheduler half's seams without a layer: a store settles in the pool when its
copy does, nothing is fetched or written, nothing is retained, no hint is read."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState, HostBlockPool
from vllm_cpu_offload.scheduler.policies import LRUPolicy
from vllm_cpu_offload.scheduler.tier_seams import (
    NO_HINTS,
    NoRetention,
    NoSharedTier,
    RequestHints,
    no_hints,
)


def _storing(pool: HostBlockPool, keys: list[BlockKey]) -> list[BlockKey]:
    got = pool.allocate_for_store(keys, None)
    assert [key for key, _ in got] == keys
    return keys


def test_without_a_shared_tier_a_store_settles_with_its_copy() -> None:
    pool = HostBlockPool(4, LRUPolicy(4))
    shared = NoSharedTier(pool)
    keys = _storing(pool, ["a", "b"])
    assert shared.write_through(BlockTransfer(1, [1, 2], [0, 1]), keys) == []
    shared.store_completed(1, keys, None, success=True)
    assert [pool.state_of(k) for k in keys] == [BlockState.READY] * 2
    failed = _storing(pool, ["c"])
    shared.store_completed(2, failed, None, success=False)
    assert "c" not in pool and shared.num_held_writes == 0


def test_without_a_shared_tier_nothing_is_found_or_fetched() -> None:
    pool = HostBlockPool(4, LRUPolicy(4))
    shared = NoSharedTier(pool)
    assert shared.hits(["a", "b"]) == 0 and shared.held(["a"]) == frozenset()
    fetch = shared.fetch(7, ["a"], [0])
    assert (fetch.job_id, list(fetch.keys)) == (7, [])
    # A fetch nobody reported frees the host blocks it had allocated.
    keys = _storing(pool, ["x"])
    shared.fetch_abandoned(7, keys)
    assert "x" not in pool and shared.take_events() == []


def test_without_retention_or_hints_every_request_is_plain() -> None:
    pool = HostBlockPool(2, LRUPolicy(2))
    retention = NoRetention()
    keys = _storing(pool, ["a"])
    pool.complete_store(keys, True)
    retention.retain(keys, "tenant", 60.0)
    retention.stored(keys, True)
    assert retention.budget == 0 and retention.num_blocks == 0
    assert pool.num_pinned == 0  # nothing held the block
    request = SimpleNamespace(kv_transfer_params={"retain": True, "done": True})
    assert no_hints(request) is NO_HINTS and not NO_HINTS.any
    assert RequestHints(done=True).any
