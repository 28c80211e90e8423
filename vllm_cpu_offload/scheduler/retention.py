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
- tenants (`cache_salt`) share the budget fairly. A tenant's fair share is the budget
  over the tenants retaining, but never less than the budget over `FLOOR_TENANTS`
  (at least one block): the salt is the client's own, so one client can retain under
  as many salts as it likes, and a share that shrank with their number would leave
  every later tenant none. When the budget is full, a tenant whose new retain keeps
  it within its share takes room from the tenant that holds the most if that one is
  past its share, and otherwise from the retain due last (the latest deadline) of the
  other tenants; a tenant past its share gives up its own retains due after the new
  one, which then keeps the room left or, if more, its blocks up to the share. Due
  last, not oldest: a client's retain time says when it comes back, and giving up the
  retain read furthest ahead keeps the others until they are read, where giving up
  the oldest would, with more sessions than room, give up each retain just before its
  read (measured: benchmarks/agent_hints.py);
- a retain larger than the room left keeps its first blocks (a prefix is read from
  the front), and a retain stops at the first block the pool does not hold (a hit
  stops there too).

What this guarantees, when a tenant retains: the new retain is kept up to the blocks
that bring its tenant's holding (the blocks its retains name) to its fair share, so at
least `budget // FLOOR_TENANTS` (or one), whatever the others hold and however many
tenants exist (different tenants' blocks are apart: vLLM hashes the salt into a
request's first block). A client minting a fresh salt per retain is as many tenants and
can take what they could: all the room the others leave free, and from the others only
this: it brings a tenant past its share back to the share (that tenant's retains due
last first) and, while no tenant is past its share, gives up another tenant's retain
only if that one is the due last of all retains held but the new retain's tenant's (its
other salts' included). So a retain that keeps its tenant within the floor is never
refused or cut, however many salts exist; squatting with long retains gives up the
squatter's own first; and to give up another's retain the squatter must hold only
retains due no later, which end no later (expired unread unless made again).

A retain ends when a later request reads its last block, from host memory or the
device's prefix cache (the client came back; a read of a prefix it shares with other
sessions does not end it); when its time passes (counted unread); when a store of one of
its blocks fails; on `done` of its session, and on cache resets. Its blocks are then
unpinned deepest first, so that a policy that keeps order evicts them leaves first.
Every call is O(blocks it names), plus O(log tenants + log retains) amortised per retain
given up for room: the tenant that holds the most, and each tenant's retain due last,
are found through lazy heaps (an entry whose value has changed is skipped when met, and
a heap of mostly such entries is rebuilt), so no call walks the tenants.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState
from vllm_cpu_offload.scheduler.manager import HostTierManager
from vllm_cpu_offload.scheduler.tier_seams import NoRetention
from vllm_cpu_offload.scheduler.tier_stats import TierStats

# The fair share stops shrinking at a sixteenth of the budget: up to 16 tenants share
# it exactly, which covers the salts of honest deployments (one per tenant or user
# group), and past them each is still sure of room for a few long prefixes however
# many salts a client mints. Larger would shrink what each is sure of; smaller would
# promise more than the budget holds as soon as a few tenants retain, which they would
# then take from each other's retains.
FLOOR_TENANTS = 16

Tenant = str | None


@dataclass
class _Retain:
    rid: int
    tenant: Tenant
    deadline: float
    keys: list[BlockKey]  # in prefix order


class Retention(NoRetention):
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
        self._tenants: dict[Tenant, set[int]] = {}
        self._usage: dict[Tenant, int] = {}
        self._due_last: dict[Tenant, list[tuple[float, int]]] = {}
        # Over the tenants, lazily as above: (-usage, push order, tenant), the one that
        # holds the most first; (-deadline, rid) of each tenant's due last, the latest
        # first. An entry is pushed on each change; one whose value changed is skipped.
        self._by_usage: list[tuple[int, int, Tenant]] = []
        self._by_due_last: list[tuple[float, int]] = []
        self._pushes = itertools.count()
        self._next_rid = 0

    @property
    def num_pinned(self) -> int:
        """Blocks the retains pin in the pool now."""
        return len(self._pinned)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks retained now (pinned, or pinned once stored)."""
        return len(self._holders)

    def retain(self, keys: Sequence[BlockKey], tenant: Tenant, seconds: float) -> None:
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
        self._add(entry)
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
        self._by_usage.clear()
        self._by_due_last.clear()

    def check_invariants(self) -> None:
        assert len(self._holders) <= self.budget
        assert self._pinned <= set(self._holders)
        for key, rids in self._holders.items():
            assert rids and all(key in self._retains[r].keys for r in rids)
        for key in self._pinned:
            assert self.pool.state_of(key) is BlockState.READY, key
        assert self._usage.keys() == self._due_last.keys() == self._tenants.keys()
        assert self._retains.keys() <= {rid for _, rid in self._deadlines}
        usages = {(t, -negative) for negative, _, t in self._by_usage}
        due_lasts = {rid for _, rid in self._by_due_last}
        for tenant, retains in self._tenants.items():
            assert self._usage[tenant] == sum(
                len(self._retains[r].keys) for r in retains
            )
            assert retains <= {rid for _, rid in self._due_last[tenant]}
            assert (tenant, self._usage[tenant]) in usages  # found as the most
            due_last = min(retains, key=lambda r: (-self._retains[r].deadline, r))
            assert due_last in due_lasts
        heaps: list[tuple[Sequence[tuple[object, ...]], int]]
        heaps = [
            (self._deadlines, len(self._retains)),
            (self._by_usage, len(self._tenants)),
            (self._by_due_last, len(self._tenants)),
        ]
        heaps += [(h, len(self._tenants[t])) for t, h in self._due_last.items()]
        for heap, live in heaps:  # in heap order, and not mostly ended entries
            assert _is_heap(heap) and len(heap) <= 2 * live + 8

    # ---- room ----

    def _make_room(self, tenant: Tenant, wanted: int, deadline: float) -> int:
        """Gives up retains until `wanted` new blocks of `tenant`, due at `deadline`,
        fit, fairly; how many fit."""
        wanted = min(wanted, self.budget)
        while len(self._holders) + wanted > self.budget and self._retains:
            fair = self._fair_share(tenant)
            mine = self._usage.get(tenant, 0)
            if mine + wanted <= fair:
                victim = self._room_within_share(tenant, fair)
            else:
                victim = self._due_last_of(tenant) if tenant in self._tenants else None
                if victim is None or victim.deadline <= deadline:
                    # The new retain is its tenant's due last: it keeps the room
                    # left or, if more, its blocks up to the share, taken as above.
                    if fair - mine <= self.budget - len(self._holders):
                        break
                    wanted = fair - mine
                    continue
            if victim is None:
                break
            self._release(victim)
        return max(0, min(wanted, self.budget - len(self._holders)))

    def _room_within_share(self, tenant: Tenant, fair: int) -> _Retain | None:
        """The retain a tenant within its share takes room from: the due last of the
        tenant that holds the most, if that one is past its share, else the due last
        of the other tenants."""
        most = self._most_holding()
        if most is not None and self._usage[most] > fair:
            return self._due_last_of(most)
        return self._due_last_of_others(tenant)

    def _fair_share(self, tenant: Tenant) -> int:
        tenants = len(self._tenants) + (tenant not in self._tenants)
        return max(self.budget // tenants, self.budget // FLOOR_TENANTS, 1)

    def _most_holding(self) -> Tenant | None:
        heap = self._by_usage
        while heap and self._usage.get(heap[0][2]) != -heap[0][0]:
            heapq.heappop(heap)  # its usage has changed since, or it left
        return heap[0][2] if heap else None

    def _due_last_of(self, tenant: Tenant) -> _Retain:
        heap = self._due_last[tenant]
        while heap[0][1] not in self._retains:
            heapq.heappop(heap)
        return self._retains[heap[0][1]]

    def _due_last_of_others(self, tenant: Tenant) -> _Retain | None:
        heap = self._by_due_last
        own: tuple[float, int] | None = None  # the tenant's own, set aside
        while heap:
            entry = self._retains.get(heap[0][1])
            if entry is None or self._due_last_of(entry.tenant) is not entry:
                heapq.heappop(heap)  # ended, or no longer its tenant's due last
            elif entry.tenant == tenant:
                own = heapq.heappop(heap)
            else:
                break
        found = self._retains[heap[0][1]] if heap else None
        if own is not None:
            heapq.heappush(heap, own)
        return found

    # ---- keeping count ----

    def _add(self, entry: _Retain) -> None:
        tenant = entry.tenant
        self._retains[entry.rid] = entry
        self._tenants.setdefault(tenant, set()).add(entry.rid)
        self._usage[tenant] = self._usage.get(tenant, 0) + len(entry.keys)
        heapq.heappush(self._deadlines, (entry.deadline, entry.rid))
        heapq.heappush(
            self._due_last.setdefault(tenant, []), (-entry.deadline, entry.rid)
        )
        if self._due_last_of(tenant) is entry:
            heapq.heappush(self._by_due_last, (-entry.deadline, entry.rid))
        self._push_usage(tenant)
        self._compact()

    def _push_usage(self, tenant: Tenant) -> None:
        if tenant in self._usage:
            heapq.heappush(
                self._by_usage, (-self._usage[tenant], next(self._pushes), tenant)
            )

    def _compact(self) -> None:
        """Rebuilds each heap over all retains or tenants that is mostly ended
        entries (`_rebuild_if_stale`)."""
        _rebuild_if_stale(
            self._by_usage,
            len(self._usage),
            lambda: [(-u, next(self._pushes), t) for t, u in self._usage.items()],
        )
        _rebuild_if_stale(
            self._by_due_last,
            len(self._tenants),
            lambda: [
                (-(d := self._due_last_of(t)).deadline, d.rid) for t in self._tenants
            ],
        )
        _rebuild_if_stale(
            self._deadlines,
            len(self._retains),
            lambda: [(r.deadline, r.rid) for r in self._retains.values()],
        )

    # ---- ending a retain ----

    def _ending_at(self, keys: Sequence[BlockKey]) -> set[int]:
        return {rid for key in keys for rid in self._by_last.get(key, ())}

    def _release(self, entry: _Retain) -> None:
        """Ends `entry`; its blocks no other retain holds are unpinned, deepest
        first."""
        was_due_last = self._due_last_of(entry.tenant) is entry
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
        self._uncount(entry, was_due_last)
        self.stats.retained_blocks = len(self._holders)

    def _uncount(self, entry: _Retain, was_due_last: bool) -> None:
        """Takes an ended `entry` off its tenant's count and the heaps, rebuilding a
        heap that holds mostly ended entries."""
        tenant = entry.tenant
        retains = self._tenants[tenant]
        retains.discard(entry.rid)
        self._usage[tenant] -= len(entry.keys)
        heap = self._due_last[tenant]
        if not retains:
            del self._tenants[tenant]
            del self._usage[tenant]
            del self._due_last[tenant]
        else:
            _rebuild_if_stale(
                heap,
                len(retains),
                lambda: [(-self._retains[r].deadline, r) for r in retains],
            )
            if was_due_last:  # the tenant's next one is its due last now
                due_last = self._due_last_of(tenant)
                heapq.heappush(self._by_due_last, (-due_last.deadline, due_last.rid))
        self._push_usage(tenant)
        self._compact()


def _rebuild_if_stale(
    heap: list[Any], live: int, entries: Callable[[], list[Any]]
) -> None:
    """Rebuilds `heap` from `entries()` (one per live retain or tenant) where it holds
    more than twice as many entries as there are live ones, plus a few: O(1) amortised
    over the pushes that made it so."""
    if len(heap) > 2 * live + 8:
        heap[:] = entries()
        heapq.heapify(heap)


def _is_heap(heap: Sequence[tuple[object, ...]]) -> bool:
    return all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap)))
