"""What an eviction policy sees of the host tier, and the interface every policy
implements.

The pool owns one `HostBlock` per host block id, created once and reused, so the hot
path allocates nothing. A policy orders the blocks it may evict with intrusive doubly
linked lists (`BlockList`) threaded through the blocks themselves: every list operation
is O(1) and allocation-free. Recency is a monotonic counter kept by the policy, never
wall-clock time, so tests are deterministic.

Blocks form chains: each block may point at its `parent` (the block just before it in
its request), and the pool keeps `num_children` and a sibling list up to date, so a
policy can tell a leaf from a block that other blocks depend on, and the pool can cut
children loose when their parent leaves.
"""

from __future__ import annotations

import enum
import zlib
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Sequence
from typing import ClassVar

# (KV cache group id, vLLM block hash bytes) in production; any hashable in tests.
BlockKey = Hashable


def stable_key_hash(key: BlockKey) -> int:
    """A hash of `key` that every process computes alike. Python salts `hash()` of
    bytes and str per process (PYTHONHASHSEED), so a policy that samples keys by it
    would decide differently in each run. bytes and str: CRC-32 in the low 32 bits
    (what a sample by the low bits reads) and Adler-32 above it; tuples element by
    element; ints are not salted. O(len(key)), about 0.2 us for a 36-byte key."""
    if isinstance(key, str):
        key = key.encode()
    if isinstance(key, bytes):
        return zlib.crc32(key) | zlib.adler32(key) << 32
    if isinstance(key, tuple):
        return hash(tuple(map(stable_key_hash, key)))
    return hash(key)


class BlockState(enum.Enum):
    """Lifecycle of a held host block. Pinning (loads in flight) is a separate count."""

    # allocated, copy in flight: invisible to lookups, never evicted
    STORING = enum.auto()
    READY = enum.auto()  # copy finished: visible to lookups, evictable when unpinned


class HostBlock:
    """One host block: identity, state, chain links and the policy's intrusive links.

    `key` is None exactly when the block is free. `prev`/`next` belong to whichever
    `BlockList` the policy put the block in (`owner`; a block not in a list links to
    itself); `segment`, `stamp` and `in_duel_sample` are the policy's own bookkeeping
    and mean nothing to the pool.
    """

    __slots__ = (
        "block_id",
        "key",
        "state",
        "pin_count",
        "parent",
        "num_children",
        "first_child",
        "next_sibling",
        "prev_sibling",
        "orphan",
        "prev",
        "next",
        "owner",
        "segment",
        "stamp",
        "in_duel_sample",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.key: BlockKey | None = None
        self.state = BlockState.STORING
        self.pin_count = 0
        self.parent: HostBlock | None = None
        self.num_children = 0
        self.first_child: HostBlock | None = None
        self.next_sibling: HostBlock | None = None
        self.prev_sibling: HostBlock | None = None
        # True when the block's chain has a gap above it: its parent key is
        # not held here.
        self.orphan = False
        self.prev: HostBlock = self
        self.next: HostBlock = self
        self.owner: BlockList | None = None
        self.segment = 0
        self.stamp = 0
        self.in_duel_sample = False

    @property
    def evictable(self) -> bool:
        """READY and not pinned by a load in flight."""
        return self.state is BlockState.READY and self.pin_count == 0

    def __repr__(self) -> str:
        return (
            f"HostBlock(id={self.block_id}, key={self.key!r}, {self.state.name}, "
            f"pins={self.pin_count}, children={self.num_children})"
        )


class BlockList:
    """Intrusive doubly linked list of `HostBlock`s; head is the next victim.

    A block is in at most one list at a time (`block.owner`). Every method is O(1),
    allocation-free and makes no further calls, except iteration and `clear`.
    """

    __slots__ = ("root", "size")

    def __init__(self) -> None:
        # Sentinel: root.next is the head, root.prev the tail. Public so that a policy
        # may inline a list operation on its hot path.
        self.root = HostBlock(-1)
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block: HostBlock) -> bool:
        return block.owner is self

    def __iter__(self) -> Iterator[HostBlock]:
        node = self.root.next
        while node is not self.root:
            yield node
            node = node.next

    @property
    def head(self) -> HostBlock | None:
        node = self.root.next
        return None if node is self.root else node

    def append(self, block: HostBlock) -> None:
        """Inserts at the tail (last to be evicted)."""
        assert block.owner is None, f"{block} is already in a list"
        root = self.root
        tail = root.prev
        block.prev = tail
        block.next = root
        tail.next = block
        root.prev = block
        block.owner = self
        self.size += 1

    def appendleft(self, block: HostBlock) -> None:
        """Inserts at the head (next to be evicted)."""
        assert block.owner is None, f"{block} is already in a list"
        root = self.root
        head = root.next
        block.prev = root
        block.next = head
        head.prev = block
        root.next = block
        block.owner = self
        self.size += 1

    def remove(self, block: HostBlock) -> None:
        assert block.owner is self, f"{block} is not in this list"
        prev, nxt = block.prev, block.next
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = block
        block.owner = None
        self.size -= 1

    def move_to_end(self, block: HostBlock) -> None:
        """Moves a block of this list to its tail."""
        assert block.owner is self, f"{block} is not in this list"
        root = self.root
        tail = root.prev
        if tail is block:
            return
        prev, nxt = block.prev, block.next
        prev.next = nxt
        nxt.prev = prev
        block.prev = tail
        block.next = root
        tail.next = block
        root.prev = block

    def extend(self, blocks: Sequence[HostBlock]) -> None:
        """Appends unlisted blocks at the tail, in order. O(len(blocks)), one splice."""
        if not blocks:
            return
        root = self.root
        tail = root.prev
        for block in blocks:
            assert block.owner is None, f"{block} is already in a list"
            block.prev = tail
            tail.next = block
            block.owner = self
            tail = block
        tail.next = root
        root.prev = tail
        self.size += len(blocks)

    def move_all_to_end(self, blocks: Sequence[HostBlock]) -> None:
        """Moves the blocks of this list among `blocks` to its tail, in order; skips
        others.

        O(len(blocks)) with no calls: the batched `move_to_end` of the lookup path.
        """
        root = self.root
        tail = root.prev
        for block in blocks:
            if block.owner is not self or block is tail:
                continue
            prev, nxt = block.prev, block.next
            prev.next = nxt
            nxt.prev = prev
            block.prev = tail
            tail.next = block
            tail = block
        tail.next = root
        root.prev = tail

    def popleft(self) -> HostBlock | None:
        block = self.root.next
        if block is self.root:
            return None
        self.remove(block)
        return block

    def clear(self) -> None:
        while self.popleft() is not None:
            pass


class EvictionPolicy(ABC):
    """Decides which evictable host block goes next, and where new blocks start.

    The pool calls the hooks below at every state change; a policy keeps only the blocks
    it may evict in its lists. Contract, which the pool enforces with asserts:
    `pop_victim` returns only evictable blocks (READY, unpinned) and never a block it
    was told is pinned or storing. Hooks on the lookup and store paths take batches, so
    that a policy pays one call per batch, not per block. Every hook is O(1) per block
    unless its docstring says otherwise. `name` is the registry name.
    """

    name: ClassVar[str]

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks

    def admit(self, key: BlockKey) -> bool:
        """Whether a new key may evict a block to get in; asked only when the pool is
        full.

        Declining stops the store of the rest of that chain (descendants would be
        orphans); the policy then hears of each descendant through `on_declined`.
        """
        return True

    def on_declined(self, key: BlockKey) -> None:  # noqa: B027 - optional hook
        """A key was not stored because an ancestor of it in the same call was
        declined."""

    @abstractmethod
    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        """These blocks were allocated for a store (STORING, chain links set), in chain
        order.

        Never victims yet. The pool reports them before it next asks `admit` or
        `pop_victim`, so the policy sees inserts and evictions in their true order.
        """

    @abstractmethod
    def on_ready(self, blocks: Sequence[HostBlock]) -> None:
        """These blocks' stores finished: READY, unpinned, evictable from now on.

        Deepest first: a block comes before its ancestors among `blocks`.
        """

    @abstractmethod
    def on_access(self, blocks: Sequence[HostBlock]) -> None:
        """These READY blocks were looked up or touched (some may be pinned).

        Deepest first, so a policy that orders by recency leaves ancestors the most
        recent.
        """

    def on_device_hit(self, blocks: Sequence[HostBlock]) -> None:
        """These READY blocks' copies in the device cache were hit, so the host copies
        were used but not read (deepest first).

        A use, but not one the host tier served: a policy that learns from its own hits
        may tell them apart. Default: `on_access`.
        """
        self.on_access(blocks)

    @abstractmethod
    def on_pin(self, block: HostBlock) -> None:
        """The block's pin count went 0 -> 1: it must not be a victim until
        `on_unpin`."""

    @abstractmethod
    def on_unpin(self, block: HostBlock) -> None:
        """The block's pin count went 1 -> 0: it may be evicted again."""

    @abstractmethod
    def on_remove(self, block: HostBlock) -> None:
        """The block leaves the pool other than as a victim (failed store, reset)."""

    @abstractmethod
    def pop_victim(self) -> HostBlock | None:
        """Choose an evictable block, forget it, and return it; None if there is
        none."""

    def on_orphaned(self, block: HostBlock) -> None:  # noqa: B027 - optional hook
        """The block's parent left the pool while the block stayed (its chain has a
        gap)."""

    def on_leaf(self, block: HostBlock) -> None:  # noqa: B027 - optional hook
        """The block's last child left the pool; the block (any state) is a leaf
        again."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget history that outlives blocks (ghost lists, clocks). Lists are empty
        here."""


def attach_child(parent: HostBlock, block: HostBlock) -> None:
    """Links `block` as `parent`'s newest child. O(1).

    The policy is not told: a block that gains a child stays where it is listed, and a
    chain-aware policy finds it has children when it reaches the head of its list.
    """
    block.parent = parent
    sibling = parent.first_child
    if sibling is not None:
        block.next_sibling = sibling
        sibling.prev_sibling = block
    parent.first_child = block
    parent.num_children += 1


def cut_from_chain(block: HostBlock, policy: EvictionPolicy) -> None:
    """Unlinks a block that leaves its holder from its parent and its children.

    Its parent hears `on_leaf` if this was its last child; each child becomes an orphan
    (`on_orphaned`). O(1) plus O(1) per child.
    """
    parent = block.parent
    if parent is not None:
        if block.prev_sibling is None:
            parent.first_child = block.next_sibling
        else:
            block.prev_sibling.next_sibling = block.next_sibling
        if block.next_sibling is not None:
            block.next_sibling.prev_sibling = block.prev_sibling
        parent.num_children -= 1
        if parent.num_children == 0:
            policy.on_leaf(parent)
    child = block.first_child
    while child is not None:
        following = child.next_sibling
        child.parent = child.next_sibling = child.prev_sibling = None
        child.orphan = True
        policy.on_orphaned(child)
        child = following
    block.parent = block.first_child = None
    block.next_sibling = block.prev_sibling = None
    block.num_children = 0
    block.orphan = False
