"""The exact SHA-256 of a file's content, computed once per version of the file.

A version is what `os.stat` says of the file: (absolute path, size, mtime_ns, ctime_ns,
inode, device). Its digest is kept in the process and, for files of 1 MiB and more, in
a small JSON entry under `digest_cache_dir()` (`$VLLM_CPU_OFFLOAD_CACHE/digests`, by
default `~/.cache/vllm_cpu_offload/digests`), one entry per path: a later start pays a
`stat` and a small read per file. An entry is trusted only where every field of the
version is equal; any write to the file changes its ctime, so a file rewritten in place
to the same size is read again. No digest is kept of a file whose stat changed while it
was read, or whose mtime is under 2 s old (a file still being written, or rewritten
within the file system's timestamp granularity). The processes of one engine (the
scheduler and each worker) ask at the same start: the first takes a `flock` on the
entry's lock file and reads, the others wait and take its entry. Where the cache cannot
be written, each process reads the file at every start, and nothing fails.

Why SHA-256: it is the digest Git LFS, and so the Hugging Face hub, names a weight file
by; a hub snapshot's weights are identified by their blob names without reading a byte
(`weights_identity.py`), and a plain copy of the same files, read here, gets the same
identity; XXH3 would hash 15 times faster but name nothing the hub names, and the
digest is paid once per file version. Files are read in 1 MiB chunks into one buffer;
hashlib and the reads release the GIL, so the files of a sharded checkpoint are hashed
on all cores at once (`file_digests`).

Measured by `benchmarks/weights_digest.py` (best of 5, on a quiet moment of 2 shared
cores of an AMD EPYC, family 26, with SHA-NI, AVX-512; OpenSSL 3.0): SHA-256 hashes
1.9 GiB/s on one core, 3.8 on two (BLAKE2b 1.3 and 2.6; xxHash's XXH3-128, not a
dependency, 28.5 and 58); read and hashed from the page cache, 1.8 GiB/s per file,
whatever the chunk from 256 KiB to 8 MiB. A 1 GiB checkpoint costs at its first start
0.56 s in one file, 0.28 s in two (0.58 and 0.31 s with its pages evicted: this VM's
disk), and at a later start (digests kept) 0.05 ms and 0.4 ms; as a hub snapshot,
0.05 ms. The first read also fills the page cache for the loader that follows.

Imports the standard library only.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Smaller files (configs, tokenizers) are hashed at every start: a millisecond at most,
# less than a kept entry's lookup would save.
CACHED_MIN_BYTES = 1 << 20
# A file modified this recently may still be written to.
SETTLE_NS = 2_000_000_000
_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class FileVersion:
    """One version of a file, as `os.stat` tells it apart from every other."""

    path: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path) -> FileVersion:
        st = path.stat()
        return cls(
            str(path.absolute()),
            st.st_size,
            st.st_mtime_ns,
            st.st_ctime_ns,
            st.st_ino,
            st.st_dev,
        )

    def settled(self) -> bool:
        return time.time_ns() - self.mtime_ns >= SETTLE_NS


def cache_root() -> Path:
    """The package's cache folder (digests here, generated models in `testing/`):
    `VLLM_CPU_OFFLOAD_CACHE` where it is set."""
    env = os.environ.get("VLLM_CPU_OFFLOAD_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm_cpu_offload"


def digest_cache_dir() -> Path:
    """Where digests are kept."""
    return cache_root() / "digests"


# Each engine process asks up to three times at start (namespace, fingerprint, notice).
_in_process: dict[FileVersion, str] = {}


def forget_in_process() -> None:
    """Drops the digests this process knows (as a new process would start)."""
    _in_process.clear()


def file_digests(paths: Sequence[Path]) -> list[str]:
    """`file_digest` of each path, the files read on all cores at once."""
    workers = min(len(paths), len(os.sched_getaffinity(0)))
    if workers <= 1:
        return [file_digest(p) for p in paths]
    with ThreadPoolExecutor(workers, thread_name_prefix="file-digest") as pool:
        return list(pool.map(file_digest, paths))


def file_digest(path: Path) -> str:
    """The SHA-256 (hex) of `path`'s content, read only where no process has kept the
    digest of this version of the file."""
    version = FileVersion.of(path)
    known = _in_process.get(version)
    if known is not None:
        return known
    if version.size < CACHED_MIN_BYTES:
        digest, kept = _read_and_hash(path, version)
    else:
        digest, kept = _cached_digest(path, version)
    if kept:
        _in_process[version] = digest
    return digest


def _cached_digest(path: Path, version: FileVersion) -> tuple[str, bool]:
    entry = digest_cache_dir() / (
        hashlib.sha256(version.path.encode()).hexdigest()[:32] + ".json"
    )
    kept = _read_entry(entry, version)  # entries are replaced whole: no lock to read
    if kept is not None:
        return kept, True
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock(entry.with_suffix(".lock"))
    except OSError:
        return _read_and_hash(path, version)  # a read-only or full cache directory
    try:
        kept = _read_entry(entry, version)  # kept by the process we waited for
        if kept is not None:
            return kept, True
        digest, settled = _read_and_hash(path, version)
        if settled:
            _write_entry(entry, version, digest)
        return digest, settled
    finally:
        os.close(lock)  # releases the lock


def _lock(lock_path: Path) -> int:
    """An open descriptor of `lock_path` holding its exclusive lock: the other
    processes (and threads) asking for this file wait until its digest is kept."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)  # a file system without locks
        raise
    return fd


def _read_entry(entry: Path, version: FileVersion) -> str | None:
    try:
        kept = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("version") != dataclasses.asdict(version):
        return None
    digest = kept.get("sha256")
    return digest if isinstance(digest, str) else None


def _write_entry(entry: Path, version: FileVersion, digest: str) -> None:
    text = json.dumps({"version": dataclasses.asdict(version), "sha256": digest})
    partial = entry.with_suffix(f".{os.getpid()}.tmp")
    try:
        partial.write_text(text)
        os.replace(partial, entry)  # readers never see half an entry
    except OSError:
        partial.unlink(missing_ok=True)


def _read_and_hash(path: Path, version: FileVersion) -> tuple[str, bool]:
    """The file's SHA-256, and whether it may be kept: the file was settled and did
    not change while it was read."""
    h = hashlib.sha256()
    buffer = bytearray(min(_CHUNK_BYTES, max(version.size, 1)))
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            h.update(view[:n])
    unchanged = FileVersion.of(path) == version
    return h.hexdigest(), unchanged and version.settled()
