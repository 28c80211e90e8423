"""Prefix-aware eviction: orphans first, leaves before ancestors, and admission for
newcomers.

A block of KV is useful only together with every block before it in its request, and a
block is reused at least as often as any of its descendants. So:

1. Orphans first. A block whose chain has a gap above it (its parent key is not held)
   can hit only while the missing ancestor sits in the GPU cache; it goes first.
2. Leaves first. A block with children in the pool is never a victim: when one reaches
   the head of its list it is parked (unlisted) until its last child leaves, then goes
   back to the head, since it was older than everything listed. Evicting only leaves
   never creates orphans.
3. Three modes, chosen online. The pool is *admitting* (every new key may evict: the
   least recent leaf goes, as in LRU), *guarding* (a key seen for the first time while
   the pool is full is refused and only remembered, so it gets in on its second sight,
   a doorkeeper; victims come from a probation segment first: blocks used again while
   held sit in a protected segment of at most `protected_fraction` of the pool), or
   *keeping* (while the pool is full, only one refused key in `keep_every` gets in,
   whether seen before or not, evicting in LRU order: bimodal insertion, as in DIP).
   Guarding keeps a thrashing pool from trading blocks that will be reused for blocks
   seen once (the last turn of a conversation, one-off documents). Keeping protects
   what the pool holds from a loop or a stream of re-reads larger than the pool, where
   every newcomer has been seen before and the doorkeeper lets it in: a pool that churns
   through a loop hits almost nothing, a pool that keeps part of it hits that part on
   every pass. Admitting is best once the pool spans most reuse distances. Which one
   wins depends on the pool size against the workload, so the policy measures all
   three: a small shadow LRU cache per rule replays a hash sample of the keys (spatial
   sampling, as in SHARDS), and the pool guards or keeps while that rule's shadow hits
   more than admit-all's, by more than sampling noise (set dueling, as in DIP).
4. History. Keys that left (or were refused) are remembered, `history_factor` times as
   many as the pool holds. A remembered key that is stored again has proven a reuse:
   it is admitted even while guarding, and starts protected.

Recency is a monotonic stamp, never wall-clock time. Every hook is O(1); a hook that
parks blocks does O(1) work per block parked, and each block is parked at most once per
time it is listed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from .base import BlockKey, BlockList, BlockState, EvictionPolicy, HostBlock

_PROBATION = 0
_PROTECTED = 1

# The admission modes (`AdmissionDuel.mode`).
ADMITTING = 0
GUARDING = 1
KEEPING = 2


class PrefixAwarePolicy(EvictionPolicy):
    """Leaf-first, orphan-first LRU with adaptive admission; see the module
    docstring."""

    name = "prefix_aware"

    def __init__(
        self,
        num_blocks: int,
        protected_fraction: float = 0.65,
        history_factor: float = 4.0,
        shadow_blocks: int = 1024,
        keep_every: int = 32,
    ) -> None:
        super().__init__(num_blocks)
        self._clock = 0  # recency stamps: a counter, never wall-clock time
        if not 0.0 <= protected_fraction < 1.0:
            raise ValueError(
                f"protected_fraction must be in [0, 1), got {protected_fraction}"
            )
        if history_factor <= 0.0:
            raise ValueError(f"history_factor must be > 0, got {history_factor}")
        self._protected_cap = int(num_blocks * protected_fraction)
        self._orphans = BlockList()
        self._probation = BlockList()
        self._protected = BlockList()
        # Blocks held in the protected segment, listed or not (pinned, storing, parked).
        self._num_protected = 0
        self._history_factor = history_factor
        # Keyed by hash(key): one hash per insert serves the sample test and this
        # look-up. Two keys with equal 64-bit hashes at worst recall a key that
        # was never evicted.
        self._history: OrderedDict[int, None] = OrderedDict()
        self._history_cap = max(1, int(num_blocks * history_factor))
        if keep_every < 1:
            raise ValueError(f"keep_every must be >= 1, got {keep_every}")
        self._keep_every = keep_every
        self._keep_credit = KeepCredit(keep_every)
        self._duel = AdmissionDuel(
            num_blocks, history_factor, shadow_blocks, keep_every
        )

    # ----- hooks -----

    def admit(self, key: BlockKey) -> bool:
        mode = self._duel.mode
        if mode == ADMITTING:
            return True
        h = hash(key)
        if mode == GUARDING:
            if h in self._history:
                return True
        elif self._keep_credit.lets_in():
            return True
        self._duel.observe(h)
        if h not in self._history:
            self._remember(h)
        return False

    def on_declined(self, key: BlockKey) -> None:
        if self._duel.mode == KEEPING:
            self._keep_credit.refused()
        h = hash(key)
        self._duel.observe(h)
        if h not in self._history:
            self._remember(h)

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        # A free block is in probation with `in_duel_sample` clear: `pop_victim` and
        # `on_remove` see to it.
        history, duel = self._history, self._duel
        mask = duel.modulus - 1
        # one stamp per batch: its blocks came together
        clock = self._clock = self._clock + 1
        recalled = False
        for block in blocks:
            block.stamp = clock
            h = hash(block.key)
            if not h & mask:
                # Sampled keys feed the shadows, here and at every later use.
                block.in_duel_sample = True
                duel.use(h)
            if h in history:
                del history[h]
                block.segment = _PROTECTED
                self._num_protected += 1
                recalled = True
        if recalled:
            self._shrink_protected()

    def on_ready(self, blocks: Sequence[HostBlock]) -> None:
        probation = self._probation
        root = probation.root
        tail = root.prev
        added = 0
        for block in blocks:
            if block.orphan or block.segment:
                self._home(block).append(block)  # orphans or protected, never probation
                continue
            # Inlined append at the probation tail, whose end is linked once after the
            # loop: the common case.
            block.prev = tail
            tail.next = block
            block.owner = probation
            tail = block
            added += 1
        tail.next = root
        root.prev = tail
        probation.size += added

    def on_access(self, blocks: Sequence[HostBlock]) -> None:
        self._used(blocks, self._duel.use)

    def on_device_hit(self, blocks: Sequence[HostBlock]) -> None:
        # A use for recency, but not a hit for the shadows: they rank the rules by
        # what the host tier serves, and a block the device cache holds is served
        # whatever the host holds.
        self._used(blocks, self._duel.touch)

    def _used(self, blocks: Sequence[HostBlock], feed: Callable[[int], None]) -> None:
        protected, probation, orphans = (
            self._protected,
            self._probation,
            self._orphans,
        )
        root = protected.root
        tail = root.prev
        # one stamp per batch: its blocks came together
        clock = self._clock = self._clock + 1
        promoted = 0  # into the protected segment
        # from the probation list to the protected list: sizes change once, below
        moved = 0
        for block in blocks:
            if block.in_duel_sample:
                feed(hash(block.key))
            block.stamp = clock
            owner = block.owner
            if owner is protected or owner is probation:
                # Inlined unlink, then append after `tail`: the hot path. The list's end
                # is linked once, after the loop (or before any other list operation).
                if block is tail:
                    continue
                prev, nxt = block.prev, block.next
                prev.next = nxt
                nxt.prev = prev
                block.prev = tail
                tail.next = block
                tail = block
                if owner is probation:
                    block.owner = protected
                    block.segment = _PROTECTED
                    moved += 1
                continue
            if block.segment != _PROTECTED:
                block.segment = _PROTECTED
                promoted += 1
            if owner is orphans:
                orphans.move_to_end(block)
            elif owner is None and block.evictable:  # parked: relist as the newest
                tail.next = root
                root.prev = tail
                self._home(block).append(block)
                tail = root.prev
        tail.next = root
        root.prev = tail
        probation.size -= moved
        protected.size += moved
        self._num_protected += promoted + moved
        if self._num_protected > self._protected_cap:
            self._shrink_protected()

    def on_pin(self, block: HostBlock) -> None:
        if block.owner is not None:
            block.owner.remove(block)

    def on_unpin(self, block: HostBlock) -> None:
        self._home(block).append(block)

    def on_remove(self, block: HostBlock) -> None:
        if block.owner is not None:
            block.owner.remove(block)
        self._set_segment(block, _PROBATION)
        block.in_duel_sample = False

    def on_orphaned(self, block: HostBlock) -> None:
        if block.owner is not None:
            block.owner.remove(block)
            self._orphans.append(block)
        elif block.evictable:
            self._orphans.append(block)  # was parked; orphans go regardless of children

    def on_leaf(self, block: HostBlock) -> None:
        if (
            block.owner is None
            and block.pin_count == 0
            and block.state is BlockState.READY
        ):
            # Parked at the head of its list and not used since: older than every block
            # listed there now, so it goes back to the head.
            self._home(block).appendleft(block)
            if self._num_protected > self._protected_cap:
                self._shrink_protected()

    def pop_victim(self) -> HostBlock | None:
        victim = self._orphans.head
        if victim is None:
            victim = self._head_leaf(self._probation)
            oldest_protected = self._head_leaf(self._protected)
            if victim is None or (
                # Admitting or keeping: segments off, the least recent leaf goes (LRU).
                oldest_protected is not None
                and self._duel.mode != GUARDING
                and oldest_protected.stamp < victim.stamp
            ):
                victim = oldest_protected
            if victim is None:
                return None
        assert victim.owner is not None
        victim.owner.remove(victim)
        if victim.segment == _PROTECTED:
            victim.segment = _PROBATION
            self._num_protected -= 1
        victim.in_duel_sample = False
        history = self._history
        history[hash(victim.key)] = None
        if len(history) > self._history_cap:
            history.popitem(last=False)
        return victim

    def reset(self) -> None:
        self._history.clear()
        self._keep_credit = KeepCredit(self._keep_every)
        self._duel = AdmissionDuel(
            self.num_blocks,
            self._history_factor,
            self._duel.shadow_blocks,
            self._keep_every,
        )

    @property
    def doorkeeper(self) -> bool:
        """Whether first-sight keys are refused while the pool is full (guarding)."""
        return self._duel.mode == GUARDING

    @property
    def keeping(self) -> bool:
        """Whether the pool keeps what it holds, letting in one key in `keep_every`."""
        return self._duel.mode == KEEPING

    # ----- internals -----

    def _home(self, block: HostBlock) -> BlockList:
        if block.orphan:
            return self._orphans
        return self._protected if block.segment == _PROTECTED else self._probation

    def _head_leaf(self, segment: BlockList) -> HostBlock | None:
        """The oldest leaf of `segment`; parks the blocks with children found before
        it."""
        head = segment.head
        while head is not None and head.num_children:
            segment.remove(head)  # parked until `on_leaf` or `on_access`
            head = segment.head
        return head

    def _set_segment(self, block: HostBlock, segment: int) -> None:
        if block.segment != segment:
            self._num_protected += 1 if segment == _PROTECTED else -1
            block.segment = segment

    def _shrink_protected(self) -> None:
        while self._num_protected > self._protected_cap:
            demoted = self._head_leaf(self._protected)
            if demoted is None:
                return
            self._protected.remove(demoted)
            self._set_segment(demoted, _PROBATION)
            # Keep probation in stamp order: an old block goes to its head,
            # not its tail.
            head = self._probation.head
            if head is not None and demoted.stamp < head.stamp:
                self._probation.appendleft(demoted)
            else:
                self._probation.append(demoted)

    def _remember(self, key_hash: int) -> None:
        self._history[key_hash] = None
        if len(self._history) > self._history_cap:
            self._history.popitem(last=False)


class KeepCredit:
    """Keeping's one-in-`keep_every` rule: every refused key adds a credit, and a key is
    let in when `keep_every` credits are there (they are spent). Counting refusals, not
    requests, lets a long refused chain pay for the head of a later one."""

    __slots__ = ("_every", "_credit")

    def __init__(self, keep_every: int) -> None:
        self._every = keep_every
        self._credit = 0

    def lets_in(self) -> bool:
        """A key asks to get in: True (spending the credits) or False (refused)."""
        if self._credit >= self._every:
            self._credit -= self._every
            return True
        self._credit += 1
        return False

    def refused(self) -> None:
        """A key was refused without asking (the rest of a refused chain)."""
        self._credit += 1


class AdmissionDuel:
    """Chooses admitting, guarding or keeping by replaying a key sample through one
    shadow of each.

    Keys whose hash is divisible by `modulus` (a power of two) are sampled; each shadow
    is an LRU cache of key hashes of num_blocks / modulus entries, so it sees the pool's
    workload at the pool's scale. Hit counts are halved every 8 shadow-capacities of
    sampled uses, so the choice follows phases of the workload. O(1) per use.

    `mode` is GUARDING or KEEPING while that rule's shadow hits more than admit-all's
    (and than the other rule's), by more than sampling noise: hit counts are roughly
    Poisson, so the difference must exceed two standard deviations (2 * sqrt(sum))
    before the pool starts refusing keys; ADMITTING otherwise. It is a plain attribute,
    updated when the hit counts change, because the pool reads it at every admission
    and eviction.
    """

    __slots__ = (
        "shadow_blocks",
        "modulus",
        "mode",
        "_admit_all",
        "_door",
        "_keep",
        "_uses",
        "_half_life",
    )

    def __init__(
        self,
        num_blocks: int,
        history_factor: float,
        shadow_blocks: int,
        keep_every: int = 32,
    ) -> None:
        if shadow_blocks < 1:
            raise ValueError(f"shadow_blocks must be >= 1, got {shadow_blocks}")
        self.shadow_blocks = shadow_blocks
        modulus = 1
        while num_blocks // (modulus * 2) >= shadow_blocks:
            modulus *= 2
        self.modulus = modulus
        capacity = max(1, num_blocks // modulus)
        self._admit_all = _ShadowCache(capacity, history_factor, ADMITTING, keep_every)
        self._door = _ShadowCache(capacity, history_factor, GUARDING, keep_every)
        self._keep = _ShadowCache(capacity, history_factor, KEEPING, keep_every)
        self._uses = 0
        self._half_life = 8 * capacity
        self.mode = ADMITTING

    @property
    def doorkeeper(self) -> bool:
        """Whether the mode is GUARDING."""
        return self.mode == GUARDING

    def observe(self, key_hash: int) -> bool:
        """Feeds a use of the key with this hash to the shadows if it is sampled.

        Returns whether it is.
        """
        if key_hash & (self.modulus - 1):
            return False
        self.use(key_hash)
        return True

    def use(self, key_hash: int) -> None:
        """Feeds a use of a key known to be sampled (by its hash) to every shadow."""
        self._feed(key_hash, True)

    def touch(self, key_hash: int) -> None:
        """Feeds a use of a sampled key that the device cache served: the shadows
        update their recency (and admit it if they lack it) but count no hit."""
        self._feed(key_hash, False)

    def _feed(self, key_hash: int, hit: bool) -> None:
        admit_all, door, keep = self._admit_all, self._door, self._keep
        admit_all.use(key_hash, hit)
        door.use(key_hash, hit)
        keep.use(key_hash, hit)
        self._uses += 1
        if self._uses % self._half_life == 0:
            admit_all.hits /= 2
            door.hits /= 2
            keep.hits /= 2
        rule = GUARDING if door.hits >= keep.hits else KEEPING
        best = max(door.hits, keep.hits)
        lead = best - admit_all.hits
        if lead > 2.0 * math.sqrt(best + admit_all.hits):
            self.mode = rule
        else:
            self.mode = ADMITTING


class _ShadowCache:
    """A key-only LRU cache that counts its hits, under one admission `mode`: once
    full, GUARDING refuses first-sight keys and KEEPING lets in one refused key in
    `keep_every`."""

    __slots__ = (
        "capacity",
        "hits",
        "_mode",
        "_keep_credit",
        "_keys",
        "_history",
        "_history_cap",
    )

    def __init__(
        self, capacity: int, history_factor: float, mode: int, keep_every: int
    ) -> None:
        self.capacity = capacity
        self.hits = 0.0
        self._mode = mode
        self._keep_credit = KeepCredit(keep_every)
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._history: OrderedDict[int, None] = OrderedDict()
        self._history_cap = max(1, int(capacity * history_factor))

    def use(self, key: int, hit: bool = True) -> None:
        """A use of `key`; a held key counts as a hit only if `hit`."""
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
            if hit:
                self.hits += 1
            return
        full = len(keys) >= self.capacity
        if full and self._mode == GUARDING and key not in self._history:
            self._remember(key)
            return
        if full and self._mode == KEEPING and not self._keep_credit.lets_in():
            return
        self._history.pop(key, None)
        keys[key] = None
        if full:
            self._remember(keys.popitem(last=False)[0])

    def _remember(self, key: int) -> None:
        self._history[key] = None
        if len(self._history) > self._history_cap:
            self._history.popitem(last=False)
