"""The invariants of the host block pool (`block_pool.py`), and the check of all of
them at once.

- A pinned block is never evicted, dropped by `reset`, or reused.
- A STORING block is never visible to lookups and never evicted.
- A block `reset` could not drop (pinned or STORING) is never visible to lookups again:
  it holds KV of before the reset (vLLM resets before changing the weights), so it
  stays held, unread, until freed: once evictable, evicted before any other, or freed
  by a store of its key.
- Blocks in use <= `num_blocks`; every host block id is either free or held by one key.
- A key maps to at most one host block; freed ids are reused.

The check is O(num_blocks), for tests and debugging; the pool's hot path asserts what
each call could break. It is the pool's own check, kept in a module of its own for
the pool's length: it reads the pool's private state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from .policies.base import BlockState, HostBlock

if TYPE_CHECKING:
    from .block_pool import HostBlockPool


def check_pool_invariants(pool: HostBlockPool) -> None:
    """Asserts every invariant of `pool`. O(num_blocks)."""
    blocks, free, by_key = pool._blocks, pool._free, pool._by_key
    free_ids = {block.block_id for block in free}
    assert len(free_ids) == len(free), "a free id is listed twice"
    held_ids = {block.block_id for block in by_key.values()}
    assert len(held_ids) == len(by_key), "a host block is held by two keys"
    assert not free_ids & held_ids, "a held block is also free"
    assert len(free_ids) + len(held_ids) == pool.num_blocks, "a block id leaked"
    storing = pinned = 0
    for key, block in by_key.items():
        assert block.key == key and blocks[block.block_id] is block
        assert block.pin_count >= 0
        assert block.state is BlockState.READY or not block.pin_count, "pinned"
        storing += block.state is BlockState.STORING
        pinned += block.pin_count > 0
        if block.parent is not None:
            assert by_key.get(block.parent.key) is block.parent, "dangling parent"
        assert block.num_children == sum(1 for _ in _children(block))
        for child in _children(block):
            assert child.parent is block
    for block in free:
        assert block.key is None and block.owner is None and block.num_children == 0
    assert storing == pool.num_storing and pinned == pool.num_pinned
    assert pool._stale <= held_ids, "a stale id is not held"


def _children(block: HostBlock) -> Iterator[HostBlock]:
    child = block.first_child
    while child is not None:
        yield child
        child = child.next_sibling
