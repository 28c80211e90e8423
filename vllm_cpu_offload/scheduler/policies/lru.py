"""Least-recently-used eviction: the baseline every other policy is measured against."""

from __future__ import annotations

from collections.abc import Sequence

from .base import BlockList, EvictionPolicy, HostBlock


class LRUPolicy(EvictionPolicy):
    """Evicts the evictable block that was used longest ago.

    One intrusive list holds the evictable blocks (READY, unpinned), least recent at the
    head. A pinned block leaves the list and comes back at the tail when its last load
    finishes, since a load is a use. Blind to chains: it may evict a block whose
    descendants stay (the pool then marks them orphans). Every hook is O(1).
    """

    name = "lru"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._lru = BlockList()

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        pass

    def on_ready(self, blocks: Sequence[HostBlock]) -> None:
        self._lru.extend(blocks)

    def on_access(self, blocks: Sequence[HostBlock]) -> None:
        self._lru.move_all_to_end(blocks)  # pinned blocks are unlisted: skipped

    def on_pin(self, block: HostBlock) -> None:
        self._lru.remove(block)

    def on_unpin(self, block: HostBlock) -> None:
        self._lru.append(block)

    def on_remove(self, block: HostBlock) -> None:
        if block.owner is self._lru:
            self._lru.remove(block)

    def pop_victim(self) -> HostBlock | None:
        return self._lru.popleft()
