"""What identifies the weights an engine loaded, the same on every machine that holds
the same checkpoint.

A local checkpoint (a directory's top-level files, or one file such as a GGUF) is
identified exactly, by each file's name, size and the SHA-256 of its content: a
fine-tune that changes one LayerNorm, a merged LoRA that changes a few tensors, or a
re-calibrated KV-cache scale changes the identity. Where a file is a Hugging Face cache
entry (a symlink, from a snapshot or from a folder of the user's, into
`models--*/blobs/<sha256>`), the blob's name is that digest (Git LFS names a file by the
SHA-256 of its content): nothing is read. Other files are read whole, once per version
of the file (`file_digest.py`: kept on disk, keyed by the file's stat, shared by the
processes of one engine); a plain copy of a hub snapshot gets the identity the snapshot
gets. Blobs named by a Git SHA-1 (small files the hub keeps in Git, not LFS) are read:
that name hashes a `blob <size>` header with the content, not what a copy would get.
No modification times in the identity: machines of a fleet hold their own copies.
At start, a hub snapshot costs a few `readlink`s; a local copy costs, the first time,
its size at SHA-256's rate (1 GiB in 0.56 s on one core of the machine measured, files
hashed on all cores at once), then a stat per file.

A hub model is identified by the commit of the snapshot it was loaded from (the folder
name under `snapshots/` in the Hugging Face cache), else by the revision the user
pinned. A hub model with neither, or weights streamed from an object store, has nothing
that identifies them: `None`, and such an engine shares and restores nothing.

This module imports the standard library only (huggingface_hub on use).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from vllm_cpu_offload.file_digest import file_digests

# A Hugging Face cache blob named by the SHA-256 of its content (a Git LFS object id).
_LFS_BLOB_NAME = re.compile(r"[0-9a-f]{64}")
# As the kernel's limit on links followed in one path.
_MAX_LINK_HOPS = 40


def weights_identity(model_config: Any, download_dir: str | None) -> str | None:
    """What names the weights `model_config` loaded, or None where nothing does.

    `download_dir` is vLLM's `--download-dir` (the Hugging Face cache when None).
    """
    source = str(model_config.model_weights or model_config.model)
    local = Path(source)
    if local.exists():
        return "files:" + checkpoint_digest(local)
    if model_config.model_weights:
        return None  # an object store URI: its content can change under the name
    revision = model_config.revision
    commit = _snapshot_commit(source, revision, download_dir)
    if commit is not None:
        return f"hub:{source}@{commit}"
    # Only a commit names the files: a branch or a tag moves.
    return f"hub:{source}@{revision}" if _is_commit(revision) else None


def _is_commit(revision: str | None) -> bool:
    return revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def checkpoint_digest(path: Path) -> str:
    """Exact digest of a local checkpoint (a directory's top-level files, or one file):
    each file's name, size and content SHA-256."""
    files = (
        [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    )
    named = [hub_blob_digest(f) for f in files]
    unnamed = [f for f, digest in zip(files, named, strict=True) if digest is None]
    read = iter(file_digests(unnamed))
    h = hashlib.sha256()
    for f, digest in zip(files, named, strict=True):
        content = digest if digest is not None else next(read)
        h.update(f"{f.name}\0{f.stat().st_size}\0{content}\n".encode())
    return h.hexdigest()[:32]


def hub_blob_digest(f: Path) -> str | None:
    """The SHA-256 a Hugging Face cache file is named by, where `f` links (at any
    remove) to a `models--*/blobs/<sha256>` blob; None for any other file.

    The links are followed one at a time: a repository's blob may itself link to the
    cache's shared store of Xet files, named by a Xet hash, which is not the SHA-256."""
    link = f
    for _ in range(_MAX_LINK_HOPS):
        if not link.is_symlink():
            return None
        target = Path(os.path.realpath(link.parent), os.readlink(link))
        link = Path(os.path.normpath(target))
        folder = link.parent
        if folder.name == "blobs" and folder.parent.name.startswith("models--"):
            return link.name if _LFS_BLOB_NAME.fullmatch(link.name) else None
    return None


def _snapshot_commit(
    repo_id: str, revision: str | None, cache_dir: str | None
) -> str | None:
    """The commit of the local snapshot vLLM loaded `repo_id` from (no network)."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True
        )
    except (ImportError, OSError, ValueError):
        return None  # not in the cache, or not a hub id at all
    return Path(str(folder)).name
