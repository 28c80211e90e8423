"""The plugin's eviction policies for vLLM's own `OffloadingConnector`, unpatched.

vLLM's CPU offloading (`CPUOffloadingManager`, vLLM 0.32 and 0.33) asks a `CachePolicy`
which chunks to evict, and takes one from outside vLLM by class name
(`eviction_policy`) and module (`cache_policy_module_path`) in
`kv_connector_extra_config`:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 17179869184,
        "eviction_policy": "PrefixAwareCachePolicy",
        "cache_policy_module_path": "vllm_cpu_offload.native_policies"}}'

The classes: `PrefixAwareCachePolicy` (the plugin's `prefix_aware`), `LRUCachePolicy`,
`ARCCachePolicy`, `LIRSCachePolicy` and `S3FIFOCachePolicy` (its `lru`, `arc`, `lirs`,
`s3fifo`; the module path, not the class name, tells them from vLLM's built-in `lru`
and `arc`). Each drives the plugin's policy over vLLM's chunks through
`EvictionPolicyAdapter` (`native_policy_adapter.py`, where the mapping of the calls
is).

What vLLM's interface lacks, and what is lost without it:
- Nothing on vLLM 0.33 for a key's parent: the adapter learns it from the request a
  call serves. The keys of one KV cache group, ordered by their end token
  (`ReqContext.get_offload_key_position`, v1/kv_offload/base.py:117), are a chain, and
  the manager shows every key a request reads or offers (`on_request_access`,
  cpu/manager.py:183; cpu/policies/base.py:96: "maintain prefix order during a
  request") before it inserts any, so a chain is linked at insert. vLLM 0.32 lacks
  that hook: it shows a request only with its store misses (`on_store_miss`, 0.32's
  cpu/manager.py:290, just before the inserts) and when it finishes, so a new block is
  linked at insert to a parent the same request stores, but to a parent it loaded or
  found already stored only when the request finishes; until then prefix_aware may
  evict that parent first, as LRU would. A chain whose parent no request showed counts
  as a root, not an orphan.
- Admission per key. `prefix_aware` refuses first-sight keys while it guards and lets
  one key in `keep_every` in while it keeps; `arc`, `lirs` and `s3fifo` refuse a key in
  a corner case. vLLM 0.33.0's manager admits by `store_threshold` alone
  (vllm/v1/kv_offload/cpu/manager.py:282-291), and a policy can refuse a store only as
  a whole, through `evict` -> None (manager.py:334-336), which the scheduler counts as
  an allocation failure and retries (offloading/scheduler.py:1988-1996): no hook asks
  it key by key. With the upstream series' [3/8], the manager asks
  `CachePolicy.admit(keys, req_context)` (how many of the new keys, head to tail, to
  store) before `evict`, and the adapter answers with the plugin policy's `admit`.
  Without it (vLLM 0.32, unpatched 0.33) `admit` is never called: every store is
  admitted, so a guarding prefix_aware evicts as a protecting one, a keeping one in
  LRU order.
- Device hits. A block the GPU cache served is heard (`on_device_hit`, when the
  request ends) only where vLLM offers it for store again, which it does for a
  request that read nothing from the host; the GPU-served prefix of a request that
  did read from the host is never shown, and its host copy ages. The hook: a
  `touch` from vLLM's scheduler for GPU prefix hits.
- A second load of a block already being loaded is not a use: vLLM tells the policy
  of a block's first pin only (`mark_non_evictable`, ref count 0 -> 1).
- The policies' settings (`protected_fraction`, `history_factor`, ...): vLLM 0.33.0
  builds a policy from `cache_capacity` alone (manager.py:81), so the defaults apply.
  With [3/8], `kv_connector_extra_config`'s `cache_policy_kwargs` reaches the policy's
  constructor, and the adapter passes it on.
"""

from __future__ import annotations

from vllm_cpu_offload.native_policy_adapter import EvictionPolicyAdapter

__all__ = [
    "ARCCachePolicy",
    "EvictionPolicyAdapter",
    "LIRSCachePolicy",
    "LRUCachePolicy",
    "PrefixAwareCachePolicy",
    "S3FIFOCachePolicy",
]


class PrefixAwareCachePolicy(EvictionPolicyAdapter):
    """The plugin's `prefix_aware`: orphans first, leaves before their ancestors, a
    protected segment for reused blocks, and its admission where vLLM asks
    `CachePolicy.admit` (see the module docstring)."""

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
