"""The host tier's block pool: which vLLM block hashes are held in host memory, and
where.

Runs in the scheduler process and never touches memory itself: it hands out host block
ids for the worker-side transfer engine to copy into, tracks each block through
STORING -> READY, pins blocks while loads read them, and asks an `EvictionPolicy` for
victims when it needs room.

Its invariants are listed, and checked, in `pool_invariants.py` (asserts on the hot
path check those that a call could break).

Every operation is O(1) per block it names (dict look-ups and intrusive lists), except
`reset` and `check_invariants`, which are O(blocks held). Nothing reads the wall clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import cast

from .policies.base import (
    BlockKey,
    BlockState,
    EvictionPolicy,
    HostBlock,
    attach_child,
    cut_from_chain,
)
from .pool_events import PersistenceListener, PoolEvent
from .pool_invariants import check_pool_invariants

__all__ = ["BlockKey", "BlockState", "HostBlockPool", "PoolEvent"]


class HostBlockPool:
    """Host block ids for `num_blocks` blocks, keyed by (KV group id, block hash)."""

    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy,
        record_events: bool = True,
        persistence: PersistenceListener | None = None,
    ):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.policy = policy
        self._blocks = [HostBlock(i) for i in range(num_blocks)]
        # A stack, so the lowest ids go first and a freed id is the next one reused.
        self._free: list[HostBlock] = self._blocks[::-1]
        self._by_key: dict[BlockKey, HostBlock] = {}
        self._num_storing = 0
        self._num_pinned = 0
        self._record_events = record_events
        self._events: list[PoolEvent] = []
        # Told of every block that becomes READY and of every block released, before its
        # id can be handed out again: what a restarted engine may serve.
        self._persistence = persistence
        # Blocks of sessions that ended (`demote`), evicted before the policy's victims.
        self._doomed: OrderedDict[int, BlockKey] = OrderedDict()
        # Ids of blocks held through a `reset`: never visible to lookups again.
        self._stale: set[int] = set()

    # ----- sizes -----

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (storing, ready or pinned), 0.0 to 1.0."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    @property
    def num_storing(self) -> int:
        return self._num_storing

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._by_key

    def state_of(self, key: BlockKey) -> BlockState | None:
        """The key's state, or None if the pool does not hold it; a block held through
        a `reset` is STORING for good (held, invisible)."""
        block = self._by_key.get(key)
        if block is None:
            return None
        if self._stale and block.block_id in self._stale:
            return BlockState.STORING
        return block.state

    # ----- lookups and loads -----

    def count_hits(self, keys: Sequence[BlockKey], *, use: bool = True) -> int:
        """Length of the longest prefix of `keys` whose blocks are READY. O(hits).

        The hits count as a use for the policy (`use`; else the caller `touch`es
        those it takes), touched deepest first so that an ancestor is always at least
        as recent as its descendants.
        """
        hits: list[HostBlock] = []
        append = hits.append
        get = self._by_key.get
        ready = BlockState.READY
        stale = self._stale
        for key in keys:
            block = get(key)
            if block is None or block.state is not ready:
                break
            if stale and block.block_id in stale:
                break
            append(block)
        if hits and use:
            hits.reverse()
            self.policy.on_access(hits)
            if self._doomed:
                self._spare(hits)
        return len(hits)

    def touch(self, keys: Sequence[BlockKey], *, by_device: bool = False) -> None:
        """Marks the READY blocks among `keys` as used.

        `by_device`: the device cache hit them, so their host copies were not read
        (the policy hears `on_device_hit`, not `on_access`). Keys that are missing or
        STORING are ignored. Deepest first, as in `count_hits`.
        """
        get = self._by_key.get
        ready = BlockState.READY
        stale = self._stale
        used = [
            block
            for key in reversed(keys)
            if (block := get(key))
            and block.state is ready
            and not (stale and block.block_id in stale)
        ]
        if used:
            if by_device:
                self.policy.on_device_hit(used)
            else:
                self.policy.on_access(used)
            if self._doomed:
                self._spare(used)

    def demote(self, keys: Sequence[BlockKey]) -> None:
        """Dooms a chain whose session ended (`keys`, prefix order): evicted before
        any other block, leaf first, unless read first; up to the first block another
        chain shares (a child it does not name). O(len(keys))."""
        child: HostBlock | None = None
        for key in reversed(keys):
            if (block := self._by_key.get(key)) is None:
                continue
            own = child is not None and child.parent is block
            if block.num_children > own:
                break
            self._doomed[block.block_id] = key
            child = block

    def pin(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pins READY blocks for a load; returns their host block ids in order.

        A pinned block is never evicted or overwritten until a matching `unpin`.

        Raises:
            ValueError: a key is not held or not READY (nothing is pinned then).

        """
        blocks = [self._by_key.get(key) for key in keys]
        for key, block in zip(keys, blocks, strict=True):
            if block is None or block.state is not BlockState.READY:
                raise ValueError(
                    f"cannot pin {key!r}: it is not a READY block of the pool"
                )
        ids = []
        for block in blocks:
            assert block is not None
            self._pin_block(block)
            ids.append(block.block_id)
        return ids

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        """Ends one load of each block.

        Raises:
            ValueError: a key is not held or not pinned (nothing is unpinned then).

        """
        blocks = [self._by_key.get(key) for key in keys]
        for key, block in zip(keys, blocks, strict=True):
            if block is None or block.pin_count == 0:
                raise ValueError(f"cannot unpin {key!r}: it is not pinned")
        for block in blocks:
            assert block is not None
            self._unpin_block(block)

    # ----- stores -----

    def allocate_for_store(
        self, keys: Sequence[BlockKey], parent: BlockKey | None
    ) -> list[tuple[BlockKey, int]]:
        """Allocates STORING blocks for the keys of one chain that the pool does not
        hold.

        `keys` are consecutive blocks of one chain and `parent` is the key just before
        `keys[0]` (None at the chain root). Held keys (any state) are skipped, but for
        blocks held through a `reset` that no load or store uses any more: those are
        freed and stored anew. Room is made by evicting through the policy; the
        chain's own held blocks (and `parent`) are shielded while that happens, so a
        store never evicts the blocks it extends. When no room can be made
        (everything pinned, storing or shielded) or the policy declines a key,
        allocation stops there and returns what it got: never an error.

        Returns:
            The (key, host block id) pairs allocated, in chain order. O(1) per key.

        """
        held, policy, free = self._by_key, self.policy, self._free
        get, pop, storing = held.get, free.pop, BlockState.STORING
        prev = get(parent) if parent is not None else None
        gap_above = parent is not None and prev is None
        allocated: list[tuple[BlockKey, int]] = []
        add = allocated.append
        inserted: list[HostBlock] = []  # reported to the policy in one batch
        evicted: list[BlockKey] = []
        if self._stale:
            self._free_stale(keys, evicted)
        shielded: list[HostBlock] | None = None
        for key in keys:
            block = get(key)
            if block is None:
                if not free:
                    if inserted:
                        policy.on_insert(inserted)
                        inserted = []
                    if shielded is None:
                        shielded = self._shield(prev, keys)
                    if not self._room_for(key, keys, evicted):
                        break
                block = pop()
                # A STORING block, invisible to lookups, under `prev`.
                block.key, block.state = key, storing
                if gap_above:  # a free block is never an orphan: `_release` clears it
                    block.orphan = True
                if prev is not None:
                    attach_child(prev, block)
                held[key] = block
                inserted.append(block)
                add((key, block.block_id))
            prev = block
            gap_above = False
        if inserted:
            policy.on_insert(inserted)
        self._num_storing += len(allocated)
        if shielded:
            for block in reversed(shielded):  # ancestors last: they end the most recent
                self._unpin_block(block)
        if evicted and self._record_events:
            self._events.append(PoolEvent("evicted", tuple(evicted)))
        return allocated

    def complete_store(
        self, keys: Sequence[BlockKey], success: bool, detail: object = None
    ) -> None:
        """Ends stores: STORING -> READY (visible) on success, freed on failure.

        `detail` rides along in the "stored" event (e.g. what a KV event needs to say).

        Raises:
            ValueError: a key is not a STORING block of the pool (nothing changes then).

        """
        get = self._by_key.get
        storing = BlockState.STORING
        # Deepest first, so that each ancestor ends at least as recent as its
        # descendants and a failed chain is freed leaves first.
        done = list(map(get, reversed(keys)))
        if not done:
            return
        # One pass checks and flips; a bad key (or a key named twice) undoes the flips.
        ready = BlockState.READY
        flipped = 0
        for block in done:
            if block is None or block.state is not storing:
                for undo in done[:flipped]:
                    undo.state = storing  # type: ignore[union-attr]
                bad = keys[len(keys) - 1 - flipped]
                raise ValueError(f"cannot complete {bad!r}: it is not being stored")
            block.state = ready
            flipped += 1
        self._num_storing -= flipped
        checked = cast("list[HostBlock]", done)  # no None: checked above
        if success:
            self.policy.on_ready(checked)
            visible = checked
            if self._stale:
                # Stores begun before a `reset`: held (a write-through may still
                # read them), never visible, evicted first; neither kept nor told.
                for block in checked:
                    self._doom_if_stale(block)
                visible = [b for b in checked if b.block_id not in self._stale]
                if len(visible) < len(checked):
                    keys = [cast("BlockKey", b.key) for b in reversed(visible)]
                    detail = None  # it tells of the stale blocks too
            if self._persistence is not None and visible:
                self._persistence.record(
                    [
                        (b.block_id, b.key, None if b.parent is None else b.parent.key)
                        for b in reversed(visible)
                    ]
                )
            if self._record_events and visible:
                self._events.append(PoolEvent("stored", tuple(keys), detail))
        else:
            for block in checked:
                block.state = storing  # it never became visible
                self.policy.on_remove(block)
                self._release(block)

    # ----- maintenance -----

    def restore(self, blocks: Iterable[tuple[int, BlockKey, BlockKey | None]]) -> int:
        """Adopts blocks a persisted tier holds as READY: (host id, key, parent key),
        oldest first, so that parents come before their children. Only on a pool that
        holds nothing yet. O(num_blocks).

        Returns:
            How many blocks were adopted (ids out of range and repeated keys are
            skipped).

        """
        assert not self._by_key, "restore() is for a pool that holds nothing"
        adopted = 0
        for host_id, key, parent_key in blocks:
            if not 0 <= host_id < self.num_blocks or key in self._by_key:
                continue
            block = self._blocks[host_id]
            parent = self._by_key.get(parent_key) if parent_key is not None else None
            block.key = key
            block.orphan = parent_key is not None and parent is None
            if parent is not None:
                attach_child(parent, block)
            self._by_key[key] = block
            # One at a time, oldest first: the policy's recency follows
            # the tier's history.
            self.policy.on_insert([block])
            block.state = BlockState.READY
            self.policy.on_ready([block])
            adopted += 1
        if adopted:
            self._free = [b for b in self._blocks[::-1] if b.key is None]
        return adopted

    def reset(self) -> int:
        """Drops every READY, unpinned block (vLLM's reset_prefix_cache). O(blocks
        held).

        Returns:
            How many blocks were dropped. Pinned and STORING blocks stay, never
            visible to lookups again (what they hold was computed before the reset,
            and vLLM resets before it changes the weights); once their loads and
            stores end they go first, and a store of their key frees them.

        """
        self._stale.update(
            block.block_id for block in self._by_key.values() if not block.evictable
        )
        dropped = [block for block in self._by_key.values() if block.evictable]
        keys = []
        for block in dropped:
            keys.append(block.key)
            self.policy.on_remove(block)
            self._release(block)
        self.policy.reset()
        if keys and self._record_events:
            self._events.append(PoolEvent("evicted", tuple(keys)))
        return len(dropped)

    def take_events(self) -> list[PoolEvent]:
        """Stored and evicted keys since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Asserts every invariant of the pool (`pool_invariants.py`). O(num_blocks);
        for tests and debugging."""
        check_pool_invariants(self)

    # ----- internals -----

    def _shield(
        self, parent: HostBlock | None, keys: Sequence[BlockKey]
    ) -> list[HostBlock]:
        """Pins the chain's evictable held blocks (and `parent`) for the rest of the
        call."""
        shielded = []
        if parent is not None and parent.evictable:
            self._pin_block(parent)
            shielded.append(parent)
        held = self._by_key
        for key in keys:
            block = held.get(key)
            if block is not None and block.evictable:
                self._pin_block(block)
                shielded.append(block)
        return shielded

    def _pin_block(self, block: HostBlock) -> None:
        block.pin_count += 1
        if block.pin_count == 1:
            self._num_pinned += 1
            self.policy.on_pin(block)

    def _unpin_block(self, block: HostBlock) -> None:
        block.pin_count -= 1
        if block.pin_count == 0:
            self._num_pinned -= 1
            self.policy.on_unpin(block)
            if self._stale:
                self._doom_if_stale(block)

    def _doom_if_stale(self, block: HostBlock) -> None:
        """A block held through a reset that is evictable now goes first."""
        if block.block_id in self._stale and block.evictable:
            assert block.key is not None
            self._doomed[block.block_id] = block.key

    def _free_stale(self, keys: Sequence[BlockKey], evicted: list[BlockKey]) -> None:
        """Frees the evictable blocks held through a reset under `keys`: what
        computes KV now may store them anew."""
        get, stale = self._by_key.get, self._stale
        for key in keys:
            block = get(key)
            if block is not None and block.block_id in stale and block.evictable:
                self.policy.on_remove(block)
                self._release(block)
                evicted.append(key)

    def _room_for(
        self, key: BlockKey, keys: Sequence[BlockKey], evicted: list[BlockKey]
    ) -> bool:
        """Frees a block for `key` if the policy admits it; a declined key declines
        the rest of its chain, which the pool does not hold."""
        if not self.policy.admit(key):
            # The first `key` in `keys`: an earlier copy would be held now.
            held = self._by_key
            for later in keys[keys.index(key) + 1 :]:
                if later not in held:
                    self.policy.on_declined(later)
            return False
        return self._evict_one(evicted)

    def _spare(self, used: Sequence[HostBlock]) -> None:  # read again: not doomed
        for block in used:
            self._doomed.pop(block.block_id, None)

    def _evict_one(self, evicted: list[BlockKey]) -> bool:
        """Frees a doomed block, else the policy's next victim; False if neither."""
        victim = None
        while self._doomed and victim is None:
            block_id, key = self._doomed.popitem(last=False)
            block = self._blocks[block_id]
            if block.key == key and block.evictable:  # still that block, unused
                self.policy.on_remove(block)
                victim = block
        victim = victim or self.policy.pop_victim()
        if victim is None:
            return False
        assert victim.evictable, f"policy chose {victim}, which is not evictable"
        assert victim.owner is None, f"policy still lists its victim {victim}"
        assert victim.key is not None and self._by_key.get(victim.key) is victim
        evicted.append(victim.key)
        self._release(victim)
        return True

    def _release(self, block: HostBlock) -> None:
        """Frees a block the policy no longer lists; its children become orphans."""
        assert block.pin_count == 0 and block.owner is None
        self._doomed.pop(block.block_id, None)
        self._stale.discard(block.block_id)
        if self._persistence is not None:
            self._persistence.clear(block.block_id)
        del self._by_key[block.key]
        cut_from_chain(block, self.policy)
        block.key = None
        self._free.append(block)
