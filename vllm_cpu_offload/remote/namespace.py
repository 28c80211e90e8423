"""Keys in the shared store: namespaced by everything a block's bytes depend on.

Engines share a block only when they would have computed the same bytes: same model,
revision and weights, dtypes, KV layout, block size and host block size, tensor and
pipeline parallel sizes (each rank stores its own shard under its own key), prefix-cache
hash and seed, vLLM release. All of that is the namespace, a digest at the front of
every key, so engines of another model or layout never see each other's blocks. The
rest of a key is vLLM's block hash, which covers the prefix's tokens and extra keys
(LoRA, multimodal inputs, `cache_salt`): tenants stay apart across engines as they do
within one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_cpu_offload.persist.fingerprint import tier_fingerprint

# Files of a model directory up to this size are digested by content (configs,
# tokenizers); larger ones (weights) by name and size: machines of a fleet hold their
# own copies, with their own modification times.
_CONTENT_DIGEST_MAX_BYTES = 1 << 20


def _portable_model_digest(model: str) -> str:
    directory = Path(model)
    if not directory.is_dir():
        return ""
    h = hashlib.sha256()
    for f in sorted(directory.iterdir()):
        if not f.is_file():
            continue
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\n".encode())
        if size <= _CONTENT_DIGEST_MAX_BYTES:
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def namespace_of(
    vllm_config: Any, groups: Sequence[object], blocks_per_host_block: int
) -> str:
    """The namespace of this engine's blocks in the shared store."""
    fields = tier_fingerprint(vllm_config, groups, 0, blocks_per_host_block)
    del fields["num_host_blocks"]
    fields["weights"] = _portable_model_digest(str(fields["model"]))
    text = json.dumps(fields, sort_keys=True)
    return "vco-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def block_key(namespace: str, group_id: int, block_hash: object) -> str:
    """The rank-independent part of a host block's key."""
    raw = block_hash if isinstance(block_hash, bytes) else repr(block_hash).encode()
    return f"{namespace}/{group_id}/{raw.hex()}"


def shard_key(key: str, rank: str) -> str:
    """The key of one rank's shard of the block `key`."""
    return f"{key}/{rank}"
