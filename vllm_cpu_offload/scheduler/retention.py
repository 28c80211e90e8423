"""Retained prefixes: the blocks of a finished request whose client said it will read
them again (`retain`), kept from eviction until a later request reads them or their
time passes, within a bounded and fair share of the tier.

A retained block is pinned in the pool (the policy unlists it, as for a load), so no
policy, built in or a user's, can evict it. Blocks still being stored when their request
finishes are pinned as their stores complete. Bounds:
- all retains together hold at most `budget` blocks (`retain_share` of the tier);
- tenants (`cache_salt`) share the budget fairly: when it is full, a tenant below its
  fair share (the budget over the tenants retaining) takes room from the oldest retain
  of the tenant that holds the most; a tenant at or above it gives up its own oldest. A
  retain larger than the room left keeps its first blocks (a prefix is read from the
  front).
A retain ends when a later request reads any of its blocks (from host memory or the
device's prefix cache: the client came back; the blocks are then as recent as any use
makes them), when its time passes (counted unread), when a newer retain takes its
blocks, or on `done` and cache resets. Every call is O(blocks it names) plus
O(tenants) per retain given up for room.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState
from vllm_cpu_offload.scheduler.manager import HostTierManager
from vllm_cpu_offload.scheduler.tier_stats import TierStats


@dataclass
class _Retain:
    rid: int
    tenant: str | None
    deadline: float
    pinned: set[BlockKey] = field(default_factory=set)
    pending: set[BlockKey] = field(default_factory=set)  # STORING when retained

    @property
    def size(self) -> int:
        return len(self.pinned) + len(self.pending)


class Retention:
    """See the module docstring."""

    def __init__(
        self,
        pool: HostTierManager,
        budget: int,
        stats: TierStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.budget = budget
        # retained_blocks (now), retained_hit_blocks, retains_expired_unread
        self.stats = stats
        self._clock = clock
        self._retains: dict[int, _Retain] = {}
        self._by_key: dict[BlockKey, int] = {}
        self._deadlines: list[tuple[float, int]] = []
        # tenant -> its retains, oldest first
        self._tenants: dict[str | None, OrderedDict[int, None]] = {}
        self._usage: dict[str | None, int] = {}  # tenant -> blocks it retains
        self._held = 0
        self._next_rid = 0

    @property
    def num_blocks(self) -> int:
        """Blocks retained now (pinned, or pinned once stored)."""
        return self._held

    def retain(
        self, keys: Sequence[BlockKey], tenant: str | None, seconds: float
    ) -> None:
        """Keeps `keys` (a request's blocks, in chain order) for `seconds`; those the
        pool does not hold are skipped."""
        state_of = self.pool.state_of
        held = [k for k in keys if state_of(k) is not None]
        for key in held:  # a newer retain of a block takes it over
            if key in self._by_key:
                self._drop_key(key)
        room = self._make_room(tenant, len(held))
        held = held[:room]
        if not held:
            return
        entry = _Retain(self._next_rid, tenant, self._clock() + seconds)
        self._next_rid += 1
        ready = [k for k in held if state_of(k) is BlockState.READY]
        self.pool.pin(ready)
        entry.pinned.update(ready)
        entry.pending.update(k for k in held if state_of(k) is not BlockState.READY)
        for key in held:
            self._by_key[key] = entry.rid
        self._retains[entry.rid] = entry
        self._tenants.setdefault(tenant, OrderedDict())[entry.rid] = None
        heapq.heappush(self._deadlines, (entry.deadline, entry.rid))
        self._count(entry, entry.size)

    def stored(self, keys: Sequence[BlockKey], success: bool) -> None:
        """A store of `keys` ended: retained ones are pinned now, or dropped if it
        failed."""
        for key in keys:
            rid = self._by_key.get(key)
            if rid is None or key not in self._retains[rid].pending:
                continue
            entry = self._retains[rid]
            entry.pending.discard(key)
            if success:
                self.pool.pin([key])
                entry.pinned.add(key)
            else:
                del self._by_key[key]
                self._count(entry, -1)
                self._end_if_empty(entry)

    def read(self, keys: Sequence[BlockKey]) -> None:
        """A request reads `keys`: the retains they belong to are fulfilled."""
        if not self._by_key:  # nothing retained: the common case, O(1)
            return
        fulfilled = {rid for key in keys if (rid := self._by_key.get(key)) is not None}
        if not fulfilled:
            return
        self.stats.retained_hit_blocks += sum(key in self._by_key for key in keys)
        for rid in fulfilled:
            self._release(self._retains[rid])

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Ends the retains of `keys` (the session is done)."""
        if not self._by_key:
            return
        for key in keys:
            rid = self._by_key.get(key)
            if rid is not None:
                self._release(self._retains[rid])

    def expire(self) -> None:
        """Ends the retains whose time passed (once a step)."""
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            entry = self._retains.get(rid)
            if entry is not None:
                self.stats.retains_expired_unread += 1
                self._release(entry)

    def release_all(self) -> None:
        """Ends every retain (vLLM resets its caches)."""
        for entry in list(self._retains.values()):
            self._release(entry)
        self._deadlines.clear()

    def check_invariants(self) -> None:
        assert self._held == sum(e.size for e in self._retains.values())
        for tenant, retains in self._tenants.items():
            assert self._usage[tenant] == sum(self._retains[r].size for r in retains)
        assert self._held <= self.budget
        assert len(self._by_key) == self._held
        for entry in self._retains.values():
            for key in entry.pinned:
                assert self.pool.state_of(key) is BlockState.READY, key

    # ---- room ----

    def _make_room(self, tenant: str | None, wanted: int) -> int:
        """Gives up retains until `wanted` blocks of `tenant` fit, fairly; how many
        fit."""
        wanted = min(wanted, self.budget)
        while self._held + wanted > self.budget:
            tenants = len(self._tenants) + (tenant not in self._tenants)
            fair = self.budget // tenants
            mine = self._usage.get(tenant, 0)
            if mine + wanted <= fair:
                others = (t for t in self._tenants if t != tenant)
                owner = max(others, key=self._usage.__getitem__)
            elif tenant in self._tenants:
                owner = tenant
            else:  # a newcomer asking past its fair share gets that share
                wanted = max(self.budget - self._held, fair)
                continue
            oldest = next(iter(self._tenants[owner]))
            self._release(self._retains[oldest])
        return wanted

    # ---- ending a retain ----

    def _release(self, entry: _Retain) -> None:
        if entry.pinned:
            self.pool.unpin(list(entry.pinned))
        for key in (*entry.pinned, *entry.pending):
            del self._by_key[key]
        self._count(entry, -entry.size)
        entry.pinned.clear()
        entry.pending.clear()
        self._end(entry)

    def _drop_key(self, key: BlockKey) -> None:
        """Takes one block out of its retain (another retain takes it over)."""
        entry = self._retains[self._by_key.pop(key)]
        if key in entry.pinned:
            entry.pinned.discard(key)
            self.pool.unpin([key])
        else:
            entry.pending.discard(key)
        self._count(entry, -1)
        self._end_if_empty(entry)

    def _count(self, entry: _Retain, blocks: int) -> None:
        self._held += blocks
        self.stats.retained_blocks = self._held
        self._usage[entry.tenant] = self._usage.get(entry.tenant, 0) + blocks

    def _end_if_empty(self, entry: _Retain) -> None:
        if entry.size == 0:
            self._end(entry)

    def _end(self, entry: _Retain) -> None:
        self._retains.pop(entry.rid, None)
        retains = self._tenants.get(entry.tenant)
        if retains is not None:
            retains.pop(entry.rid, None)
            if not retains:
                del self._tenants[entry.tenant]
                del self._usage[entry.tenant]
