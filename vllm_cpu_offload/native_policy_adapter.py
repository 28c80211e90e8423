"""A vLLM `CachePolicy` that one of the plugin's `EvictionPolicy`s decides for: the
adapter behind `native_policies.py`.

vLLM's `CPUOffloadingManager` keeps ref counts, chunk ids, events and the store/load
lifecycle; the adapter keeps one `HostBlock` per chunk it holds (state, pins, chain
links) and tells the plugin's policy of every change, as the plugin's own pool does:

vLLM calls the `CachePolicy`          -> the plugin's policy hears
- `insert(key, chunk)` (storing)      -> `on_insert([block])`, parent linked if known
- `mark_evictable` after a store      -> `on_ready(blocks)`, batched, deepest first
- `mark_non_evictable` (a load)       -> `on_pin(block)`, then `on_access` (batched,
                                         deepest first): a read of the host is a use
- `mark_evictable` after the loads    -> `on_unpin(block)`
- `admit(keys)` (vLLM with [3/8])     -> `admit(key)` for each key past the free
                                         chunks; a refusal `on_declined`s the rest
- `evict(n, protected)`               -> `protected` pinned, `pop_victim()` n times
- `remove(key)` (a failed store)      -> `on_remove(block)`; its children orphaned
- `touch(keys)`                       -> `on_access(ready blocks, deepest first)`
- `on_request_finished` (reused keys) -> `on_device_hit(ready blocks, deepest first)`
- `clear()`                           -> a new policy (history and modes forgotten)
- a victim's children / its parent    -> `on_orphaned(child)` / `on_leaf(parent)`

Batched calls are told before the adapter next calls the policy for anything else.
Chain links come from the request a call serves (`native_request_chains.py`): at
`insert` (vLLM 0.33's `on_request_access`, 0.32's `on_store_miss`) and, for what the
request showed only at its end, in `on_request_finished`.

`evict` is all or nothing, as vLLM asks. Each victim is cut from its chain when chosen
(its parent may then be a leaf, and the next victim); when the policy runs out before
`n` (every leaf pinned, storing or protected), the chosen blocks go back to it, linked
as they were, as new ones (the most recent), and `evict` returns None. A block's pin
stands for vLLM's loads in flight, so a block being loaded is never a victim.

Cost: every call O(1) per key it names (dict look-ups and the policy's intrusive
lists); a batch of k finished stores is sorted by position (O(k log k)); `evict` pays
O(len(protected)) to shield the protected keys; `clear` is O(blocks held).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, cast

from typing_extensions import override
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from vllm_cpu_offload.native_request_chains import RequestChains
from vllm_cpu_offload.scheduler.policies.base import (
    BlockState,
    EvictionPolicy,
    HostBlock,
    attach_child,
    cut_from_chain,
)
from vllm_cpu_offload.scheduler.policies.registry import resolve_policy

# vLLM 0.33 shows a request's first access of each key (`on_request_access`) before
# any insert; vLLM 0.32 does not have the hook.
_SEES_ACCESSES = hasattr(CachePolicy, "on_request_access")


class _HeldChunk(HostBlock):
    """A `HostBlock` for one chunk vLLM's manager holds: its `ChunkStatus`, and its
    end-token position in the request that stored it (0 when vLLM gave none)."""

    __slots__ = ("chunk", "position")

    def __init__(self, chunk: ChunkStatus) -> None:
        super().__init__(chunk.chunk_id)
        self.chunk = chunk
        self.position = 0


def _position(block: _HeldChunk) -> int:
    return block.position


# A block an `evict` chose, with what `_put_back` needs: its parent, its children and
# whether it was an orphan.
_Chosen = tuple[_HeldChunk, HostBlock | None, list[HostBlock], bool]


def _children(block: HostBlock) -> list[HostBlock]:
    children = []
    child = block.first_child
    while child is not None:
        children.append(child)
        child = child.next_sibling
    return children


class EvictionPolicyAdapter(CachePolicy):
    """A vLLM `CachePolicy` that one of the plugin's `EvictionPolicy`s decides for;
    see the module docstring.

    `policy_name` is any name the plugin's registry resolves: a built-in, an entry
    point, or a user's policy class by import path (a subclass that sets it serves
    that policy to vLLM).

    Invariants (`check_invariants`): every held key has one block, READY exactly when
    vLLM's chunk is ready, pinned exactly when its ref count is above 0; a block's
    parent is held; a victim is READY and unpinned.
    """

    policy_name: ClassVar[str]

    def __init__(self, cache_capacity: int, **settings: Any) -> None:
        super().__init__(cache_capacity)
        # The policy's own settings (`protected_fraction`, ...): vLLM with [3/8] passes
        # `kv_connector_extra_config`'s `cache_policy_kwargs`; without it, none.
        self._settings = settings
        self._policy: EvictionPolicy = self._new_policy()
        self._held: dict[OffloadKey, _HeldChunk] = {}
        # Blocks that left, reused by later inserts: a block links to itself while
        # unlisted, so one dropped would wait for the cycle collector, and a run that
        # makes them by the thousand pays for full collections of the whole heap.
        self._spare: list[_HeldChunk] = []
        # Blocks whose stores finished since the policy last heard of anything: told
        # in one batch, deepest first (vLLM completes a store's keys in set order).
        self._finished_stores: list[_HeldChunk] = []
        # Blocks whose loads began since then: a read of the host tier is a use, told
        # in one batch, deepest first (vLLM pins a load's keys head to tail).
        self._loads_started: list[_HeldChunk] = []
        self._chains = RequestChains()
        # vLLM 0.32's `insert` has no request context: the one of the store misses
        # that `prepare_store` reports just before its inserts.
        self._store_context: ReqContext | None = None

    @property
    def eviction_policy(self) -> EvictionPolicy:
        """The plugin policy that decides."""
        return self._policy

    # ----- what vLLM's manager asks -----

    @override
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        block = self._held.get(key)
        return None if block is None else block.chunk

    @override
    def insert(
        self,
        key: OffloadKey,
        chunk: ChunkStatus,
        req_context: ReqContext | None = None,
    ) -> None:
        assert key not in self._held, f"{key!r} is already held"
        assert chunk.ref_cnt <= 0, f"{key!r} is inserted while being loaded"
        self._tell_pending()
        if self._spare:
            block = self._spare.pop()
            block.block_id = chunk.chunk_id
            block.chunk = chunk
            block.position = 0
            block.state = BlockState.STORING
        else:
            block = _HeldChunk(chunk)
        block.key = key
        context = req_context if req_context is not None else self._store_context
        if context is not None:
            block.position = context.get_offload_key_position(key) or 0
            parent_key = self._chains.parent_of(key, context)
            if parent_key is not None:
                self._link(parent_key, block)
        self._held[key] = block
        self._policy.on_insert([block])
        if chunk.is_ready:
            block.state = BlockState.READY
            self._finished_stores.append(block)

    def admit(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> int:
        """vLLM with `CachePolicy.admit` (the series' [3/8]): how many of `keys` (new
        keys, head to tail) to store. As in the plugin's pool, keys that fit the free
        chunks go in unasked; each later one needs the policy's `admit`, and a
        refusal declines the rest of the chain (`on_declined`). Unpatched vLLM never
        calls it: every store is admitted. O(1) per key."""
        self._tell_pending()
        policy = self._policy
        for index in range(max(self.cache_capacity - len(self._held), 0), len(keys)):
            if not policy.admit(keys[index]):
                for later in keys[index + 1 :]:
                    policy.on_declined(later)
                return index
        return len(keys)

    @override
    def remove(self, key: OffloadKey) -> None:
        self._tell_pending()
        block = self._held.pop(key)
        self._policy.on_remove(block)
        self._release(block)

    @override
    def on_store_miss(
        self, keys: Iterable[OffloadKey], req_context: ReqContext
    ) -> None:
        self._store_context = req_context
        if not _SEES_ACCESSES:
            self._chains.observe(keys, req_context)

    def on_request_access(
        self, keys: Iterable[OffloadKey], req_context: ReqContext
    ) -> None:
        """vLLM 0.33: the request reads or offers these keys for the first time."""
        self._chains.observe(keys, req_context)

    @override
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._tell_pending()
        keys = list(keys)
        self._chains.observe(keys, req_context)
        self._access(reversed(keys))

    @override
    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        self._tell_pending()
        position_of = req_context.get_offload_key_position
        for keys in key_groups:
            # Head to tail: each key's parent is the key before it, where both have
            # positions (vLLM sorts a group by position when it knows them all).
            parent_key: OffloadKey | None = None
            parent_position = 0
            for key in keys:
                position = position_of(key)
                if position is None:
                    parent_key = None
                    continue
                block = self._held.get(key)
                if (
                    parent_key is not None
                    and position > parent_position
                    and block is not None
                    and block.parent is None
                    and not block.orphan
                ):
                    self._link(parent_key, block)
                parent_key, parent_position = key, position
        # A store is not a reuse: only the keys the request read (their loads were
        # uses already) or found stored (the GPU cache served them).
        reused = (k for keys in key_groups for k in reversed(keys) if k in reused_keys)
        self._access(reused, by_device=True)

    @override
    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        self._tell_pending()
        shielded = self._shield(protected)
        policy = self._policy
        chosen: list[_Chosen] = []
        for _ in range(n):
            victim = policy.pop_victim()
            if victim is None:
                break
            block = cast(_HeldChunk, victim)
            assert block.evictable and block.owner is None, f"policy chose {block}"
            assert block.chunk.ref_cnt == 0, f"{block} is being loaded"
            chosen.append((block, block.parent, _children(block), block.orphan))
            # Cut now, as the plugin's pool does: its parent may be a leaf now, and
            # the next victim.
            cut_from_chain(block, policy)
        if len(chosen) < n:
            self._put_back(chosen)
            self._unshield(shielded)
            return None
        evicted: list[tuple[OffloadKey, ChunkStatus]] = []
        for block, _, _, _ in chosen:
            key = cast(OffloadKey, block.key)
            del self._held[key]
            block.key = None
            self._spare.append(block)
            evicted.append((key, block.chunk))
        self._unshield(shielded)
        return evicted

    @override
    def clear(self) -> None:
        self._policy = self._new_policy()
        self._held.clear()
        self._finished_stores.clear()
        self._loads_started.clear()
        self._chains.forget_all()
        self._store_context = None

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        block = self._held[key]
        if block.state is BlockState.STORING:
            block.state = BlockState.READY
            self._finished_stores.append(block)
            return
        assert block.pin_count == 1, f"{block} was not pinned"
        self._tell_pending()
        block.pin_count = 0
        self._policy.on_unpin(block)

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._tell_pending()
        block = self._held[key]
        assert block.evictable, f"{block} is pinned or storing"
        block.pin_count = 1
        self._policy.on_pin(block)
        self._loads_started.append(block)

    # ----- for tests -----

    def check_invariants(self) -> None:
        """Asserts the invariants of the class docstring. O(blocks held)."""
        for key, block in self._held.items():
            assert block.key == key
            ready = block.state is BlockState.READY
            assert ready == block.chunk.is_ready, f"{block} disagrees with vLLM"
            assert block.pin_count == (block.chunk.ref_cnt > 0), f"{block} pins"
            parent = block.parent
            if parent is not None:
                assert self._held.get(cast(OffloadKey, parent.key)) is parent
                assert not block.orphan
            children = 0
            child = block.first_child
            while child is not None:
                assert child.parent is block
                children += 1
                child = child.next_sibling
            assert children == block.num_children

    # ----- internals -----

    def _new_policy(self) -> EvictionPolicy:
        return resolve_policy(self.policy_name)(self.cache_capacity, **self._settings)

    def _tell_pending(self) -> None:
        """Tells the policy of the stores that finished and the loads that began
        since it last heard of anything, each in one batch."""
        finished = self._finished_stores
        if finished:
            self._finished_stores = []
            if len(finished) > 1:
                finished.reverse()  # without positions: the last completed goes first
                finished.sort(key=_position, reverse=True)
            self._policy.on_ready(finished)
        loaded = self._loads_started
        if loaded:
            self._loads_started = []
            loaded.reverse()
            self._policy.on_access(loaded)

    def _access(self, keys: Iterable[OffloadKey], by_device: bool = False) -> None:
        """The READY blocks of `keys` (deepest first) were used; `by_device`: not
        read from the host (`on_device_hit`)."""
        held, ready = self._held, BlockState.READY
        used = [
            block
            for key in keys
            if (block := held.get(key)) is not None and block.state is ready
        ]
        if not used:
            return
        if by_device:
            self._policy.on_device_hit(used)
        else:
            self._policy.on_access(used)

    def _link(self, parent_key: OffloadKey, block: _HeldChunk) -> None:
        """Makes `block` a child of `parent_key`'s block, or an orphan when that key
        is not held (its chain has a gap above it)."""
        parent = self._held.get(parent_key)
        if parent is not None:
            attach_child(parent, block)
            return
        block.orphan = True
        if block.key in self._held:  # linked late: the policy lists it already
            self._policy.on_orphaned(block)

    def _put_back(self, chosen: list[_Chosen]) -> None:
        """Undoes a failed `evict`: the chosen blocks go back, linked as they were,
        as new blocks of the policy, in the order chosen. A chosen block that was an
        orphan leaves its children orphans: their chain has a gap above them anyway,
        and the policy has listed them so (`prefix_aware` chooses no other block with
        children; the chain-blind policies ignore orphans)."""
        for block, parent, children, orphan in reversed(chosen):  # parents first
            block.orphan = orphan
            if parent is not None:
                attach_child(parent, block)
            if not orphan:
                for child in children:
                    child.orphan = False
                    attach_child(block, child)
        policy = self._policy
        for block, _, _, _ in chosen:
            block.state = BlockState.STORING
            policy.on_insert([block])
            block.state = BlockState.READY
            policy.on_ready([block])

    def _shield(self, protected: set[OffloadKey]) -> list[_HeldChunk]:
        """Pins the evictable blocks of `protected` while victims are chosen."""
        shielded = []
        held = self._held
        for key in protected:
            block = held.get(key)
            if block is not None and block.evictable:
                block.pin_count = 1
                self._policy.on_pin(block)
                shielded.append(block)
        return shielded

    def _unshield(self, shielded: list[_HeldChunk]) -> None:
        # Back head to tail: `protected` is a set, whose order is its keys' salted
        # hashes, which would make the order differ in every process.
        shielded.sort(key=_position)
        for block in shielded:
            block.pin_count = 0
            self._policy.on_unpin(block)

    def _release(self, block: _HeldChunk) -> None:
        """Forgets a block the policy no longer lists; its children become orphans."""
        cut_from_chain(block, self._policy)
        block.key = None
        self._spare.append(block)
