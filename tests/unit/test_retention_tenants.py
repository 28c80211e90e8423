"""Retention's tenants are clients' own `cache_salt`s, which a client can mint at will:
a tenant's share is counted over at most two tenants, so minted salts take from a
tenant no more than one other tenant could; room is taken only from a tenant's excess
over its share, trimmed from the end of its retain due last; and the tenant that holds
the most is found through heaps, never by walking the tenants."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState, HostBlockPool
from vllm_cpu_offload.scheduler.policies.registry import make_policy
from vllm_cpu_offload.scheduler.retention import MAX_SHARERS, Retention
from vllm_cpu_offload.scheduler.tier_stats import TierStats


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _retention(pool: Any, budget: int) -> tuple[Retention, Clock]:
    clock = Clock()
    return Retention(pool, budget, TierStats(block_bytes=1), clock=clock), clock


def _store(pool: HostBlockPool, name: str, n: int) -> list[BlockKey]:
    """A chain of `n` stored blocks named `name`."""
    keys: list[BlockKey] = [(0, f"{name}/{i}") for i in range(n)]
    assert len(pool.allocate_for_store(keys, None)) == n, "the pool had no room"
    pool.complete_store(keys, True)
    return keys


def _pinned(pool: HostBlockPool, keys: list[BlockKey]) -> bool:
    return all(pool._by_key[k].pin_count > 0 for k in keys)


def pool_pinned(pool: HostBlockPool) -> Callable[[BlockKey], bool]:
    return lambda key: pool._by_key[key].pin_count > 0


def _kept_under_attack(budget: int, fresh_salts: bool) -> int:
    """An honest tenant retains a 32-block prefix for ten minutes; an adversary then
    retains 32 blocks for 3 s every second, 100 times, under one salt or a fresh salt
    each time: the fewest of the honest prefix's first blocks kept at any time."""
    pool = HostBlockPool(4096, make_policy("lru", 4096))
    retention, clock = _retention(pool, budget)
    honest = _store(pool, "honest", 32)
    retention.retain(honest, "honest", 600)
    fewest = len(honest)
    for i in range(100):
        clock.now = float(i)
        retention.expire()
        salt = f"salt{i}" if fresh_salts else "adversary"
        retention.retain(_store(pool, f"adversary{i}", 32), salt, 3)
        kept = sum(1 for _ in itertools.takewhile(pool_pinned(pool), honest))
        assert retention.holding("honest") == kept  # its first blocks: a prefix
        fewest = min(fewest, kept)
        retention.check_invariants()
    retention.read(honest[:fewest])  # the client comes back: a hit on all it kept
    assert retention.stats.retained_hit_blocks == fewest
    return fewest


@pytest.mark.parametrize("budget", [48, 64])
def test_minted_salts_take_from_an_honest_retain_what_one_tenant_would(
    budget: int,
) -> None:
    # The attack of short retains under a fresh salt each: they are always within
    # their share and due first, and once gave up the honest tenant's whole retain.
    # Now the honest tenant is trimmed to its share of two, the same as against one
    # adversary salt, and keeps its first blocks.
    guaranteed = min(32, budget // MAX_SHARERS)
    one_salt = _kept_under_attack(budget, fresh_salts=False)
    minted = _kept_under_attack(budget, fresh_salts=True)
    assert minted >= one_salt
    assert minted == one_salt == guaranteed


def test_a_tenant_past_its_share_is_trimmed_to_it_its_due_last_tail_first() -> None:
    # An honest tenant alone holds four retains of ten blocks; then a client mints a
    # salt per block: the honest tenant gives up its excess over half the budget, its
    # retain due last whole and the next one's tail, keeping that one's first blocks.
    budget = 48
    share = budget // MAX_SHARERS
    pool = HostBlockPool(1024, make_policy("lru", 1024))
    retention, _ = _retention(pool, budget)
    honest = [_store(pool, f"honest{d}", 10) for d in range(4)]
    for due, keys in zip((10, 40, 20, 30), honest, strict=True):
        retention.retain(keys, "honest", due)
    for i in range(2 * budget):
        retention.retain(_store(pool, f"minted{i}", 1), f"salt{i}", 600)
        retention.check_invariants()
    assert retention.holding("honest") == share
    kept = 10 + 10 + (share - 20)  # due at 10 and 20 whole, 30's first blocks
    assert [_pinned(pool, k) for k in honest] == [True, False, True, False]
    assert _pinned(pool, honest[3][: kept - 20]) and not any(
        pool._by_key[k].pin_count for k in honest[3][kept - 20 :]
    )
    assert retention.num_blocks == budget


def test_when_every_tenant_is_within_its_share_a_new_tenant_keeps_the_room_left() -> (
    None
):
    # Two tenants hold half the budget each; a third, and any number of salts after
    # it, take nothing from them: each keeps the room left, here none.
    pool = HostBlockPool(64, make_policy("lru", 64))
    retention, _ = _retention(pool, budget=8)
    x, y = _store(pool, "x", 4), _store(pool, "y", 4)
    retention.retain(x, "x", 600)
    retention.retain(y, "y", 1)
    for i in range(10):
        retention.retain(_store(pool, f"z{i}", 2), f"salt{i}", 60)
    assert _pinned(pool, x) and _pinned(pool, y) and retention.num_blocks == 8
    retention.check_invariants()


def test_a_tenant_asking_past_its_share_keeps_its_blocks_up_to_it() -> None:
    # x holds one block, y three (past its share of two): x's retain of three more is
    # due after its own, so it gives up none of x's; it still gets one block, x's share,
    # taken from y's due last.
    pool = HostBlockPool(16, make_policy("lru", 16))
    retention, _ = _retention(pool, budget=4)
    retention.retain(_store(pool, "x1", 1), "x", 60)
    y1, y2 = _store(pool, "y1", 2), _store(pool, "y2", 1)
    retention.retain(y1, "y", 30)
    retention.retain(y2, "y", 40)
    x2 = _store(pool, "x2", 3)
    retention.retain(x2, "x", 90)
    assert _pinned(pool, x2[:1]) and not _pinned(pool, x2[1:])
    assert _pinned(pool, y1) and not _pinned(pool, y2)
    retention.check_invariants()


def test_a_seeded_mix_of_tenants_retains_reads_and_expiries_keeps_every_invariant() -> (
    None
):
    # Named tenants and fresh salts retain prefixes of shared chains for short and
    # long times, read, forget and expire them, past the budget: every structure
    # (the heaps included) is checked after each step.
    rng = random.Random(7)
    pool = HostBlockPool(64, make_policy("lru", 64))
    retention, clock = _retention(pool, budget=16)
    chains = [_store(pool, f"chain{i}", rng.randint(1, 4)) for i in range(12)]
    for step in range(3000):
        chain = rng.choice(chains)
        keys = chain[: rng.randint(1, len(chain))]
        action = rng.random()
        if action < 0.6:
            tenant = rng.choice([None, "a", "b", "c", f"salt{step}"])
            retention.retain(keys, tenant, rng.choice([1.0, 5.0, 50.0]))
        elif action < 0.8:
            retention.read(keys)
        elif action < 0.9:
            retention.forget(keys)
        else:
            clock.now += rng.random() * 5
            retention.expire()
        retention.check_invariants()
    pool.check_invariants()
    retention.release_all()
    assert retention.num_blocks == pool.num_pinned == 0


class _EveryBlockStored:
    """A pool that holds every block, stored: retention alone, at scale."""

    def state_of(self, key: BlockKey) -> BlockState:
        return BlockState.READY

    def pin(self, keys: list[BlockKey]) -> None:
        pass

    def unpin(self, keys: list[BlockKey]) -> None:
        pass


class _CountingDict(dict[Any, Any]):
    """Counts the tenants whose holding is read, one by one or by walking them all."""

    reads = 0

    def __getitem__(self, key: Any) -> Any:
        self.reads += 1
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.reads += 1
        return super().get(key, default)

    def __iter__(self) -> Iterator[Any]:
        self.reads += len(self)
        return super().__iter__()

    def items(self) -> Any:
        self.reads += len(self)
        return super().items()


def test_a_retain_among_50k_tenants_reads_a_few_holdings_not_all() -> None:
    # One tenant holds 50,010 blocks of a budget of 100,000 (alone, all of it was its
    # share), then 49,990 salts one block each. Ten further salts' retains are kept,
    # trimmed from the big tenant's excess over half the budget; the next ten find
    # every tenant within its share and keep nothing: each reads a handful of
    # holdings through the heaps, not 50,000.
    budget, big = 100_000, 50_010
    retention, _ = _retention(_EveryBlockStored(), budget)
    for r in range(big // 10):
        retention.retain([(0, 10 * r + i) for i in range(10)], "big", 600 + r)
    for i in range(budget - big):
        retention.retain([(1, i)], f"salt{i}", 600)
    held = _CountingDict(retention._held)
    retention._held = held
    new = [(2, i) for i in range(20)]
    for i, key in enumerate(new):
        retention.retain([key], f"new{i}", 60)
    assert held.reads <= 20 * 16
    assert retention.holding("big") == budget // MAX_SHARERS
    retention.read(new)
    assert retention.stats.retained_hit_blocks == 10
    retention.check_invariants()


_TENANTS = ("a", "b", None)  # and a fresh salt, drawn as index 3

_retains = st.tuples(
    st.just("retain"),
    st.integers(0, 3),  # the tenant
    st.integers(0, 2),  # which of the tenant's chains (each of 6 blocks)
    st.integers(1, 6),  # the prefix retained
    st.sampled_from([1.0, 5.0, 50.0]),
)
_steps = st.one_of(
    _retains,
    st.tuples(st.just("read"), st.integers(0, 3), st.integers(0, 2), st.integers(1, 6)),
    st.tuples(st.just("wait"), st.floats(0.0, 10.0)),
)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(_steps, min_size=20, max_size=60), budget=st.integers(2, 16))
def test_no_tenant_within_its_share_loses_a_block_to_another_tenants_retain(
    steps: list[tuple[Any, ...]], budget: int
) -> None:
    # Tenants (fresh salts among them) retain, read and wait in any order: a retain
    # never takes a block from another tenant within its share (counted with the
    # retaining one), leaves one past it at least its share, and takes from another
    # only as far as its own tenant stays within its share.
    pool = HostBlockPool(1024, make_policy("lru", 1024))
    retention, clock = _retention(pool, budget)
    chains: dict[tuple[Any, int], list[BlockKey]] = {}
    for step, (op, *args) in enumerate(steps):
        if op == "wait":
            clock.now += args[0]
            retention.expire()
            continue
        who, chain, length = args[:3]
        tenant = _TENANTS[who] if who < 3 else f"salt{step}"
        if (tenant, chain) not in chains:
            chains[tenant, chain] = _store(pool, f"{tenant}/{chain}", 6)
        keys = chains[tenant, chain][:length]
        if op == "read":
            retention.read(keys)
            continue
        share = retention.share(tenant)
        before = {t: set(h) for t, h in retention._held.items() if t != tenant}
        retention.retain(keys, tenant, args[3])
        took = False
        for other, held in before.items():
            after = set(retention._held.get(other, ()))
            if len(held) <= share:
                assert held <= after, (other, held - after)
            else:
                assert len(after) >= share
            took |= not held <= after
        if took:
            assert retention.holding(tenant) <= share
        retention.check_invariants()
    pool.check_invariants()


def test_a_retained_block_whose_store_began_before_a_reset_ends_its_retain() -> None:
    # A block still being stored when the pool is reset (the weights may change)
    # never becomes visible. A request that finishes after the reset retains it
    # while its store runs; when the store ends, the retain ends too, and no
    # invisible block is pinned.
    pool = HostBlockPool(8, make_policy("lru", 8))
    retention, _ = _retention(pool, 4)
    storing: list[BlockKey] = [(0, "s/0")]
    assert len(pool.allocate_for_store(storing, None)) == 1
    retention.release_all()
    pool.reset()
    retention.retain(storing, "t", 60)
    assert retention.holding("t") == 1
    pool.complete_store(storing, True)
    retention.stored(storing, True)
    assert pool.state_of(storing[0]) is BlockState.STORING  # held, invisible
    assert pool._by_key[storing[0]].pin_count == 0
    assert retention.holding("t") == 0
    retention.check_invariants()
