"""S3-FIFO (Yang et al., SOSP'23): a small FIFO that filters one-hit wonders in front
of a main FIFO with CLOCK-like second chances.

New blocks enter the small queue S (`small_fraction` of the pool, 10%). A use only
raises the block's frequency (`stamp`, capped at 3): no list moves on the hit path.
Eviction takes from S while S holds at least its share of the pool: a block used
since it came in moves to the main queue M, one never used goes, and its key hash is
remembered in a ghost queue G of M's size. From M, a block with frequency above zero
is reinserted at M's tail with its frequency less one; one at zero goes. A new key
found in G enters M directly.

FIFO order must survive loads, so a pin does not move a block: a pinned block found at
the head of a queue is parked (unlisted) and returns to that head when unpinned, since
it was older than everything listed. STORING blocks are listed only once READY. When S
is full of blocks still being stored (a chain longer than S), a new key is refused and
goes to G: S3-FIFO would have evicted the oldest of them, this chain's own, to take it,
so S keeps its share (holding the chain's head, where S3-FIFO would hold its tail).
Chain-blind, like `lru`.

Cost: every hook O(1) per block; `pop_victim` is amortised O(1): each reinsertion
spends one unit of frequency that a use paid for, and a block is parked at most once
per pin. Memory: the queues live in the blocks (`segment`, `stamp`, links); G holds at
most 0.9 key hashes per host block, OrderedDict entries of about 170 bytes each
(CPython 3.11): measured with G full, 155 bytes per host block on top of the pool's
own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .base import BlockKey, BlockList, BlockState, EvictionPolicy, HostBlock

_SMALL = 1
_MAIN = 2
_MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO over the pool's blocks; see the module docstring."""

    name = "s3fifo"

    def __init__(self, num_blocks: int, small_fraction: float = 0.1) -> None:
        super().__init__(num_blocks)
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self.small_cap = max(1, int(num_blocks * small_fraction))
        self._small = BlockList()
        self._main = BlockList()
        self.num_small = 0  # blocks in S, listed or not (parked, storing)
        self._small_storing = 0  # blocks in S not READY yet
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._ghost_cap = max(0, num_blocks - self.small_cap)

    # ----- hooks -----

    def admit(self, key: BlockKey) -> bool:
        if self._small.size or self.num_small < self.small_cap:
            return True
        if not self._small_storing:
            return True  # S is parked by loads, not filled by this store
        if hash(key) in self._ghost:
            return True  # enters M, which makes the room
        # S is full of blocks still being stored (or parked): S3-FIFO would evict the
        # oldest of them, this chain's own, to take the key. Refusing it keeps S's
        # shape, and the key goes to G as such an eviction would send it.
        self.on_declined(key)
        return False

    def on_declined(self, key: BlockKey) -> None:
        self._remember(hash(key))

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        ghost = self._ghost
        for block in blocks:
            block.stamp = 0
            h = hash(block.key)
            if h in ghost:
                del ghost[h]
                block.segment = _MAIN
            else:
                block.segment = _SMALL
                self.num_small += 1
                self._small_storing += 1

    def on_ready(self, blocks: Sequence[HostBlock]) -> None:
        # Deepest first, as the pool reports them: descendants leave before ancestors.
        newcomers = [block for block in blocks if block.segment != _MAIN]
        self._small.extend(newcomers)
        self._small_storing -= len(newcomers)
        if len(newcomers) < len(blocks):
            self._main.extend([block for block in blocks if block.segment == _MAIN])

    def on_access(self, blocks: Sequence[HostBlock]) -> None:
        for block in blocks:
            if block.stamp < _MAX_FREQ:
                block.stamp += 1

    def on_pin(self, block: HostBlock) -> None:
        pass  # stays in place; `pop_victim` parks it if it reaches a head

    def on_unpin(self, block: HostBlock) -> None:
        if block.owner is None and block.state is BlockState.READY:
            (self._main if block.segment == _MAIN else self._small).appendleft(block)

    def on_remove(self, block: HostBlock) -> None:
        if block.owner is not None:
            block.owner.remove(block)
        if block.segment == _SMALL:
            self.num_small -= 1
            if block.state is BlockState.STORING:
                self._small_storing -= 1
        block.segment = 0

    def pop_victim(self) -> HostBlock | None:
        small, main = self._small, self._main
        while True:
            head = small.head
            if head is not None and (self.num_small >= self.small_cap or not main.size):
                small.remove(head)
                if head.pin_count:
                    continue  # parked until `on_unpin`
                self.num_small -= 1
                if head.stamp:
                    head.stamp = 0
                    head.segment = _MAIN
                    main.append(head)
                    continue
                self._remember(hash(head.key))
                head.segment = 0
                return head
            head = main.head
            if head is None:
                return None
            if head.pin_count:
                main.remove(head)
                continue
            if head.stamp:
                head.stamp -= 1
                main.move_to_end(head)
                continue
            main.remove(head)
            head.segment = 0
            return head

    def reset(self) -> None:
        self._ghost.clear()

    # ----- internals -----

    def _remember(self, key_hash: int) -> None:
        ghost = self._ghost
        ghost[key_hash] = None
        while len(ghost) > self._ghost_cap:
            ghost.popitem(last=False)
