"""HostBlockPool, method by method, with LRU eviction (every registered policy runs
through the pool in test_pool_state_machine.py)."""

from __future__ import annotations

import pytest

from vllm_cpu_offload.scheduler.block_pool import BlockState, HostBlockPool, PoolEvent
from vllm_cpu_offload.scheduler.policies import LRUPolicy


def make_pool(num_blocks: int) -> HostBlockPool:
    return HostBlockPool(num_blocks, LRUPolicy(num_blocks))


def store(pool: HostBlockPool, keys: list[str], parent: str | None = None) -> list[int]:
    allocated = pool.allocate_for_store(keys, parent)
    pool.complete_store([key for key, _ in allocated], True)
    return [block_id for _, block_id in allocated]


# ----- sizes -----


def test_new_pool_is_empty() -> None:
    # A fresh pool: every block free, nothing held.
    pool = make_pool(4)
    assert (pool.num_blocks, pool.num_free, pool.usage, len(pool)) == (4, 4, 0.0, 0)
    pool.check_invariants()


def test_usage_counts_storing_and_ready() -> None:
    # Two storing and one ready block out of four: usage 3/4.
    pool = make_pool(4)
    store(pool, ["a"])
    pool.allocate_for_store(["b", "c"], "a")
    assert pool.num_free == 1 and pool.usage == 0.75 and pool.num_storing == 2


def test_negative_size_is_rejected() -> None:
    # A negative pool size is bad input.
    with pytest.raises(ValueError, match="num_blocks"):
        HostBlockPool(-1, LRUPolicy(0))


# ----- count_hits -----


def test_count_hits_is_the_ready_prefix() -> None:
    # Hits stop at the first key that is missing.
    pool = make_pool(8)
    store(pool, ["a", "b", "c"])
    assert pool.count_hits(["a", "b", "c"]) == 3
    assert pool.count_hits(["a", "x", "c"]) == 1
    assert pool.count_hits(["x", "a"]) == 0
    assert pool.count_hits([]) == 0


def test_count_hits_ignores_storing_blocks() -> None:
    # A block whose store has not finished is invisible, and so is all after it.
    pool = make_pool(8)
    store(pool, ["a"])
    pool.allocate_for_store(["b", "c"], "a")
    assert pool.count_hits(["a", "b", "c"]) == 1
    pool.complete_store(["b", "c"], True)
    assert pool.count_hits(["a", "b", "c"]) == 3


def test_count_hits_is_a_use() -> None:
    # Looking a block up makes it recent: the untouched one is evicted instead.
    pool = make_pool(2)
    store(pool, ["a"])
    store(pool, ["b"])
    assert pool.count_hits(["a"]) == 1
    store(pool, ["c"])
    assert "a" in pool and "b" not in pool


@pytest.mark.parametrize("by_device", [False, True])
def test_touch_is_a_use_and_ignores_missing_keys(by_device: bool) -> None:
    # touch() refreshes held blocks (a multi-group hit, or device hits) and skips
    # keys the pool lacks.
    pool = make_pool(2)
    store(pool, ["a"])
    store(pool, ["b"])
    pool.touch(["zz", "a"], by_device=by_device)
    store(pool, ["c"])
    assert "a" in pool and "b" not in pool


# ----- pin / unpin -----


def test_pin_returns_block_ids_in_order() -> None:
    # Pinning for a load hands back the ids the blocks were stored at.
    pool = make_pool(4)
    ids = store(pool, ["a", "b", "c"])
    assert pool.pin(["a", "b", "c"]) == ids
    assert pool.num_pinned == 3


def test_pin_rejects_missing_or_storing_keys_atomically() -> None:
    # One bad key: ValueError, and nothing was pinned.
    pool = make_pool(4)
    store(pool, ["a"])
    pool.allocate_for_store(["b"], "a")
    for bad in (["a", "x"], ["a", "b"]):
        with pytest.raises(ValueError, match="cannot pin"):
            pool.pin(bad)
    assert pool.num_pinned == 0


def test_pinned_blocks_are_never_evicted() -> None:
    # A full pool of pinned blocks: new stores get nothing; after unpin they get room.
    pool = make_pool(2)
    store(pool, ["a", "b"])
    pool.pin(["a", "b"])
    assert pool.allocate_for_store(["x"], None) == []
    assert "a" in pool and "b" in pool
    pool.unpin(["a", "b"])
    assert len(pool.allocate_for_store(["x"], None)) == 1


def test_pins_are_counted() -> None:
    # Two loads of one block: it stays pinned until both end.
    pool = make_pool(1)
    store(pool, ["a"])
    pool.pin(["a"])
    pool.pin(["a"])
    pool.unpin(["a"])
    assert pool.allocate_for_store(["x"], None) == []
    pool.unpin(["a"])
    assert pool.allocate_for_store(["x"], None) != []


def test_unpin_rejects_unpinned_keys() -> None:
    # Unpinning what is not pinned is a caller bug reported as ValueError.
    pool = make_pool(2)
    store(pool, ["a"])
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin(["a"])
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin(["x"])


# ----- allocate_for_store / complete_store -----


def test_allocate_skips_held_keys() -> None:
    # Held keys (ready or storing) are skipped; the others get distinct ids.
    pool = make_pool(8)
    store(pool, ["a"])
    pool.allocate_for_store(["b"], "a")
    allocated = pool.allocate_for_store(["a", "b", "c", "d"], None)
    assert [key for key, _ in allocated] == ["c", "d"]
    ids = [block_id for _, block_id in allocated]
    assert len(set(ids)) == 2 and all(0 <= i < 8 for i in ids)
    pool.check_invariants()


def test_allocate_evicts_to_make_room() -> None:
    # A full pool of ready blocks: storing a new chain evicts old ones,
    # never exceeds size.
    pool = make_pool(3)
    store(pool, ["a", "b", "c"])
    store(pool, ["x", "y"])
    assert "x" in pool and "y" in pool and len(pool) == 3 and pool.num_free == 0
    pool.check_invariants()


def test_allocate_stops_when_nothing_is_evictable() -> None:
    # Everything storing: the store gets what is free and stops, without raising.
    pool = make_pool(3)
    pool.allocate_for_store(["a", "b"], None)
    allocated = pool.allocate_for_store(["c", "d", "e"], "b")
    assert [key for key, _ in allocated] == ["c"]
    assert pool.allocate_for_store(["z"], None) == []
    pool.check_invariants()


def test_allocate_on_zero_blocks_gets_nothing() -> None:
    # A pool of size 0 (swap space too small) accepts no store and never raises.
    pool = make_pool(0)
    assert pool.allocate_for_store(["a"], None) == []
    assert pool.count_hits(["a"]) == 0 and pool.usage == 0.0


def test_failed_store_frees_its_block_for_reuse() -> None:
    # A failed store frees its id, the next allocation reuses it, and the key is a miss.
    pool = make_pool(4)
    [(_, block_id)] = pool.allocate_for_store(["a"], None)
    pool.complete_store(["a"], False)
    assert "a" not in pool and pool.num_free == 4
    assert pool.allocate_for_store(["b"], None) == [("b", block_id)]


def test_complete_store_rejects_keys_not_being_stored() -> None:
    # Completing a ready or unknown key is a caller bug; nothing changes.
    pool = make_pool(4)
    store(pool, ["a"])
    pool.allocate_for_store(["b"], "a")
    for keys in (["b", "a"], ["a", "b"], ["b", "b"], ["b", "x"]):
        with pytest.raises(ValueError, match="not being stored"):
            pool.complete_store(keys, True)
        assert pool.state_of("b") is BlockState.STORING and pool.num_storing == 1
        assert pool.count_hits(["a", "b"]) == 1
        pool.check_invariants()


def test_failed_parent_store_orphans_its_children() -> None:
    # The parent's store fails after the child's succeeded: the child stays,
    # as an orphan.
    pool = make_pool(4)
    pool.allocate_for_store(["a", "b"], None)
    pool.complete_store(["b"], True)
    pool.complete_store(["a"], False)
    assert "a" not in pool and pool.state_of("b") is BlockState.READY
    pool.check_invariants()


def test_parent_outside_the_pool_is_allowed() -> None:
    # A chain whose parent the pool never held (it lives on the GPU) is stored anyway.
    pool = make_pool(4)
    assert len(pool.allocate_for_store(["b", "c"], "a")) == 2
    pool.complete_store(["b", "c"], True)
    assert pool.count_hits(["b", "c"]) == 2


# ----- reset -----


def test_reset_drops_only_ready_unpinned_blocks() -> None:
    # reset_prefix_cache: ready blocks go; pinned and storing blocks stay.
    pool = make_pool(8)
    store(pool, ["a", "b", "c"])
    pool.pin(["a"])
    pool.allocate_for_store(["d"], "c")
    assert pool.reset() == 2
    assert "a" in pool and "d" in pool and "b" not in pool and "c" not in pool
    pool.check_invariants()
    pool.unpin(["a"])
    pool.complete_store(["d"], True)
    assert pool.reset() == 2 and len(pool) == 0 and pool.num_free == 8


def test_blocks_held_through_a_reset_are_never_hits_again() -> None:
    # vLLM resets before it changes the weights: a block pinned by a load or still
    # being stored at the reset holds KV of the old weights. No lookup sees it, it is
    # neither told of nor kept when its store ends, it goes first once its loads and
    # stores end, and a store of its key frees it (the KV of the weights now).
    pool = make_pool(4)
    store(pool, ["a", "b"])
    pool.pin(["a"])
    pool.allocate_for_store(["c"], "b")
    pool.take_events()
    assert pool.reset() == 1  # "b"
    assert pool.allocate_for_store(["a", "d"], None) == [("d", 1)]  # "a" is pinned
    pool.unpin(["a"])
    pool.complete_store(["c"], True)
    assert pool.count_hits(["a"]) == 0 and pool.count_hits(["c"]) == 0
    assert pool.state_of("a") is pool.state_of("c") is BlockState.STORING
    assert [(e.kind, e.keys) for e in pool.take_events()] == [("evicted", ("b",))]
    pool.check_invariants()
    store(pool, ["e"])  # the one free block
    store(pool, ["f"])  # "a" goes first, before the policy's victims
    assert "a" not in pool and "c" in pool and "d" in pool
    assert pool.allocate_for_store(["c"], None) == [("c", 2)]  # stored anew
    pool.complete_store(["c"], True)
    assert pool.count_hits(["c"]) == 1
    assert [(e.kind, e.keys) for e in pool.take_events()] == [
        ("stored", ("e",)),
        ("evicted", ("a",)),
        ("stored", ("f",)),
        ("evicted", ("c",)),
        ("stored", ("c",)),
    ]
    pool.check_invariants()


# ----- events -----


def test_events_report_stores_and_evictions_once() -> None:
    # Stored keys appear when visible; evicted keys when they leave; take_events drains.
    pool = make_pool(2)
    pool.allocate_for_store(["a", "b"], None)
    assert pool.take_events() == []
    pool.complete_store(["a", "b"], True)
    store(pool, ["x"])
    events = pool.take_events()
    assert events[0] == PoolEvent("stored", ("a", "b"))
    assert events[1].kind == "evicted" and len(events[1].keys) == 1
    assert events[2] == PoolEvent("stored", ("x",))
    assert pool.take_events() == []


def test_failed_stores_emit_no_event() -> None:
    # A store that never became visible is not announced.
    pool = make_pool(2)
    pool.allocate_for_store(["a"], None)
    pool.complete_store(["a"], False)
    assert pool.take_events() == []


def test_events_can_be_turned_off() -> None:
    # With KV events disabled nothing accumulates.
    pool = HostBlockPool(2, LRUPolicy(2), record_events=False)
    store(pool, ["a", "b", "c"])
    assert pool.take_events() == []
