"""Low Inter-reference Recency Set (LIRS; Jiang and Zhang, SIGMETRICS'02) over host
blocks.

Blocks are LIR (reused at short distance: kept) or HIR. Most of the pool holds LIR
blocks (`1 - hir_fraction` of it); resident HIR blocks wait in a FIFO queue Q and are
the victims. LIRS's recency stack S holds every block used more recently than the
oldest LIR block, resident or not. A HIR block used again while still in S has a reuse
distance shorter than the oldest LIR block's recency: it becomes LIR, and the oldest LIR
block drops to the tail of Q. A scan of new blocks passes through Q and never displaces
a LIR block.

S is kept implicitly, so that every operation is O(1): each use stamps the block with a
counter, LIR blocks form an LRU list whose head is S's bottom, and "in S" means "used
after the oldest LIR block" (stamp above its stamp). Evicted HIR blocks that were in S
stay in S as non-resident entries: their key hash and stamp, in a history bounded at
`history_factor` (2) times the pool's capacity, oldest evictions dropped first. Entries
that fall below S's bottom are stale; a look-up ignores them, and evictions drop them
from the front of the history.

The pool's hooks: pinned blocks leave their list and come back at its tail (a load is a
use); STORING blocks are listed only once READY. When every resident HIR block is still
being stored (a chain longer than Q), a new key is refused and remembered as a
non-resident HIR block: LIRS would have evicted the oldest of them, this chain's own
blocks, to take it, so the resident set keeps its shape (the chain's head stays, where
LIRS would keep its tail). When every HIR block is pinned, the oldest LIR block goes.
Chain-blind, like `lru`.

Cost: every hook O(1) per block (amortised: stale history entries are dropped at most
once each). Memory: the lists live in the blocks (`segment`, `stamp`, links); the
history holds at most 2 entries per host block, OrderedDict entries with an int stamp
of about 220 bytes each (CPython 3.11): measured with the history full, 440 bytes per
host block on top of the pool's own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .base import BlockKey, BlockList, BlockState, EvictionPolicy, HostBlock

_LIR = 1
_HIR = 2  # resident HIR: in the queue Q


class LIRSPolicy(EvictionPolicy):
    """LIRS over the pool's blocks; see the module docstring."""

    name = "lirs"

    def __init__(
        self, num_blocks: int, hir_fraction: float = 0.01, history_factor: float = 2.0
    ) -> None:
        super().__init__(num_blocks)
        if not 0.0 < hir_fraction < 1.0:
            raise ValueError(f"hir_fraction must be in (0, 1), got {hir_fraction}")
        if history_factor < 0.0:
            raise ValueError(f"history_factor must be >= 0, got {history_factor}")
        self.lir_cap = max(1, num_blocks - max(1, int(num_blocks * hir_fraction)))
        self._lir = BlockList()  # LRU order: the head is the bottom of S
        self._queue = BlockList()  # resident HIR blocks, FIFO: the head goes next
        self.num_lir = 0  # listed or not (pinned, storing)
        self._hir_storing = 0  # HIR blocks not READY yet
        self._clock = 0  # use stamps: a counter, never wall-clock time
        # Non-resident HIR blocks in S: key hash -> stamp of the last use.
        self._history: OrderedDict[int, int] = OrderedDict()
        self._history_cap = int(num_blocks * history_factor)

    # ----- hooks -----

    def admit(self, key: BlockKey) -> bool:
        if self._queue.size or not self._hir_storing:
            return True
        h = hash(key)
        last = self._history.get(h)
        if last is not None and last > self._bottom():
            return True  # becomes LIR: the oldest LIR block makes the room
        # Every resident HIR block is still being stored (or pinned): LIRS would have
        # made this block a resident HIR and evicted the oldest of them, this chain's
        # own. Refusing it keeps the same number of HIR blocks, and it is remembered
        # as a non-resident HIR block, as LIRS would have it after that eviction.
        self.on_declined(key)
        return False

    def on_declined(self, key: BlockKey) -> None:
        self._clock += 1
        self._remember(hash(key), self._clock)

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        history = self._history
        bottom = self._bottom()
        # Stamped deepest first, so that ancestors end the most recent.
        clock = self._clock
        for block in reversed(blocks):
            clock += 1
            last = history.pop(hash(block.key), None)
            block.stamp = clock
            if self.num_lir < self.lir_cap or (last is not None and last > bottom):
                block.segment = _LIR
                self.num_lir += 1
            else:
                block.segment = _HIR
                self._hir_storing += 1
        self._clock = clock
        self._demote()

    def on_ready(self, blocks: Sequence[HostBlock]) -> None:
        hir = [block for block in blocks if block.segment != _LIR]
        self._queue.extend(hir)
        self._hir_storing -= len(hir)
        if len(hir) < len(blocks):
            self._lir.extend([block for block in blocks if block.segment == _LIR])

    def on_access(self, blocks: Sequence[HostBlock]) -> None:
        lir, queue = self._lir, self._queue
        clock = self._clock
        bottom = self._bottom()
        promoted = False
        for block in blocks:
            clock += 1
            if block.segment == _LIR:
                if block.owner is lir:
                    lir.move_to_end(block)
            elif block.stamp > bottom:  # a resident HIR block still in S
                block.segment = _LIR
                self.num_lir += 1
                promoted = True
                if block.owner is queue:
                    queue.remove(block)
                    lir.append(block)
            elif block.owner is queue:
                queue.move_to_end(block)
            block.stamp = clock
        self._clock = clock
        if promoted:
            self._demote()

    def on_pin(self, block: HostBlock) -> None:
        if block.owner is not None:
            block.owner.remove(block)

    def on_unpin(self, block: HostBlock) -> None:
        self._clock += 1
        block.stamp = self._clock
        (self._lir if block.segment == _LIR else self._queue).append(block)

    def on_remove(self, block: HostBlock) -> None:
        if block.owner is not None:
            block.owner.remove(block)
        if block.segment == _LIR:
            self.num_lir -= 1
        elif block.state is BlockState.STORING:
            self._hir_storing -= 1
        block.segment = 0

    def pop_victim(self) -> HostBlock | None:
        victim = self._queue.popleft()
        if victim is None:
            victim = self._lir.popleft()  # every HIR block is pinned or storing
            if victim is None:
                return None
            self.num_lir -= 1
        elif victim.stamp > self._bottom():
            self._remember(hash(victim.key), victim.stamp)
        victim.segment = 0
        return victim

    def reset(self) -> None:
        self._history.clear()

    # ----- internals -----

    def _bottom(self) -> int:
        """Stamp of the oldest listed LIR block: S holds what was used after it."""
        head = self._lir.head
        return -1 if head is None else head.stamp

    def _demote(self) -> None:
        """The oldest LIR blocks drop to the tail of Q until the LIR set fits."""
        lir, queue = self._lir, self._queue
        while self.num_lir > self.lir_cap:
            oldest = lir.popleft()
            if oldest is None:
                return
            oldest.segment = _HIR
            self.num_lir -= 1
            queue.append(oldest)

    def _remember(self, key_hash: int, stamp: int) -> None:
        history = self._history
        history[key_hash] = stamp
        bottom = self._bottom()
        # Entries below S's bottom are stale: drop the ones at the front (at most two
        # per eviction, which keeps the hook O(1) and still outpaces their creation).
        for _ in range(2):
            oldest_hash, oldest_stamp = next(iter(history.items()))
            if oldest_stamp > bottom:
                break
            del history[oldest_hash]
        while len(history) > self._history_cap:
            history.popitem(last=False)
