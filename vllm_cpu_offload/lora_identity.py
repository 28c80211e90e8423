"""A LoRA adapter's contents in vLLM's block hashes, so that blocks computed with one
adapter are never taken for another's by the persistent or the shared tier.

vLLM keys a LoRA request's blocks by `("lora", lora_name, lora_path)`
(`kv_cache_utils._gen_lora_extra_hash_keys`), not by what the path holds. That is
enough within one process, but hosts of a fleet with other adapter files at the same
path, or an adapter retrained in place across a restart of the file tier, would share
keys and so read KV that another adapter computed. `install()` replaces that function
with one that appends the adapter's content identity to vLLM's tuple:
- a local folder or file: `files:` and `weights_identity.checkpoint_digest` of it, the
  exact SHA-256 of each top-level file (kept on disk per version of the file, so a
  later start pays a stat per file);
- anything else (a hub id, which vLLM resolves in the workers): a token of this process
  start, so such blocks are neither shared nor restored across processes.

Cost: the first block of the first request naming an adapter in this process reads the
adapter's files, on the engine core's thread (SHA-256 at about 1.8 GiB/s: 55 ms per
100 MB on the machine `file_digest.py` was measured on), or stats them where a previous
start kept their digests. Every later block is one dict lookup on (lora_int_id,
lora_name, lora_path), which hold all that vLLM's keys are made of: 140 ns a block
against vLLM's 75 ns, and 1.9 us against 1.8 us for a whole 16-token block hash with
sha256 (measured on that machine). The identity is remembered for the life of the
process, as vLLM remembers a loaded adapter by its id, and worked out again for a
request that reloads its adapter in place (`load_inplace`): blocks computed with the
reloaded files are not keyed as the old files' (which engines that still hold those
would read from the shared store).

KV events carry the block hashes made with it (their extra keys stay vLLM's bare LoRA
name). An external router that computes block hashes for LoRA requests itself, from
vLLM's recipe, sees other hashes than this engine's for them; requests without LoRA
are hashed as before.

Installed by the scheduler half of the connector (as a layer, `layers.py`), in the
engine core, the process that hashes blocks: vLLM's `generate_block_hash_extra_keys`
looks the function up as a module global at each call. Without the connector nothing
is replaced.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_cpu_offload.layers import TierLayer
from vllm_cpu_offload.weights_identity import checkpoint_digest

if TYPE_CHECKING:
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler

# Adapters that nothing on this machine identifies are this process's alone.
_PROCESS_TOKEN = secrets.token_hex(16)

# vLLM's LoRA keys with the adapter's identity, by (lora_int_id, lora_name, lora_path).
_keys: dict[tuple[int, str, str], tuple[tuple[str, ...], ...]] = {}


def install() -> None:
    """Makes vLLM's block hashes of LoRA requests depend on the adapter's contents;
    a second call changes nothing."""
    from vllm.v1.core import kv_cache_utils

    current = kv_cache_utils._gen_lora_extra_hash_keys
    if getattr(current, "_vllm_lora_keys", None) is not None:
        return

    def lora_keys_with_contents(request: Any) -> list[tuple[str, ...]]:
        lora = request.lora_request
        if not lora:
            return []
        key = (lora.lora_int_id, lora.lora_name, lora.lora_path)
        keys = _keys.get(key)
        # A request that reloads its adapter in place may bring other files: read
        # again, and the requests after it take what it found.
        if keys is None or lora.load_inplace:
            identity = _contents_of(lora.lora_path)
            keys = _keys[key] = tuple((*k, identity) for k in current(request))
        return list(keys)

    lora_keys_with_contents._vllm_lora_keys = current  # type: ignore[attr-defined]
    # vLLM types its keys as 3-tuples; the hash and the events take any tuple.
    kv_cache_utils._gen_lora_extra_hash_keys = lora_keys_with_contents  # type: ignore[assignment]


def forget() -> None:
    """Drops the identities worked out so far (as a new process would start)."""
    _keys.clear()


def _contents_of(lora_path: str) -> str:
    local = Path(os.path.expanduser(lora_path))
    if local.is_dir() or local.is_file():
        return "files:" + checkpoint_digest(local)
    return "process:" + _PROCESS_TOKEN


class LoraIdentityLayer(TierLayer):
    """Installs the adapter identity in the scheduler half's process, the one that
    hashes blocks."""

    def attach_scheduler(self, scheduler: HostTierScheduler) -> None:
        install()


layer = LoraIdentityLayer
