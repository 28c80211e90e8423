"""Retention's tenants are clients' own `cache_salt`s, which a client can mint at will:
the fair share stops shrinking at the floor (`FLOOR_TENANTS`), so a retain up to it is
always kept when made; a minter's later retains give up the retain due last, its own
when it squats long; and room is found through heaps, never by walking the tenants."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState, HostBlockPool
from vllm_cpu_offload.scheduler.policies.registry import make_policy
from vllm_cpu_offload.scheduler.retention import FLOOR_TENANTS, Retention
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


def test_a_client_minting_salts_can_neither_refuse_nor_drop_an_honest_retain() -> None:
    # A client retains one block under a fresh salt each time until it holds the whole
    # budget; an honest tenant's retain of the floor is kept whole, and the minter's
    # later retains, due after it, give up the minter's own until the honest one is
    # read.
    budget = 2048
    floor = budget // FLOOR_TENANTS
    pool = HostBlockPool(4096, make_policy("lru", 4096))
    retention, clock = _retention(pool, budget)
    for i in range(budget):
        retention.retain(_store(pool, f"minted{i}", 1), f"salt{i}", 600)
    assert retention.num_blocks == budget
    honest = _store(pool, "honest", floor)
    retention.retain(honest, "honest", 60)
    assert _pinned(pool, honest)
    for i in range(budget, budget + 500):
        clock.now = (i - budget) / 20  # up to 25 s: still before the honest one is due
        retention.retain(_store(pool, f"minted{i}", 1), f"salt{i}", 600)
    assert _pinned(pool, honest) and retention.num_blocks == budget
    retention.read(honest)
    assert retention.stats.retained_hit_blocks == floor
    retention.check_invariants()


def test_a_tenant_past_the_floor_is_brought_back_to_it_its_due_last_first() -> None:
    # An honest tenant alone holds four retains of the floor; then a client mints a
    # salt per block: it takes the honest tenant's retains due last, down to the floor,
    # and then only its own.
    budget = 256
    floor = budget // FLOOR_TENANTS
    pool = HostBlockPool(1024, make_policy("lru", 1024))
    retention, _ = _retention(pool, budget)
    honest = [_store(pool, f"honest{d}", floor) for d in range(4)]
    for due, keys in zip((10, 40, 20, 30), honest, strict=True):
        retention.retain(keys, "honest", due)
    for i in range(2 * budget):
        retention.retain(_store(pool, f"minted{i}", 1), f"salt{i}", 600)
    assert [_pinned(pool, keys) for keys in honest] == [True, False, False, False]
    assert retention.num_blocks == budget
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


class _CountingDict(dict[Any, int]):
    """Counts the tenants whose usage is read, one by one or by walking them all."""

    reads = 0

    def __getitem__(self, key: Any) -> int:
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


def test_a_retain_among_50k_tenants_reads_a_few_usages_not_all() -> None:
    # 50,000 salts hold two blocks each of a full budget; each further salt's retain of
    # one block is kept, the room found through the heaps: a handful of usages read,
    # not 50,000.
    tenants = 50_000
    retention, _ = _retention(_EveryBlockStored(), 2 * tenants)
    for i in range(tenants):
        retention.retain([(0, 2 * i), (0, 2 * i + 1)], f"salt{i}", 600)
    usage = _CountingDict(retention._usage)
    retention._usage = usage
    new = [(1, i) for i in range(20)]
    for i, key in enumerate(new):
        retention.retain([key], f"new{i}", 60)
    assert usage.reads <= 20 * 16
    retention.read(new)
    assert retention.stats.retained_hit_blocks == 20
    retention.check_invariants()
