"""The exact SHA-256 of a file's content, computed once per version of the file.

A version is what `os.stat` says of the file: (absolute path, size, mtime_ns, ctime_ns,
inode, device). Its digest is kept in the process and, for files of 1 MiB and more, in
a small JSON entry under `digest_cache_dir()` (`$VLLM_CPU_OFFLOAD_CACHE/digests`, by
default `~/.cache/vllm_cpu_offload/digests`), one entry per path: a later start pays a
`stat` and a small read per file. The processes of one engine (the scheduler and each
worker) ask at the same start: the first takes a `flock` on the entry's lock file and
reads, the others wait and take its entry.

What an entry is trusted for, and why:
- the file's version: an entry is used only where every field is equal. A kernel file
  system sets ctime itself at every write (no call sets it back), so a file rewritten
  in place to the same size, even with its mtime put back, is read again; a file
  replaced by another has another inode. No digest is kept of a file whose stat
  changed while it was read, or whose mtime is under 2 s old (still being written).
- the file system: only where its stat is known to change with the content, on a
  local kernel file system (`stat_trust.py`). Elsewhere a server or an image makes
  `stat` up (FUSE, overlayfs over any layer, CIFS/SMB, 9p, NFS, squashfs, erofs), and
  where the file system cannot be told it counts as such: nothing is kept across
  starts, each process reads the file once (which also fills the page cache for the
  loader that follows).
- the folder: entries are taken only from a folder of this user that no other user may
  write, made 0700, and only entries of this user that no one else may write; every
  file is opened without following links, and written through a new temporary file
  (`safe_cache_dir.py`). Another user's or a shared world-writable folder is not used
  (a warning says so), so nobody else can plant a digest for this user's weights or
  have a write land on a file of this user's.
Where the cache cannot be used, each process reads the file at every start, and
nothing fails. A file that cannot be read raises OSError (weights_identity.py makes
that "unidentified").

Why SHA-256: it is the digest Git LFS, and so the Hugging Face hub, names a weight file
by: a digest here can be checked against the hub's listing, and a hub cache blob is
identified by its name exactly where its content is that name (`weights_identity.py`).
XXH3 would hash 15 times faster but name nothing the hub names, and the digest is paid
once per file version. Files are read in 1 MiB chunks into one buffer; hashlib and the
reads release the GIL, so the files of a sharded checkpoint are hashed on all cores at
once (`file_digests`).

Measured by `benchmarks/weights_digest.py` (best of 5, on a quiet moment of 2 shared
cores of an AMD EPYC, family 26, with SHA-NI, AVX-512; OpenSSL 3.0): SHA-256 hashes
1.9 GiB/s on one core, 3.8 on two (BLAKE2b 1.3 and 2.6; xxHash's XXH3-128, not a
dependency, 28.5 and 58); read and hashed from the page cache, 1.8 GiB/s per file,
whatever the chunk from 256 KiB to 8 MiB. A 1 GiB checkpoint costs at its first start
0.56 s in one file, 0.28 s in two (0.58 and 0.31 s with its pages evicted: this VM's
disk), and at a later start (digests kept) 0.05 ms and 0.4 ms. The first read also
fills the page cache for the loader that follows.

Imports the standard library only.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import stat
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_cpu_offload.safe_cache_dir import (
    lock_private,
    open_private_dir,
    read_private,
    replace_private,
)
from vllm_cpu_offload.stat_trust import stat_follows_content

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
        return [_digest(p) for p in paths]
    with ThreadPoolExecutor(workers, thread_name_prefix="file-digest") as pool:
        return list(pool.map(_digest, paths))


def file_digest(path: Path) -> str:
    """The SHA-256 (hex) of `path`'s content, read only where no process has kept the
    digest of this version of the file; OSError where it cannot be read."""
    return _digest(path)


def _digest(path: Path) -> str:
    version = FileVersion.of(path)
    known = _in_process.get(version)
    if known is not None:
        return known
    if version.size < CACHED_MIN_BYTES or not stat_follows_content(path):
        digest, kept = _read_and_hash(path, version)
    else:
        digest, kept = _cached_digest(path, version)
    if kept:
        _in_process[version] = digest
    return digest


def _cached_digest(path: Path, version: FileVersion) -> tuple[str, bool]:
    folder = open_private_dir(digest_cache_dir())
    if folder is None:
        return _read_and_hash(path, version)  # not private, or cannot be made
    try:
        return _digest_in(folder, _entry_stem(version), path, version)
    finally:
        os.close(folder)


def _entry_stem(version: FileVersion) -> str:
    """The name of the cache entry of `version`'s path, less its suffix."""
    return hashlib.sha256(version.path.encode()).hexdigest()[:32]


def _digest_in(
    folder: int, stem: str, path: Path, version: FileVersion
) -> tuple[str, bool]:
    entry = stem + ".json"
    kept = _read_entry(folder, entry, version)  # replaced whole: no lock to read
    if kept is not None:
        return kept, True
    try:
        # The other processes (and threads) asking for this file wait until its
        # digest is kept.
        lock = lock_private(folder, stem + ".lock")
    except OSError:
        return _read_and_hash(path, version)  # a full cache, or one without locks
    try:
        kept = _read_entry(folder, entry, version)  # kept by the one we waited for
        if kept is not None:
            return kept, True
        digest, settled = _read_and_hash(path, version)
        if settled:
            text = json.dumps(
                {"version": dataclasses.asdict(version), "sha256": digest}
            )
            replace_private(folder, entry, text.encode())
        return digest, settled
    finally:
        os.close(lock)  # releases the lock


def _read_entry(folder: int, entry: str, version: FileVersion) -> str | None:
    raw = read_private(folder, entry)
    if raw is None:
        return None
    try:
        kept = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(kept, dict) or kept.get("version") != dataclasses.asdict(version):
        return None
    digest = kept.get("sha256")
    return digest if isinstance(digest, str) else None


def _read_and_hash(path: Path, version: FileVersion) -> tuple[str, bool]:
    """The file's SHA-256, and whether it may be kept: the file was settled and did
    not change while it was read. OSError where it cannot be read (or is no regular
    file: a FIFO would block the read forever)."""
    h = hashlib.sha256()
    buffer = bytearray(min(_CHUNK_BYTES, max(version.size, 1)))
    view = memoryview(buffer)
    # O_NONBLOCK: a FIFO opens at once (and is refused), no writer awaited.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
        try:
            while n := fh.readinto(buffer):
                h.update(view[:n])
        except OSError as err:
            err.filename = str(path)  # a failed read names no file by itself
            raise
    unchanged = FileVersion.of(path) == version
    return h.hexdigest(), unchanged and version.settled()
