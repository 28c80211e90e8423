"""Adaptive Replacement Cache (ARC; Megiddo and Modha, FAST'03) over host blocks.

Resident blocks sit in T1 (used once since they came in) or T2 (used again while
held); each is an intrusive LRU list. Two ghost lists remember the key hashes that
left T1 (B1) and T2 (B2). A new key found in B1 means T1 was too small: the target
size `p` of T1 grows; found in B2, it shrinks. A returning ghost key starts in T2. The
victim comes from T1 while T1 holds more than `p` blocks, otherwise from T2.

The pool asks `admit` just before it asks for a victim, so that is where a ghost hit of
the incoming key moves `p`, as ARC's REPLACE expects. Pinned blocks leave their list and
come back at its tail (a load is a use); STORING blocks are listed only once READY.
When T1 must pay but holds only blocks still being stored (a chain longer than T1's
share), a new key is refused and goes to B1: ARC would have evicted the oldest of them,
this chain's own, to take it (the chain's head stays, where ARC would keep its tail).
Chain-blind, like `lru`.

Cost: every hook O(1) per block. Memory: the lists live in the blocks themselves
(`segment`, links); the ghosts hold at most one key hash per host block, B1 + B2 <= C,
OrderedDict entries of about 145 bytes each (CPython 3.11, 64-bit hashes; measured
with the ghosts half full: 72 bytes per host block), so at most about 150 bytes per
host block on top of the pool's own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .base import BlockKey, BlockList, BlockState, EvictionPolicy, HostBlock

_T1 = 1  # resident, seen once since it came in
_T2 = 2  # resident, used again while held


class ARCPolicy(EvictionPolicy):
    """ARC over the pool's blocks; see the module docstring."""

    name = "arc"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._t1 = BlockList()
        self._t2 = BlockList()
        # Resident blocks per segment, listed or not (pinned, storing).
        self._n_t1 = 0
        self._n_t2 = 0
        self._t1_storing = 0  # blocks in T1 not READY yet
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0.0  # target size of T1
        # Hash of the key whose ghost hit `admit` already counted, so that `on_insert`
        # does not count it twice; and whether that key came from B2 (REPLACE's tie).
        self._adapted: int | None = None
        self._incoming_b2 = False

    # ----- hooks -----

    def admit(self, key: BlockKey) -> bool:
        h = hash(key)
        recalled = self._adapt(h)
        self._adapted = h if recalled else None
        self._incoming_b2 = h in self._b2
        if (
            recalled
            or self._t1.head is not None
            or not self._t1_storing
            or not self._from_t1()
        ):
            return True
        # T1 is over its target but holds only blocks still being stored (or pinned):
        # ARC would evict the oldest of them, this chain's own, to take the key.
        # Refusing it keeps T1's shape, and the key goes to B1 as that eviction would
        # send it.
        self.on_declined(key)
        return False

    def on_declined(self, key: BlockKey) -> None:
        self._b1[hash(key)] = None
        self._trim_ghosts()

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        b1, b2 = self._b1, self._b2
        for block in blocks:
            h = hash(block.key)
            if h in b1 or h in b2:
                if h != self._adapted:
                    self._adapt(h)
                b1.pop(h, None)
                b2.pop(h, None)
                block.segment = _T2
                self._n_t2 += 1
            else:
                block.segment = _T1
                self._n_t1 += 1
                self._t1_storing += 1
        self._adapted = None
        self._trim_ghosts()

    def on_ready(self, blocks: Sequence[HostBlock]) -> None:
        newcomers = [block for block in blocks if block.segment != _T2]
        self._t1.extend(newcomers)
        self._t1_storing -= len(newcomers)
        if len(newcomers) < len(blocks):
            self._t2.extend([block for block in blocks if block.segment == _T2])

    def on_access(self, blocks: Sequence[HostBlock]) -> None:
        t1, t2 = self._t1, self._t2
        promoted = 0
        for block in blocks:
            if block.segment == _T1:
                block.segment = _T2
                promoted += 1
                if block.owner is t1:
                    t1.remove(block)
                    t2.append(block)
        # Deepest first, so that ancestors end the most recent; unlisted (pinned)
        # blocks are skipped.
        t2.move_all_to_end(blocks)
        self._n_t1 -= promoted
        self._n_t2 += promoted

    def on_pin(self, block: HostBlock) -> None:
        if block.owner is not None:
            block.owner.remove(block)

    def on_unpin(self, block: HostBlock) -> None:
        (self._t2 if block.segment == _T2 else self._t1).append(block)

    def on_remove(self, block: HostBlock) -> None:
        if block.owner is not None:
            block.owner.remove(block)
        if block.segment == _T1:
            self._n_t1 -= 1
            if block.state is BlockState.STORING:
                self._t1_storing -= 1
        elif block.segment == _T2:
            self._n_t2 -= 1
        block.segment = 0

    def pop_victim(self) -> HostBlock | None:
        from_t1 = self._from_t1()
        self._incoming_b2 = False
        first, second = (self._t1, self._t2) if from_t1 else (self._t2, self._t1)
        victim = first.head or second.head
        if victim is None:
            return None
        victim.owner.remove(victim)  # type: ignore[union-attr]
        h = hash(victim.key)
        if victim.segment == _T1:
            self._n_t1 -= 1
            self._b1[h] = None
        else:
            self._n_t2 -= 1
            self._b2[h] = None
        victim.segment = 0
        return victim

    def reset(self) -> None:
        self._b1.clear()
        self._b2.clear()
        self.p = 0.0
        self._adapted = None
        self._incoming_b2 = False

    # ----- internals -----

    def _from_t1(self) -> bool:
        """ARC's REPLACE: whether T1 pays for the incoming key."""
        n_t1 = self._n_t1
        return n_t1 > self.p or (self._incoming_b2 and n_t1 >= self.p)

    def _adapt(self, h: int) -> bool:
        """Moves `p` for a ghost hit on `h`; returns whether it was one."""
        b1, b2 = len(self._b1), len(self._b2)
        if h in self._b1:
            self.p = min(float(self.num_blocks), self.p + max(1.0, b2 / b1))
            return True
        if h in self._b2:
            self.p = max(0.0, self.p - max(1.0, b1 / b2))
            return True
        return False

    def _trim_ghosts(self) -> None:
        # ARC's bounds: |T1| + |B1| <= C and |T1| + |T2| + |B1| + |B2| <= 2C; and the
        # ghosts together at most C, which bounds the memory per host block.
        b1, b2, c = self._b1, self._b2, self.num_blocks
        while b1 and self._n_t1 + len(b1) > c:
            b1.popitem(last=False)
        while b2 and self._n_t1 + self._n_t2 + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)
        while len(b1) + len(b2) > c:
            (b2 if b2 else b1).popitem(last=False)
