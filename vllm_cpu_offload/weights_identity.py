"""What identifies a checkpoint's files, the same on every machine that holds the
same checkpoint.

An engine's weights are named by the files its loader read (`weight_reads.py`, which
digests them with `file_digest.py` as here); this module names the files at a path:
a LoRA adapter's (`lora_identity.py`), a tensorizer file, and `--model` where no load
was observed in the process (halves built by hand: tests, the simulation).

A local checkpoint (a directory's top-level files, or one file such as a GGUF) is
identified exactly, by each file's name, size and the SHA-256 of its content: a
fine-tune that changes one LayerNorm, a merged LoRA that changes a few tensors, or a
re-calibrated KV-cache scale changes the identity. Every file is read, once per version
of the file (`file_digest.py`: kept on disk, keyed by the file's stat, shared by the
processes of one engine), Hugging Face cache entries too: a blob's name
(`models--*/blobs/<sha256>`) is the digest of what the hub sent, not of what the file
holds now, since a fine-tune saved into a folder of cache links (a snapshot's, or one
of the user's) writes through them into the blobs. Where a blob still holds what it is
named by, its digest is its name, so a plain copy of a hub snapshot gets the identity
the snapshot gets; a blob written over gets its new content's. No modification times
in the identity: machines of a fleet hold their own copies. At start a checkpoint
costs, the first time, its size at SHA-256's rate (1 GiB in 0.56 s on one core of the
machine measured, files hashed on all cores at once), then a stat per file.

A hub model is identified by the snapshot it was loaded from (in the Hugging Face
cache): its commit, the folder's name under `snapshots/`, for the reader, and the
digest of its files as above, which a fine-tune written through the snapshot's links
changes under the same commit. Without a snapshot, by the revision the user pinned. A
hub model with neither, weights streamed from an object store, or a checkpoint with a
file that cannot be read (a warning names it) has nothing that identifies it: `None`,
and such an engine shares and restores nothing.

This module imports the standard library only (huggingface_hub on use).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any

from vllm_cpu_offload.file_digest import file_digests

logger = logging.getLogger("vllm.cpu_offload")
# The file that could not be read, by the model asked for: each engine process asks up
# to three times at start, and says so once.
_unreadable: dict[str, str] = {}


def weights_identity(model_config: Any, download_dir: str | None) -> str | None:
    """What names the weights `model_config` loaded, or None where nothing does.

    `download_dir` is vLLM's `--download-dir` (the Hugging Face cache when None).
    """
    source = str(model_config.model_weights or model_config.model)
    try:
        identity = _identity_of(model_config, source, download_dir)
    except OSError as err:
        # What the tiers cannot prove makes them private to this start.
        _warn_unreadable(source, str(err.filename or source), err)
        return None
    _unreadable.pop(source, None)
    return identity


def unreadable_file(model_config: Any) -> str | None:
    """The file whose read failed when this process last asked `weights_identity` of
    `model_config` (which then answered None); None where there was none."""
    return _unreadable.get(str(model_config.model_weights or model_config.model))


def _identity_of(
    model_config: Any, source: str, download_dir: str | None
) -> str | None:
    local = Path(source)
    if local.exists():
        return "files:" + checkpoint_digest(local)
    if model_config.model_weights:
        return None  # an object store URI: its content can change under the name
    revision = model_config.revision
    snapshot = _snapshot_folder(source, revision, download_dir)
    if snapshot is not None:
        return f"hub:{source}@{snapshot.name} files:{checkpoint_digest(snapshot)}"
    # Only a commit names the files: a branch or a tag moves.
    return f"hub:{source}@{revision}" if _is_commit(revision) else None


def _is_commit(revision: str | None) -> bool:
    return revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def checkpoint_digest(path: Path) -> str:
    """Exact digest of a local checkpoint (a directory's top-level files, or one file):
    each file's name, size and content SHA-256. OSError where a file cannot be read."""
    files = (
        [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    )
    h = hashlib.sha256()
    for f, content in zip(files, file_digests(files), strict=True):
        h.update(f"{f.name}\0{f.stat().st_size}\0{content}\n".encode())
    return h.hexdigest()[:32]


def _snapshot_folder(
    repo_id: str, revision: str | None, cache_dir: str | None
) -> Path | None:
    """The local snapshot vLLM loaded `repo_id` from (no network)."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True
        )
    except (ImportError, OSError, ValueError):
        return None  # not in the cache, or not a hub id at all
    return Path(str(folder))


def _warn_unreadable(source: str, file: str, err: OSError) -> None:
    if _unreadable.get(source) == file:
        return
    _unreadable[source] = file
    logger.warning(
        "CPU offload: cannot read %s (%s), so nothing identifies the weights of %s; "
        "make it a regular file that this user (uid %d) can read",
        file,
        err.strerror or err,
        source,
        os.geteuid(),
    )
