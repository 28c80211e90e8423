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
- tenants (`cache_salt`) share the budget: a tenant's share is the budget over the
  tenants holding retains, counted up to `MAX_SHARERS` (two): all of it while it is
  alone, half of it beside any number of others. A tenant within its share never loses
  a retained block to another tenant's retain. The count stops at two because the salt
  is the client's own: a share that shrank with the number of tenants would let one
  client minting a salt per retain cut every other tenant down to nothing, and half is
  what a tenant keeps against one other tenant, so a thousand salts take from it no
  more than one could;
- a new retain gets the room left; then, while its tenant stays within its share, the
  excess of the tenant that holds the most, while that one is past its share, trimmed
  from the end of that tenant's retain due last down to its share: a prefix is read
  from the front, so the blocks it keeps stay a hit, and nothing past the excess is
  taken; then its tenant's own retains due after it, given up whole, due last first
  (the tenant's own choice between its sessions; trimming them instead measured worse,
  1.54 / 1.04 against 1.73 / 1.19 on hint_replay.py's agent workload at 4k / 8k).
  Due last, not oldest: with more sessions than room, giving up the retain read
  furthest ahead keeps the others until they are read, where giving up the oldest
  would give up each retain just before its read (measured: benchmarks/agent_hints.py).
  When no other tenant is past its share, the new retain keeps only what fits (its
  first blocks; none if no room is left);
- a retain stops at the first block the pool does not hold (a hit stops there too).

What this guarantees: a tenant keeps, of what it retains, at least `budget //
MAX_SHARERS` blocks (all when less) until its retains end, whatever the others retain
and however many salts they mint; that is what it keeps against one other tenant. The
price: beyond two tenants, room goes to the first to retain (a tenant within its share
is not cut), and a client minting salts can fill the room left until its retains end.

A retain ends when a later request reads its last block, from host memory or the
device's prefix cache (the client came back; a read of a prefix it shares with other
sessions does not end it); when its time passes (counted unread); when a store of one of
its blocks fails; on `done` of its session, and on cache resets. Its blocks are then
unpinned deepest first, so that a policy that keeps order evicts them leaves first.
Every call is O(blocks it names), plus O(log tenants + log retains) amortised per
block trimmed or retain given up for room: the tenant that holds the most, and each
tenant's retain due last, are found through lazy heaps (an entry whose value has
changed is skipped when met, and a heap of mostly such entries is rebuilt), so no call
walks the tenants.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState
from vllm_cpu_offload.scheduler.manager import HostTierManager
from vllm_cpu_offload.scheduler.tier_seams import NoRetention
from vllm_cpu_offload.scheduler.tier_stats import TierStats

# The share is the budget over the tenants holding retains, counted up to this many.
# Two, because tenants are told apart by a salt the client picks: past two, a share
# that kept shrinking with their number would shrink with the salts one client mints.
MAX_SHARERS = 2

Tenant = str | None


@dataclass(slots=True)
class _Retain:
    rid: int
    tenant: Tenant
    deadline: float
    keys: list[BlockKey]  # in prefix order; room is trimmed from the end


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
        # tenant -> its retains; the keys they hold, each with how many of them name
        # it (so its length is the distinct blocks the tenant holds); a heap of
        # (-deadline, rid) of its retains, due last first (ended ones skipped lazily)
        self._tenants: dict[Tenant, set[int]] = {}
        self._held: dict[Tenant, dict[BlockKey, int]] = {}
        self._due_last: dict[Tenant, list[tuple[float, int]]] = {}
        # (-blocks held, push order, tenant), the one that holds the most first; an
        # entry is pushed on each change, one whose count changed is skipped.
        self._by_holding: list[tuple[int, int, Tenant]] = []
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
        first the pool does not hold, as far as room is found for them."""
        state_of = self.pool.state_of
        held = list(itertools.takewhile(lambda k: state_of(k) is not None, keys))
        deadline = self.clock() + seconds
        self._make_room(tenant, held, deadline)
        # Keep the first blocks that fit, counted again: a retain trimmed for room may
        # have held some of them, which are new now.
        fits, room = 0, self._room()
        while fits < len(held) and (held[fits] in self._holders or room > 0):
            room -= held[fits] not in self._holders
            fits += 1
        held = held[:fits]
        if not held:
            return
        entry = _Retain(self._next_rid, tenant, deadline, held)
        self._next_rid += 1
        self._retains[entry.rid] = entry
        counts = self._held.setdefault(tenant, {})
        for key in held:
            holders = self._holders.setdefault(key, set())
            holders.add(entry.rid)
            counts[key] = counts.get(key, 0) + 1
            if len(holders) == 1 and state_of(key) is BlockState.READY:
                self.pool.pin([key])
                self._pinned.add(key)
        self._by_last.setdefault(held[-1], set()).add(entry.rid)
        self._tenants.setdefault(tenant, set()).add(entry.rid)
        heapq.heappush(self._deadlines, (deadline, entry.rid))
        heapq.heappush(self._due_last.setdefault(tenant, []), (-deadline, entry.rid))
        self._push_holding(tenant)
        self.stats.retained_blocks = len(self._holders)

    def stored(self, keys: Sequence[BlockKey], success: bool) -> None:
        """A store of `keys` ended: retained ones are pinned now; a failed one, or
        one begun before the pool's reset (never visible), ends the retains that hold
        it (a hit would stop there)."""
        if not self._holders:
            return
        state_of = self.pool.state_of
        for key in keys:
            holders = self._holders.get(key)
            if holders is None or key in self._pinned:
                continue
            if success and state_of(key) is BlockState.READY:
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
        self._by_holding.clear()

    def share(self, tenant: Tenant) -> int:
        """The blocks `tenant` may hold against the others, were it to retain now."""
        sharers = len(self._tenants) + (tenant not in self._tenants)
        return max(self.budget // min(sharers, MAX_SHARERS), 1)

    def holding(self, tenant: Tenant) -> int:
        """The distinct blocks `tenant`'s retains hold."""
        return len(self._held.get(tenant, ()))

    def check_invariants(self) -> None:
        assert len(self._holders) <= self.budget
        assert self._pinned <= set(self._holders)
        for key, rids in self._holders.items():
            assert rids and all(key in self._retains[r].keys for r in rids)
        for key in self._pinned:
            assert self.pool.state_of(key) is BlockState.READY, key
        assert self._held.keys() == self._due_last.keys() == self._tenants.keys()
        assert self._retains.keys() <= {rid for _, rid in self._deadlines}
        holdings = {(t, -negative) for negative, _, t in self._by_holding}
        for entry in self._retains.values():
            assert entry.keys and entry.rid in self._by_last[entry.keys[-1]]
        for key, rids in self._by_last.items():
            assert rids and all(self._retains[r].keys[-1] == key for r in rids)
        for tenant, retains in self._tenants.items():
            counts: dict[BlockKey, int] = {}
            for rid in retains:
                assert self._retains[rid].tenant == tenant
                for key in self._retains[rid].keys:
                    counts[key] = counts.get(key, 0) + 1
            assert counts == self._held[tenant]
            assert retains <= {rid for _, rid in self._due_last[tenant]}
            assert (tenant, self.holding(tenant)) in holdings  # found as the most
        heaps: list[tuple[Sequence[tuple[object, ...]], int]]
        heaps = [
            (self._deadlines, len(self._retains)),
            (self._by_holding, len(self._tenants)),
        ]
        heaps += [(h, len(self._tenants[t])) for t, h in self._due_last.items()]
        for heap, live in heaps:  # in heap order, and not mostly ended entries
            assert _is_heap(heap) and len(heap) <= 2 * live + 8

    # ---- room ----

    def _make_room(self, tenant: Tenant, keys: list[BlockKey], deadline: float) -> None:
        """Trims retains until the blocks of `keys` no retain holds fit, or no more
        may be taken: first the excess of the tenants past their share (counted with
        `tenant`), while `tenant` stays within its own; then `tenant`'s own retains
        due after `deadline`."""
        wanted = set(keys)
        need = min(sum(k not in self._holders for k in keys), self.budget)
        share, mine = self.share(tenant), self.holding(tenant)
        while need > self._room() and mine + self._room() < share:
            most = self._most_holding()
            if most is None or most == tenant or self.holding(most) <= share:
                break  # no other tenant is past its share: none gives room
            while self.holding(most) > share and need > self._room():
                if mine + self._room() >= share:
                    break
                need += self._trim(self._due_last_of(most)) in wanted
            self._push_holding(most)
        while need > self._room() and tenant in self._tenants:
            own = self._due_last_of(tenant)
            if own.deadline <= deadline:
                break  # the new retain is its tenant's due last: it keeps what fits
            need += self._release(own, wanted)

    def _room(self) -> int:
        return self.budget - len(self._holders)

    def _trim(self, entry: _Retain) -> BlockKey | None:
        """Takes `entry`'s last block from it, ending it with its first: the key, if
        no retain holds it any more. O(log) amortised."""
        key = entry.keys.pop()
        self._unlist_last(entry, key)
        freed = key if self._unhold(entry, key) else None
        if entry.keys:
            self._by_last.setdefault(entry.keys[-1], set()).add(entry.rid)
        else:
            self._end(entry)
        self.stats.retained_blocks = len(self._holders)
        return freed

    def _most_holding(self) -> Tenant | None:
        heap = self._by_holding
        while heap and self.holding(heap[0][2]) != -heap[0][0]:
            heapq.heappop(heap)  # its holding has changed since, or it left
        return heap[0][2] if heap else None

    def _due_last_of(self, tenant: Tenant) -> _Retain:
        heap = self._due_last[tenant]
        while heap[0][1] not in self._retains:
            heapq.heappop(heap)
        return self._retains[heap[0][1]]

    def _push_holding(self, tenant: Tenant) -> None:
        if tenant in self._held:
            entry = (-self.holding(tenant), next(self._pushes), tenant)
            heapq.heappush(self._by_holding, entry)
        _rebuild_if_stale(
            self._by_holding,
            len(self._held),
            lambda: [(-len(h), next(self._pushes), t) for t, h in self._held.items()],
        )

    # ---- ending a retain ----

    def _ending_at(self, keys: Sequence[BlockKey]) -> set[int]:
        return {rid for key in keys for rid in self._by_last.get(key, ())}

    def _release(self, entry: _Retain, wanted: Container[BlockKey] = ()) -> int:
        """Ends `entry`; its blocks no other retain holds are unpinned, deepest
        first. Returns how many of them are in `wanted`."""
        self._unlist_last(entry, entry.keys[-1])
        freed = 0
        for key in reversed(entry.keys):
            freed += self._unhold(entry, key) and key in wanted
        self._end(entry)
        self._push_holding(entry.tenant)
        self.stats.retained_blocks = len(self._holders)
        return freed

    def _unlist_last(self, entry: _Retain, key: BlockKey) -> None:
        ending = self._by_last[key]
        ending.discard(entry.rid)
        if not ending:
            del self._by_last[key]

    def _unhold(self, entry: _Retain, key: BlockKey) -> bool:
        """Takes `entry`'s hold of `key` off the counts; True if no retain holds it
        now (then it is unpinned)."""
        counts = self._held[entry.tenant]
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
        holders = self._holders[key]
        holders.discard(entry.rid)
        if holders:
            return False
        del self._holders[key]
        if key in self._pinned:
            self._pinned.discard(key)
            self.pool.unpin([key])
        return True

    def _end(self, entry: _Retain) -> None:
        """Forgets `entry`, whose blocks are unheld, rebuilding a heap that holds
        mostly ended entries."""
        self._retains.pop(entry.rid)
        tenant = entry.tenant
        retains = self._tenants[tenant]
        retains.discard(entry.rid)
        if not retains:
            assert not self._held[tenant], tenant
            del self._tenants[tenant], self._held[tenant], self._due_last[tenant]
        else:
            _rebuild_if_stale(
                self._due_last[tenant],
                len(retains),
                lambda: [(-self._retains[r].deadline, r) for r in retains],
            )
        _rebuild_if_stale(
            self._deadlines,
            len(self._retains),
            lambda: [(r.deadline, r.rid) for r in self._retains.values()],
        )


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
