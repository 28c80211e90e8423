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
3. Four modes, chosen online. The pool is *admitting* (every new key may evict: the
   least recent leaf goes, as in LRU), *protecting* (every new key may evict, but
   victims come from a probation segment first: blocks used again while held sit in a
   protected segment of at most `protected_fraction` of the pool, a segmented LRU),
   *guarding* (segments as protecting, and a key not recalled from the history is
   refused while the pool is full and only remembered, so it gets in on its next
   sight, a doorkeeper), or *keeping* (while the pool is full, only one refused key in
   `keep_every` gets in, whether seen before or not, evicting in LRU order: bimodal
   insertion, as in DIP). Protecting keeps a reused set from a stream of one-off
   blocks and still serves a new block's first reuse, which a doorkeeper refuses.
   Guarding keeps a thrashing pool from trading blocks that will be reused for blocks
   seen once (the last turn of a conversation, one-off documents). Keeping protects
   what the pool holds from a loop or a stream of re-reads larger than the pool, where
   every newcomer has been seen before and the doorkeeper lets it in: a pool that churns
   through a loop hits almost nothing, a pool that keeps part of it hits that part on
   every pass. Admitting is best once the pool spans most reuse distances. Which one
   wins depends on the pool size against the workload, so the policy measures them: a
   small shadow LRU cache per rule replays a hash sample of the keys (spatial sampling,
   as in SHARDS), and the pool follows the rule whose shadow beats admit-all's by the
   most, if any does by more than sampling noise (set dueling, as in DIP). The duel
   and its shadows are in `admission_duel.py`.
4. History. Keys that left (or were refused) are remembered, `history_factor` times as
   many as the pool holds. A key recalled from the history has proven a reuse: it is
   admitted while guarding, and starts protected. How far back a recall may reach is
   part of the guarding rule: it is duelled at a quarter, half and all of the history
   (a long window lets a loop larger than the pool back in on every pass; a short one
   refuses keys whose reuse the pool cannot hold anyway).

Recency is a monotonic stamp, never wall-clock time. Every hook is O(1); a hook that
parks blocks does O(1) work per block parked, and each block is parked at most once per
time it is listed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from .admission_duel import (
    ADMITTING,
    GUARDING,
    KEEPING,
    PROTECTING,
    AdmissionDuel,
    KeepCredit,
)
from .base import (
    BlockKey,
    BlockList,
    BlockState,
    EvictionPolicy,
    HostBlock,
    stable_key_hash,
)

_PROBATION = 0
_PROTECTED = 1


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
        # Keyed by stable_key_hash(key) (the same in every process, unlike hash(), so
        # the sample and the decisions are too): one hash per insert serves the sample
        # test and this look-up. Two keys with equal hashes at worst recall a key that
        # was never evicted. The value is the epoch the key was remembered in (an
        # epoch is num_blocks / 16 keys remembered; its number is one int object
        # that all its keys share), which tells whether it is within the guarding
        # rule's window.
        self._history: OrderedDict[int, int] = OrderedDict()
        self._history_cap = max(1, int(num_blocks * history_factor))
        self._epoch_size = max(1, num_blocks // 16)
        self._epoch = 0
        self._epoch_left = self._epoch_size
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
        if mode in (ADMITTING, PROTECTING):
            return True
        h = stable_key_hash(key)
        if mode == GUARDING:
            if self._recalls(h):
                return True
        elif self._keep_credit.lets_in():
            return True
        self._duel.observe(h)
        if not self._recalls(h):
            self._remember(h)
        return False

    def on_declined(self, key: BlockKey) -> None:
        if self._duel.mode == KEEPING:
            self._keep_credit.refused()
        h = stable_key_hash(key)
        self._duel.observe(h)
        if not self._recalls(h):
            self._remember(h)

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        # A free block is in probation with `in_duel_sample` clear: `pop_victim` and
        # `on_remove` see to it.
        history, duel = self._history, self._duel
        duel.pool_blocks += len(blocks)
        mask = duel.modulus - 1
        oldest_recalled = self._oldest_recalled_epoch()
        # one stamp per batch: its blocks came together
        clock = self._clock = self._clock + 1
        recalled = False
        for block in blocks:
            block.stamp = clock
            h = stable_key_hash(block.key)
            if not h & mask:
                # Sampled keys feed the shadows, here and at every later use.
                block.in_duel_sample = True
                duel.pool_sampled += 1
                duel.use(h)
            epoch = history.pop(h, None)
            if epoch is not None and epoch > oldest_recalled:
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
                feed(stable_key_hash(block.key))
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
        self._leaves_sample(block)

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
            mode = self._duel.mode
            if victim is None or (
                # Admitting or keeping: segments off, the least recent leaf goes (LRU).
                oldest_protected is not None
                and mode != GUARDING
                and mode != PROTECTING
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
        self._leaves_sample(victim)
        self._remember(stable_key_hash(victim.key))
        return victim

    def reset(self) -> None:
        self._history.clear()
        self._keep_credit = KeepCredit(self._keep_every)
        old = self._duel
        self._duel = AdmissionDuel(
            self.num_blocks, self._history_factor, old.shadow_blocks, self._keep_every
        )
        # Pinned and storing blocks stay through a reset, sample flags and all.
        self._duel.pool_blocks = old.pool_blocks
        self._duel.pool_sampled = old.pool_sampled

    @property
    def doorkeeper(self) -> bool:
        """Whether first-sight keys are refused while the pool is full (guarding)."""
        return self._duel.mode == GUARDING

    @property
    def keeping(self) -> bool:
        """Whether the pool keeps what it holds, letting in one key in `keep_every`."""
        return self._duel.mode == KEEPING

    @property
    def protecting(self) -> bool:
        """Whether the pool admits everything and evicts from probation first."""
        return self._duel.mode == PROTECTING

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

    def _leaves_sample(self, block: HostBlock) -> None:
        """The block leaves the pool; the duel counts what the pool holds."""
        duel = self._duel
        duel.pool_blocks -= 1
        if block.in_duel_sample:
            duel.pool_sampled -= 1
            block.in_duel_sample = False

    def _oldest_recalled_epoch(self) -> int:
        """Keys remembered after this epoch are within the guarding rule's window."""
        return self._epoch - self._duel.window // self._epoch_size

    def _recalls(self, key_hash: int) -> bool:
        """Whether the key is remembered within the guarding rule's window."""
        epoch = self._history.get(key_hash)
        return epoch is not None and epoch > self._oldest_recalled_epoch()

    def _remember(self, key_hash: int) -> None:
        history = self._history
        if key_hash in history:
            history.move_to_end(key_hash)  # remembered again, outside the window
        history[key_hash] = self._epoch
        self._epoch_left -= 1
        if not self._epoch_left:
            self._epoch += 1
            self._epoch_left = self._epoch_size
        if len(history) > self._history_cap:
            history.popitem(last=False)
