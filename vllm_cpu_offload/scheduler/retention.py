"""Retained prefixes: the blocks of a finished request whose client said it will read
them again (`retain`), kept from eviction until the client comes back or the time
passes, within a bounded and fair share of the tier.

A retained block is pinned in the pool (the policy unlists it, as for a load), so no
policy, built in or a user's, can evict it; blocks still being stored when their request
finishes are pinned as their stores complete. Retains of sessions that share a prefix
(a system prompt, a tool's instructions) hold its blocks together: a block is pinned
while any retain holds it. Bounds:
- all retains together hold at most `budget` distinct blocks (`retain_share` of the
  tier);
- tenants (`cache_salt`) share the budget fairly: when it is full, a tenant below its
  fair share (the budget over the tenants retaining) takes room from the retain due
  last (the latest deadline) of the tenant that holds the most; a tenant at or above
  it gives up its own retain due last, unless that is the new one, which then keeps
  what room is left. Due last, not oldest: a client's retain time says when it comes
  back, and giving up the retain read furthest ahead keeps the others until they are
  read, where giving up the oldest would, with more sessions than room, give up each
  retain just before its read (measured: benchmarks/agent_hints.py);
- a retain larger than the room left keeps its first blocks (a prefix is read from
  the front), and a retain stops at the first block the pool does not hold (a hit
  stops there too).
A retain ends when a later request reads its last block, from host memory or the
device's prefix cache (the client came back; a read of a prefix it shares with other
sessions does not end it); when its time passes (counted unread); when a store of one of
its blocks fails; on `done` of its session, and on cache resets. Its blocks are then
unpinned deepest first, so that a policy that keeps order evicts them leaves first.
Every call is O(blocks it names), plus O(tenants + log retains) per retain given up
for room.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState
from vllm_cpu_offload.scheduler.manager import HostTierManager
from vllm_cpu_offload.scheduler.tier_stats import TierStats


@dataclass
class _Retain:
    rid: int
    tenant: str | None
    deadline: float
    keys: list[BlockKey]  # in prefix order


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
        # The time source of deadlines (a simulation steps its own).
        self.clock = clock
        self._retains: dict[int, _Retain] = {}
        self._holders: dict[BlockKey, set[int]] = {}  # key -> retains that hold it
        self._pinned: set[BlockKey] = set()  # held keys pinned in the pool
        self._by_last: dict[BlockKey, set[int]] = {}  # key -> retains it ends
        self._deadlines: list[tuple[float, int]] = []
        # tenant -> its retains; the blocks they hold; a heap of (-deadline, rid) of
        # its retains, due last first (entries of ended retains are skipped lazily)
        self._tenants: dict[str | None, set[int]] = {}
        self._usage: dict[str | None, int] = {}
        self._due_last: dict[str | None, list[tuple[float, int]]] = {}
        self._next_rid = 0

    @property
    def num_pinned(self) -> int:
        """Blocks the retains pin in the pool now."""
        return len(self._pinned)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks retained now (pinned, or pinned once stored)."""
        return len(self._holders)

    def retain(
        self, keys: Sequence[BlockKey], tenant: str | None, seconds: float
    ) -> None:
        """Keeps `keys` (a request's blocks, in prefix order) for `seconds`, up to the
        first the pool does not hold."""
        state_of = self.pool.state_of
        held = list(itertools.takewhile(lambda k: state_of(k) is not None, keys))
        deadline = self.clock() + seconds
        room = self._make_room(
            tenant, sum(k not in self._holders for k in held), deadline
        )
        # Keep the first blocks that fit, counted again: a retain given up for room
        # may have held some of them, which are new now.
        fits, taken = 0, 0
        while fits < len(held) and (held[fits] in self._holders or taken < room):
            taken += held[fits] not in self._holders
            fits += 1
        held = held[:fits]
        if not held:
            return
        entry = _Retain(self._next_rid, tenant, deadline, held)
        self._next_rid += 1
        for key in held:
            holders = self._holders.setdefault(key, set())
            holders.add(entry.rid)
            if len(holders) == 1 and state_of(key) is BlockState.READY:
                self.pool.pin([key])
                self._pinned.add(key)
        self._by_last.setdefault(held[-1], set()).add(entry.rid)
        self._retains[entry.rid] = entry
        self._tenants.setdefault(tenant, set()).add(entry.rid)
        self._usage[tenant] = self._usage.get(tenant, 0) + len(held)
        heapq.heappush(self._deadlines, (entry.deadline, entry.rid))
        heapq.heappush(
            self._due_last.setdefault(tenant, []), (-entry.deadline, entry.rid)
        )
        self.stats.retained_blocks = len(self._holders)

    def stored(self, keys: Sequence[BlockKey], success: bool) -> None:
        """A store of `keys` ended: retained ones are pinned now; a failed one ends
        the retains that hold it (a hit would stop there)."""
        if not self._holders:
            return
        for key in keys:
            holders = self._holders.get(key)
            if holders is None or key in self._pinned:
                continue
            if success:
                self.pool.pin([key])
                self._pinned.add(key)
            else:
                for rid in list(holders):
                    self._release(self._retains[rid])

    def read(self, keys: Sequence[BlockKey]) -> None:
        """A request reads `keys`: the retains whose last block it reads are
        fulfilled."""
        if not self._holders:  # nothing retained: the common case, O(1)
            return
        fulfilled = self._ending_at(keys)
        if fulfilled:
            self.stats.retained_hit_blocks += sum(k in self._holders for k in keys)
            for rid in fulfilled:
                self._release(self._retains[rid])

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Ends the retains that end among `keys` (their session is done)."""
        if self._holders:
            for rid in self._ending_at(keys):
                self._release(self._retains[rid])

    def expire(self) -> None:
        """Ends the retains whose time passed (once a step)."""
        now = self.clock()
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
        assert len(self._holders) <= self.budget
        assert self._pinned <= set(self._holders)
        for key, rids in self._holders.items():
            assert rids and all(key in self._retains[r].keys for r in rids)
        for key in self._pinned:
            assert self.pool.state_of(key) is BlockState.READY, key
        for tenant, retains in self._tenants.items():
            assert self._usage[tenant] == sum(
                len(self._retains[r].keys) for r in retains
            )
            assert retains <= {rid for _, rid in self._due_last[tenant]}
        assert self._due_last.keys() == self._tenants.keys()

    # ---- room ----

    def _make_room(self, tenant: str | None, wanted: int, deadline: float) -> int:
        """Gives up retains until `wanted` new blocks of `tenant`, due at `deadline`,
        fit, fairly; how many fit."""
        wanted = min(wanted, self.budget)
        while len(self._holders) + wanted > self.budget and self._retains:
            tenants = len(self._tenants) + (tenant not in self._tenants)
            fair = self.budget // tenants
            mine = self._usage.get(tenant, 0)
            others = [t for t in self._tenants if t != tenant]
            if mine + wanted <= fair and others:
                owner = max(others, key=self._usage.__getitem__)
            elif tenant in self._tenants:
                owner = tenant
            elif wanted > fair:  # a newcomer asking past its fair share gets that
                wanted = max(self.budget - len(self._holders), fair)
                continue
            else:
                owner = max(others, key=self._usage.__getitem__)
            due_last = self._due_last_of(owner)
            if owner == tenant and due_last.deadline <= deadline:
                break  # the new retain is due last: it keeps what room is left
            self._release(due_last)
        return max(0, min(wanted, self.budget - len(self._holders)))

    def _due_last_of(self, tenant: str | None) -> _Retain:
        heap = self._due_last[tenant]
        while heap[0][1] not in self._retains:
            heapq.heappop(heap)
        return self._retains[heap[0][1]]

    # ---- ending a retain ----

    def _ending_at(self, keys: Sequence[BlockKey]) -> set[int]:
        return {rid for key in keys for rid in self._by_last.get(key, ())}

    def _release(self, entry: _Retain) -> None:
        """Ends `entry`; its blocks no other retain holds are unpinned, deepest
        first."""
        self._retains.pop(entry.rid)
        for key in reversed(entry.keys):
            holders = self._holders[key]
            holders.discard(entry.rid)
            if not holders:
                del self._holders[key]
                if key in self._pinned:
                    self._pinned.discard(key)
                    self.pool.unpin([key])
        ending = self._by_last[entry.keys[-1]]
        ending.discard(entry.rid)
        if not ending:
            del self._by_last[entry.keys[-1]]
        retains = self._tenants[entry.tenant]
        retains.discard(entry.rid)
        self._usage[entry.tenant] -= len(entry.keys)
        heap = self._due_last[entry.tenant]
        if not retains:
            del self._tenants[entry.tenant]
            del self._usage[entry.tenant]
            del self._due_last[entry.tenant]
        elif len(heap) > 2 * len(retains) + 8:  # mostly ended entries: rebuild
            heap[:] = [(-self._retains[r].deadline, r) for r in retains]
            heapq.heapify(heap)
        self.stats.retained_blocks = len(self._holders)
