"""Keys in the shared store: namespaced by everything a block's bytes depend on.

Engines share a block only when they would have computed the same bytes: the
namespace, a digest at the front of every key, is made from `kv_identity` (the weights
actually loaded, quantization, `hf_overrides` and rope, dtypes, attention backend, KV
cache layout with the byte order inside a block, block and host block size, tensor,
pipeline and context parallel sizes, prefix-cache hash and seed, vLLM release), the same
description the persistent tier's fingerprint is made from, less the tier's size. Each
rank stores its own shard under its own key. The rest of a key is vLLM's block hash,
which covers the prefix's tokens and extra keys (LoRA, multimodal inputs, `cache_salt`):
tenants stay apart across engines as they do within one. Where nothing identifies the
weights there is no namespace: such an engine shares nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from vllm_cpu_offload.kv_identity import kv_identity


def namespace_of(
    vllm_config: Any, groups: Sequence[object], blocks_per_host_block: int
) -> str | None:
    """The namespace of this engine's blocks in the shared store; None where nothing
    identifies the loaded weights (see `kv_identity.unshared_notice`)."""
    fields = kv_identity(vllm_config, groups, blocks_per_host_block)
    if fields["weights"] is None:
        return None
    text = json.dumps(fields, sort_keys=True)
    return "vco-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def block_key(namespace: str, group_id: int, block_hash: object) -> str:
    """The rank-independent part of a host block's key."""
    raw = block_hash if isinstance(block_hash, bytes) else repr(block_hash).encode()
    return f"{namespace}/{group_id}/{raw.hex()}"


def shard_key(key: str, rank: str) -> str:
    """The key of one rank's shard of the block `key`."""
    return f"{key}/{rank}"
