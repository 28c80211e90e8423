"""What identifies the weights an engine loaded, the same on every machine that holds
the same checkpoint.

A local checkpoint (a directory, or one file such as a GGUF) is digested from its
files: small ones (configs, tokenizers) by content; large ones (weights) by name, size
and a few sampled runs of bytes, a safetensors file also by its header (every tensor's
name, dtype, shape and offsets) and the exact bytes of its scale tensors (the KV-cache
scales `k_scale` / `v_scale` among them, which a re-calibration changes without
touching a header). That reads a few hundred KiB of a checkpoint of any size, and
catches a fine-tune of the same shape, whose tensors differ everywhere. No modification
times: machines of a fleet hold their own copies.

A hub model is identified by the commit of the snapshot it was loaded from (the folder
name under `snapshots/` in the Hugging Face cache), else by the revision the user
pinned. A hub model with neither, or weights streamed from an object store, has nothing
that identifies them: `None`, and such an engine shares and restores nothing.

This module imports the standard library only (huggingface_hub on use).
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

# Files up to this size are digested whole: configs and tokenizers.
_WHOLE_FILE_MAX_BYTES = 1 << 20
# Sampled runs of a large file: evenly spaced over its tensor data.
_SAMPLES = 16
_SAMPLE_BYTES = 4096
# safetensors refuses headers above 100 MB; so do we.
_MAX_HEADER_BYTES = 100_000_000
# Scale tensors (KV-cache and weight quantization scales) read whole up to this size.
_MAX_SCALE_BYTES = 4096

_SAFETENSORS_LENGTH = struct.Struct("<Q")


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
    return f"hub:{source}@{revision}" if revision else None


def checkpoint_digest(path: Path) -> str:
    """Digest of a local checkpoint (a directory's top-level files, or one file)."""
    files = (
        [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    )
    listing = tuple((str(f), *_stat_key(f)) for f in files)
    return _digest_files(listing)


def _stat_key(f: Path) -> tuple[int, int, int]:
    st = f.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


# Each engine process asks up to three times at start (namespace, fingerprint, notice);
# keyed by the files' stats, so a file rewritten in between is read again.
@functools.lru_cache(maxsize=8)
def _digest_files(listing: tuple[tuple[str, int, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, size, _, _ in listing:
        f = Path(name)
        h.update(f"{f.name}\0{size}\n".encode())
        with open(f, "rb") as fh:
            if size <= _WHOLE_FILE_MAX_BYTES:
                h.update(fh.read())
                continue
            data_start = 0
            if f.suffix == ".safetensors":
                data_start = _digest_safetensors_header(fh, size, h)
            _digest_samples(fh, data_start, size, h)
    return h.hexdigest()[:16]


def _digest_safetensors_header(fh: BinaryIO, size: int, h: Any) -> int:
    """Adds the header and the scale tensors' bytes; returns where tensor data starts
    (0 for a file that is not valid safetensors: then it is sampled as raw bytes)."""
    raw = fh.read(_SAFETENSORS_LENGTH.size)
    if len(raw) < _SAFETENSORS_LENGTH.size:
        return 0
    (length,) = _SAFETENSORS_LENGTH.unpack(raw)
    if length > min(_MAX_HEADER_BYTES, size - _SAFETENSORS_LENGTH.size):
        return 0
    header = fh.read(length)
    try:
        tensors = json.loads(header)
    except ValueError:
        return 0
    if not isinstance(tensors, dict):
        return 0
    h.update(header)
    data_start = _SAFETENSORS_LENGTH.size + length
    for name, info in sorted(tensors.items()):
        span = _span(info.get("data_offsets")) if isinstance(info, dict) else None
        if name.endswith("scale") and span is not None:
            begin, end = span
            if end - begin <= _MAX_SCALE_BYTES:
                fh.seek(data_start + begin)
                h.update(fh.read(end - begin))
    return data_start


def _span(offsets: Any) -> tuple[int, int] | None:
    """A tensor's `data_offsets`, where they are two ordered byte offsets."""
    if isinstance(offsets, list) and len(offsets) == 2:
        begin, end = offsets
        if isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end:
            return begin, end
    return None


def _digest_samples(fh: BinaryIO, start: int, size: int, h: Any) -> None:
    span = max(0, size - start - _SAMPLE_BYTES)
    for i in range(_SAMPLES):
        fh.seek(start + span * i // (_SAMPLES - 1))
        h.update(fh.read(_SAMPLE_BYTES))


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
