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
  start, so such blocks are neither shared nor restored across processes;
- a local folder or file on a file system whose `stat` is not known to change with the
  content (`stat_trust.py`: FUSE, overlayfs, network file systems, images, one that
  cannot be told): `unproven:`, a token of this start and the files' stat, and no
  tier stores or loads its blocks. A rewrite may keep every field of such a `stat`,
  and reading the files at each check (below) would cost their size each time, so
  nothing tells which files its KV was computed with.

What the workers run is what they last loaded from the path: at the adapter's first
use, again after vLLM's worker evicted it (`--max-cpu-loras`), and at every request or
`add_lora` that asks for `load_inplace` (`lora/worker_manager.py:296-298`). Only while
the files stay those first seen in this process is that provably their content. So the
files are checked (a `stat` per file: `file_digest.py` keeps each version's digest)
when a request is first hashed, when it looks up the tier and when its blocks are
stored, and the adapter's identity is a function of the version of its files this
process has seen, counted from 0 at the first look:
- version 0 is named by the files' digest (`files:`), the same in every process that
  first finds the same files;
- each look that finds other files than the last look found starts a new version,
  whatever it holds (the first files back included): after a change no one can tell
  which version a worker holds, so version n > 0 is `changed:`, a token of this start
  and n, this process's alone, and no two versions share a key;
- a request is hashed with the identity of the version at its first block, and keeps
  it for all its blocks;
- a request hashed under a version that is no longer the current one (`hashes_hold`)
  neither loads nor stores, in any tier: queued before an in-place reload, it runs on
  the new files with the old files' hashes (vLLM's own prefix cache, keyed by the same
  hashes, still serves it what the device holds under them, as without the tier).
Loading new files under a new adapter id, name or path shares them again.
A version's first blocks may still be computed by workers that hold the version
before it, until a request or `add_lora` reloads the files (vLLM's own prefix cache,
keyed by the same hashes, serves them alike). Files rewritten and the adapter reloaded
from them within one engine step, then rewritten back before the next check, are not
seen.

Cost: the first block of the first request naming an adapter in this process reads the
adapter's files, on the engine core's thread (SHA-256 at about 1.8 GiB/s: 55 ms per
100 MB on the machine `file_digest.py` was measured on), or stats them where a previous
start kept their digests. Each later request pays a `stat` and a `statfs` per adapter
file at its first block (every later block is an attribute read), at each lookup, and
at each step that stores a new block of it; a look that finds a file changed reads
that file again.

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

import hashlib
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_cpu_offload.file_digest import FileVersion
from vllm_cpu_offload.layers import TierLayer
from vllm_cpu_offload.stat_trust import stat_follows_content
from vllm_cpu_offload.weights_identity import checkpoint_digest

if TYPE_CHECKING:
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler

logger = logging.getLogger("vllm.cpu_offload")

# Adapters that nothing on this machine identifies are this process's alone.
_PROCESS_TOKEN = secrets.token_hex(16)
# The identity of an adapter whose files lie where stat proves nothing, less its token.
_UNPROVEN = "unproven:"
# The request attribute holding the LoRA keys its blocks were hashed with.
_HASHED_WITH = "_cpu_offload_lora_keys"


@dataclass
class _Adapter:
    """What this process knows of one (lora_int_id, lora_name, lora_path)."""

    first_seen: str  # the content identity the process first found
    identity: str  # what requests are hashed with now: the current version's
    seen: str  # the content identity the last look found
    version: int = 0  # how many times a look found other files than the one before


# By (lora_int_id, lora_name, lora_path), as vLLM's keys.
_adapters: dict[tuple[int, str, str], _Adapter] = {}


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
        keys = getattr(request, _HASHED_WITH, None)
        if keys is None:  # the request's first block: every later one takes these
            identity = _checked(lora).identity
            keys = tuple((*k, identity) for k in current(request))
            setattr(request, _HASHED_WITH, keys)
        return list(keys)

    lora_keys_with_contents._vllm_lora_keys = current  # type: ignore[attr-defined]
    # vLLM types its keys as 3-tuples; the hash and the events take any tuple.
    kv_cache_utils._gen_lora_extra_hash_keys = lora_keys_with_contents  # type: ignore[assignment]


def hashes_hold(request: Any) -> bool:
    """Whether the adapter identity `request` was hashed with still names what its
    adapter's files hold (True without LoRA; never for an adapter on a file system
    whose stat proves nothing). O(files of the adapter): a stat and a statfs each."""
    lora = getattr(request, "lora_request", None)
    keys = getattr(request, _HASHED_WITH, None)
    if not lora or not keys:
        return True
    adapter = _checked(lora)
    return adapter.identity == keys[0][-1] and not adapter.seen.startswith(_UNPROVEN)


def forget() -> None:
    """Drops the identities worked out so far (as a new process would start)."""
    _adapters.clear()


def _checked(lora: Any) -> _Adapter:
    """The adapter's state after a look at its files now: a new version where they
    differ from what the last look found."""
    key = (lora.lora_int_id, lora.lora_name, lora.lora_path)
    contents = _contents_of(lora.lora_path)
    adapter = _adapters.get(key)
    if adapter is None:
        adapter = _adapters[key] = _Adapter(contents, contents, contents)
    elif contents != adapter.seen:
        adapter.seen = contents
        adapter.version += 1
        # Which version the workers hold is unknown from now on: each version is
        # this process's alone, and none shares another's key.
        adapter.identity = f"changed:{_PROCESS_TOKEN}:{adapter.version}"
        (logger.warning if adapter.version == 1 else logger.info)(
            "CPU offload: the files of LoRA adapter %r at %s changed while the engine "
            "runs (version %d of this engine); its KV is this engine's alone from now "
            "on (load new files under a new adapter name to share them)",
            lora.lora_name,
            lora.lora_path,
            adapter.version,
        )
    return adapter


def _contents_of(lora_path: str) -> str:
    local = Path(os.path.expanduser(lora_path))
    if not (local.is_dir() or local.is_file()):
        return "process:" + _PROCESS_TOKEN
    try:
        files = [local] if local.is_file() else sorted(local.iterdir())
        versions = [FileVersion.of(f) for f in files if f.is_file()]
        if all(stat_follows_content(Path(v.path)) for v in versions):
            return "files:" + checkpoint_digest(local)
    except OSError:
        return "process:" + _PROCESS_TOKEN  # unreadable: nothing names it
    # What the stat says still starts a new version where it changes (for vLLM's
    # own prefix cache, keyed alike); that it did not change proves nothing.
    stats = hashlib.sha256(repr(versions).encode()).hexdigest()[:32]
    return f"{_UNPROVEN}{_PROCESS_TOKEN}:{stats}"


class LoraIdentityLayer(TierLayer):
    """Installs the adapter identity in the scheduler half's process, the one that
    hashes blocks, and keeps requests whose adapter changed since out of the tier."""

    def attach_scheduler(self, scheduler: HostTierScheduler) -> None:
        install()
        scheduler.hashes_hold = hashes_hold


layer = LoraIdentityLayer
