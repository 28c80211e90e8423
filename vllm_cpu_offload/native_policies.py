"""The plugin's eviction policies for vLLM's own `OffloadingConnector`, unpatched.

vLLM's CPU offloading (`CPUOffloadingManager`, vLLM 0.32 and 0.33) asks a `CachePolicy`
which chunks to evict, and takes an out-of-tree one by class name and module path from
`kv_connector_extra_config`:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 17179869184,
        "eviction_policy": "PrefixAwareCachePolicy",
        "cache_policy_module_path": "vllm_cpu_offload.native_policies"}}'

Each class below is a `CachePolicy` that drives one of the plugin's `EvictionPolicy`s
(`scheduler/policies/`) over the chunks vLLM's manager holds: `PrefixAwareCachePolicy`
(`prefix_aware`), `LRUCachePolicy`, `ARCCachePolicy`, `LIRSCachePolicy` and
`S3FIFOCachePolicy` (the plugin's `lru`, `arc`, `lirs`, `s3fifo`; the module path, not
the class name, tells them from vLLM's built-in `lru` and `arc`). vLLM's manager keeps
ref counts, chunk ids, events and the store/load lifecycle; the adapter keeps one
`HostBlock` per chunk (its state, pins and chain links) and tells the plugin's policy
of every change, as the plugin's own pool does:

vLLM calls the `CachePolicy`         -> the plugin's policy hears
- `insert(key, chunk)` (storing)     -> `on_insert([block])`, its parent linked if known
- `mark_evictable` after a store     -> `on_ready(blocks)`, batched, deepest first
- `mark_non_evictable` (a load)      -> `on_pin(block)`
- `mark_evictable` after the loads   -> `on_unpin(block)`
- `evict(n, protected)`              -> `protected` pinned, `pop_victim()` n times
- `remove(key)` (a failed store)     -> `on_remove(block)`; its children orphaned
- `touch(keys)`                      -> `on_access(ready blocks, deepest first)`
- `on_request_finished` (reused keys) -> `on_access(ready blocks, deepest first)`
- `clear()`                          -> a new policy (history and modes forgotten)
- a victim's children / its parent   -> `on_orphaned(child)` / `on_leaf(parent)`

`evict` is all or nothing, as vLLM asks: when the policy runs out of victims before `n`
(every leaf pinned, storing or protected), the blocks it chose go back to it as new
ones and `evict` returns None. A block's pins count loads in flight, so a block being
loaded is never a victim.

What vLLM's interface lacks, and what is lost without it:
- A key's parent. The adapter learns it from the request a call serves: the keys of
  one KV cache group, ordered by `ReqContext.get_offload_key_position`, are a chain
  (`native_request_chains.py`). vLLM 0.33 shows every key a request reads or offers
  (`on_request_access`) before it inserts any, so a chain is linked at insert. vLLM
  0.32 shows a request's context only with its store misses (`on_store_miss`, just
  before the inserts) and when it finishes, so a new block is linked at insert to a
  parent the same request stores, but to a parent it loaded or found already stored
  only when the request finishes: until then prefix_aware may evict that parent
  first, as LRU would. A chain whose parent no request showed (a prefix that never
  left the GPU cache) counts as a root, not an orphan. Hook upstream would add: the
  parent's key (held or not) as an argument of `CachePolicy.insert`, or a
  `ReqContext.get_offload_key_at(group, position)`.
- Admission. `prefix_aware` refuses first-sight keys while it guards and lets one key
  in `keep_every` in while it keeps; `arc`, `lirs` and `s3fifo` refuse a key in a
  corner case. vLLM never asks (`admit` is not called): every store is admitted, a
  guarding prefix_aware evicts as a protecting one, a keeping one in LRU order. vLLM's
  own `store_threshold` admission still applies. Hook: `CachePolicy.admit(keys,
  req_context) -> number of keys to store`, asked before `evict`.
- Device hits. vLLM's scheduler never calls `touch` for blocks its GPU cache served,
  so `on_device_hit` is never heard; such a block's host copy ages until a request
  reads or offers it.
- The policies' settings (`protected_fraction`, `history_factor`, ...): vLLM builds a
  policy from `cache_capacity` alone, so the defaults apply. Hook: the extra config
  passed to the policy's constructor.
- A recency touch at load time: vLLM 0.32 and 0.33 count a request's reuse when it
  finishes (`on_request_finished`); a load's end (`on_unpin`) moves the block to the
  tail of its list, as in the plugin's pool.

Cost: every call O(1) per key it names (dict look-ups and the policy's intrusive
lists); `on_ready` batches are sorted by position (O(k log k) for k blocks that
finished storing since the last call); `evict` pays O(len(protected)) to shield the
protected keys; `clear` is O(blocks held).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar, cast

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
from vllm_cpu_offload.scheduler.policies.registry import make_policy

__all__ = [
    "ARCCachePolicy",
    "EvictionPolicyAdapter",
    "LIRSCachePolicy",
    "LRUCachePolicy",
    "PrefixAwareCachePolicy",
    "S3FIFOCachePolicy",
]

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

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._policy: EvictionPolicy = make_policy(self.policy_name, cache_capacity)
        self._held: dict[OffloadKey, _HeldChunk] = {}
        # Blocks whose stores finished since the policy last heard of anything: told
        # in one batch, deepest first (vLLM completes a store's keys in set order).
        self._finished_stores: list[_HeldChunk] = []
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
        self._tell_finished_stores()
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

    @override
    def remove(self, key: OffloadKey) -> None:
        self._tell_finished_stores()
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
        self._tell_finished_stores()
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
        self._tell_finished_stores()
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
        # A store is not a reuse: only the keys the request read or found stored.
        self._access(
            key for keys in key_groups for key in reversed(keys) if key in reused_keys
        )

    @override
    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        self._tell_finished_stores()
        shielded = self._shield(protected)
        policy = self._policy
        victims: list[_HeldChunk] = []
        for _ in range(n):
            victim = policy.pop_victim()
            if victim is None:
                break
            victims.append(cast(_HeldChunk, victim))
        if len(victims) < n:
            for victim in victims:  # all or nothing: back to the policy, oldest first
                victim.state = BlockState.STORING
                policy.on_insert([victim])
                victim.state = BlockState.READY
                policy.on_ready([victim])
            self._unshield(shielded)
            return None
        evicted: list[tuple[OffloadKey, ChunkStatus]] = []
        for victim in victims:
            assert victim.evictable and victim.owner is None, f"policy chose {victim}"
            assert victim.chunk.ref_cnt == 0, f"{victim} is being loaded"
            key = cast(OffloadKey, victim.key)
            del self._held[key]
            evicted.append((key, victim.chunk))
            self._release(victim)
        self._unshield(shielded)
        return evicted

    @override
    def clear(self) -> None:
        self._policy = make_policy(self.policy_name, self.cache_capacity)
        self._held.clear()
        self._finished_stores.clear()
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
        self._tell_finished_stores()
        block.pin_count = 0
        self._policy.on_unpin(block)

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._tell_finished_stores()
        block = self._held[key]
        assert block.evictable, f"{block} is pinned or storing"
        block.pin_count = 1
        self._policy.on_pin(block)

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

    def _tell_finished_stores(self) -> None:
        finished = self._finished_stores
        if not finished:
            return
        self._finished_stores = []
        if len(finished) > 1:
            finished.reverse()  # without positions: the last completed goes first
            finished.sort(key=_position, reverse=True)
        self._policy.on_ready(finished)

    def _access(self, keys: Iterable[OffloadKey]) -> None:
        """The READY blocks of `keys` (deepest first) were used."""
        held, ready = self._held, BlockState.READY
        used = [
            block
            for key in keys
            if (block := held.get(key)) is not None and block.state is ready
        ]
        if used:
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
        for block in shielded:
            block.pin_count = 0
            self._policy.on_unpin(block)

    def _release(self, block: _HeldChunk) -> None:
        """Forgets a block the policy no longer lists; its children become orphans."""
        cut_from_chain(block, self._policy)
        block.key = None


class PrefixAwareCachePolicy(EvictionPolicyAdapter):
    """The plugin's `prefix_aware`: orphans first, leaves before their ancestors, a
    protected segment for reused blocks (admission is vLLM's, see the module
    docstring)."""

    policy_name = "prefix_aware"


class LRUCachePolicy(EvictionPolicyAdapter):
    """The plugin's `lru`: a load's end is a use, ancestors end the most recent."""

    policy_name = "lru"


class ARCCachePolicy(EvictionPolicyAdapter):
    """The plugin's `arc` over intrusive lists (O(1) victims)."""

    policy_name = "arc"


class LIRSCachePolicy(EvictionPolicyAdapter):
    """The plugin's `lirs`."""

    policy_name = "lirs"


class S3FIFOCachePolicy(EvictionPolicyAdapter):
    """The plugin's `s3fifo`."""

    policy_name = "s3fifo"
