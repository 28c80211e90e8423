"""The caching field's anchor policies (ARC, LIRS, S3-FIFO): each one's defining
behaviour on small scenarios, and what sets them apart from LRU."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState, HostBlockPool
from vllm_cpu_offload.scheduler.policies.arc import ARCPolicy
from vllm_cpu_offload.scheduler.policies.lirs import LIRSPolicy
from vllm_cpu_offload.scheduler.policies.registry import make_policy
from vllm_cpu_offload.scheduler.policies.s3fifo import S3FIFOPolicy


def store(pool: HostBlockPool, keys: list[object]) -> int:
    allocated = pool.allocate_for_store(keys, None)
    pool.complete_store([key for key, _ in allocated], True)
    return len(allocated)


def store_each(pool: HostBlockPool, keys: Sequence[object]) -> None:
    for key in keys:
        store(pool, [key])


# ----- shared: a hot set survives a scan larger than the pool -----


@pytest.mark.parametrize(
    ("name", "keeps_hot_set"),
    [("lru", False), ("arc", True), ("lirs", True), ("s3fifo", True)],
)
def test_hot_set_survives_a_one_off_scan(name: str, keeps_hot_set: bool) -> None:
    # Six blocks used three times, then 40 one-off blocks: LRU loses the hot set.
    pool = HostBlockPool(10, make_policy(name, 10))
    hot = [f"h{i}" for i in range(6)]
    store_each(pool, hot)
    for _ in range(2):
        for key in hot:
            assert pool.count_hits([key]) == 1
    store_each(pool, [f"scan{i}" for i in range(40)])
    kept = sum(key in pool for key in hot)
    assert (kept == len(hot)) is keeps_hot_set, kept


@pytest.mark.parametrize("name", ["arc", "lirs", "s3fifo"])
def test_pinned_block_outlives_pressure_and_comes_back(name: str) -> None:
    # The oldest block is pinned by a load while the pool churns: never a victim.
    # Once unpinned it is the only evictable block, and the policy finds it.
    pool = HostBlockPool(4, make_policy(name, 4))
    store_each(pool, ["a", "b", "c", "d"])
    pool.pin(["a"])
    store_each(pool, [f"x{i}" for i in range(12)])
    assert "a" in pool
    pool.unpin(["a"])
    others = [key for key in pool._by_key if key != "a"]
    pool.pin(others)
    assert store(pool, ["y"]) == 1
    assert "a" not in pool
    pool.unpin(others)
    pool.check_invariants()


# ----- ARC -----


def arc_after_b1_hit() -> tuple[ARCPolicy, HostBlockPool]:
    """A pool of 4 whose p grew to 1 on a B1 hit; T1 = {f, g}, T2 = {d, a}."""
    policy = ARCPolicy(4)
    pool = HostBlockPool(4, policy)
    store_each(pool, ["a", "b", "c", "d"])
    pool.count_hits(["d"])  # T1 = {a, b, c}, T2 = {d}
    store(pool, ["e"])  # T1 is over its target of 0: its oldest, a, goes to B1
    assert "a" not in pool and policy.p == 0.0
    store(pool, ["a"])  # B1 hit: p grows, a starts in T2, b goes to B1
    assert policy.p == 1.0 and "a" in pool and "b" not in pool
    store_each(pool, ["f", "g"])  # T1 holds more than p: T1 pays twice
    return policy, pool


def test_arc_ghost_hit_in_b1_grows_t1_target() -> None:
    # A key that left T1 comes back: T1 was too small, p grows; T2 keeps its blocks.
    policy, pool = arc_after_b1_hit()
    assert all(k in pool for k in "dafg") and policy.p == 1.0


def test_arc_ghost_hit_in_b2_shrinks_t1_target() -> None:
    # A key that left T2 comes back: T2 was too small, p shrinks (by |B1| / |B2|).
    policy, pool = arc_after_b1_hit()
    pool.count_hits(["f"])
    pool.count_hits(["g"])  # T1 empty, T2 = {d, a, f, g}
    store(pool, ["x"])  # T1 at or under p: T2's oldest, d, goes to B2
    assert "d" not in pool
    store(pool, ["d"])
    assert policy.p == 0.0 and "d" in pool


def test_arc_ghost_lists_stay_within_capacity() -> None:
    # 500 one-off keys through a pool of 8: at most one ghost key per host block.
    policy = ARCPolicy(8)
    pool = HostBlockPool(8, policy)
    store_each(pool, list(range(500)))
    assert len(policy._b1) + len(policy._b2) <= 8


# ----- LIRS -----


def test_lirs_promotes_a_hir_block_reused_within_the_stack() -> None:
    # A HIR block used again before the oldest LIR block becomes LIR; the oldest LIR
    # block drops to the HIR queue and is the next victim.
    policy = LIRSPolicy(4, hir_fraction=0.25)  # 3 LIR blocks, 1 HIR
    pool = HostBlockPool(4, policy)
    store_each(pool, ["a", "b", "c"])  # LIR
    store(pool, ["h"])  # HIR, used after a: in S
    pool.count_hits(["h"])
    assert policy.num_lir == 3
    store(pool, ["x"])  # the victim is a, demoted to the HIR queue's head
    assert "a" not in pool and all(k in pool for k in "bchx")


def test_lirs_recalls_an_evicted_key_still_in_the_stack() -> None:
    # A HIR block evicted while in S is remembered; stored again, it enters as LIR.
    policy = LIRSPolicy(4, hir_fraction=0.25)
    pool = HostBlockPool(4, policy)
    store_each(pool, ["a", "b", "c", "h"])
    store(pool, ["x"])  # h (resident HIR, in S) goes, remembered
    assert "h" not in pool
    store(pool, ["h"])  # used again after a: its reuse distance beats a's recency
    store_each(pool, ["y", "z"])
    assert "h" in pool and "a" not in pool


def test_lirs_forgets_history_below_the_stack_and_bounds_it() -> None:
    # A long scan: the history never exceeds 2x the pool, and a key whose entry fell
    # below the oldest LIR block is not recalled.
    policy = LIRSPolicy(10)
    pool = HostBlockPool(10, policy)
    store_each(pool, [f"lir{i}" for i in range(9)])
    store_each(pool, list(range(1000)))
    assert len(policy._history) <= 20
    for i in range(9):
        pool.count_hits([f"lir{i}"])  # S's bottom moves past every scanned key
    store(pool, [5])
    assert policy.num_lir == policy.lir_cap and all(f"lir{i}" in pool for i in range(9))


def test_lirs_rejects_bad_fractions() -> None:
    # The HIR share must leave room for both sets.
    with pytest.raises(ValueError, match="hir_fraction"):
        LIRSPolicy(8, hir_fraction=1.0)


# ----- S3-FIFO -----


def test_s3fifo_evicts_one_hit_wonders_from_the_small_queue_first() -> None:
    # Ten blocks in S, the oldest used once more: it moves to M, and the blocks seen
    # once go first, oldest first.
    policy = S3FIFOPolicy(10)
    pool = HostBlockPool(10, policy)
    keys = [f"k{i}" for i in range(10)]
    store_each(pool, keys)
    pool.count_hits(["k0"])
    store_each(pool, ["x", "y"])
    assert "k0" in pool and "k1" not in pool and "k2" not in pool
    assert all(k in pool for k in keys[3:])


def test_s3fifo_ghost_hit_enters_the_main_queue() -> None:
    # A key evicted from S comes back: it skips S, so the next new keys cannot push
    # it out through the small queue.
    policy = S3FIFOPolicy(10)
    pool = HostBlockPool(10, policy)
    store_each(pool, [f"k{i}" for i in range(10)])
    store(pool, ["x"])  # k0 goes to the ghost queue
    store(pool, ["k0"])
    assert policy.num_small < 10  # k0 is not in S
    store_each(pool, [f"y{i}" for i in range(8)])
    assert "k0" in pool


def test_s3fifo_main_queue_gives_second_chances() -> None:
    # Everything moved to M; S is under its share, so M pays: a used block is
    # reinserted with one use less and the next unused one goes.
    policy = S3FIFOPolicy(20)  # S's share: 2 blocks
    pool = HostBlockPool(20, policy)
    keys = [f"k{i}" for i in range(20)]
    store_each(pool, keys)
    for key in keys:
        pool.count_hits([key])
    # S moves to M (uses spent) until it is under its share; then M's head k0 goes.
    store(pool, ["x"])
    assert "k0" not in pool and policy.num_small == 2  # k19 and x
    pool.count_hits(["k1"])
    store(pool, ["y"])
    assert "k1" in pool and "k2" not in pool and "x" in pool


# ----- bookkeeping under random traffic -----


def _recount(pool: HostBlockPool) -> dict[str, int]:
    policy = pool.policy
    blocks = list(pool._by_key.values())
    storing = [b for b in blocks if b.state is BlockState.STORING]
    if isinstance(policy, ARCPolicy):
        return {
            "_n_t1": sum(b.segment == 1 for b in blocks),
            "_n_t2": sum(b.segment == 2 for b in blocks),
            "_t1_storing": sum(b.segment == 1 for b in storing),
        }
    if isinstance(policy, LIRSPolicy):
        return {
            "num_lir": sum(b.segment == 1 for b in blocks),
            "_hir_storing": sum(b.segment == 2 for b in storing),
        }
    return {
        "num_small": sum(b.segment == 1 for b in blocks),
        "_small_storing": sum(b.segment == 1 for b in storing),
    }


@pytest.mark.parametrize("name", ["arc", "lirs", "s3fifo"])
def test_segment_counts_match_the_blocks_under_random_traffic(name: str) -> None:
    # Stores (some failing), loads, touches and resets at random: the policy's
    # per-segment counts always equal a recount of the blocks.
    rng = random.Random(7)
    pool = HostBlockPool(16, make_policy(name, 16))
    in_flight: list[Sequence[BlockKey]] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.4:
            chain = rng.sample(range(60), rng.randint(1, 8))
            allocated = pool.allocate_for_store(chain, None)
            in_flight.append([key for key, _ in allocated])
        elif op < 0.6 and in_flight:
            keys = in_flight.pop(rng.randrange(len(in_flight)))
            pool.complete_store(keys, rng.random() < 0.9)
        elif op < 0.8:
            keys = rng.sample(range(60), 4)
            hits = pool.count_hits(keys)
            if hits:
                pool.pin(keys[:hits])
                pool.unpin(keys[:hits])
        elif op < 0.995:
            pool.touch(rng.sample(range(60), 4))
        else:
            pool.reset()
        counts = _recount(pool)
        assert {k: getattr(pool.policy, k) for k in counts} == counts, step
