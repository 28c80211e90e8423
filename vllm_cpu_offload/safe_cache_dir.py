"""A folder of small files that only this user can have written: the digest cache's
(`file_digest.py`), whose entries say what a weight file holds, and so must never be
another user's word.

`open_private_dir` creates the folder with mode 0700 and opens it with O_NOFOLLOW; it
answers None (go without the cache) unless the folder is this user's (the effective
uid's) and neither its group nor others may write in it. Every later call names a file
relative to that descriptor, so a folder renamed or replaced after the check is never
used, and:
- a file is read only where it is a regular file of this user that no other user may
  write, opened with O_NOFOLLOW;
- a file is written whole into a temporary file made with O_CREAT|O_EXCL|O_NOFOLLOW,
  mode 0600, then renamed over its name (a rename replaces a link, never writes
  through one);
- a lock file is opened with O_NOFOLLOW.
A link planted under any of these names makes the open fail, and the caller goes
without the cache: a planted file can cost a read, never a wrong digest or a write
outside the folder.

Imports the standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from pathlib import Path

logger = logging.getLogger("vllm.cpu_offload")

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_NO_LINK = os.O_NOFOLLOW | os.O_CLOEXEC
# Folders refused in this process: said once each.
_refused: set[str] = set()


def open_private_dir(path: Path) -> int | None:
    """A descriptor of the folder `path` (made 0700 where it is missing), or None where
    it cannot be made or opened, or where another user owns it or may write in it."""
    try:
        fd = _open_dir(path)
    except FileNotFoundError:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)
            fd = _open_dir(path)
        except OSError:
            return None
    except OSError:
        return None  # a link, or not a folder
    st = os.fstat(fd)
    if _is_private(st):
        return fd
    os.close(fd)
    if str(path) not in _refused:
        _refused.add(str(path))
        logger.warning(
            "CPU offload: the digest cache %s is not private (owner uid %d, mode %o), "
            "so it is not used and weight files are read at every start; set "
            "VLLM_CPU_OFFLOAD_CACHE to a folder of this user (uid %d) that only it "
            "may write",
            path,
            st.st_uid,
            stat.S_IMODE(st.st_mode),
            os.geteuid(),
        )
    return None


def read_private(folder: int, name: str) -> bytes | None:
    """The content of `name` in `folder`; None where it is missing, a link, not a
    regular file, another user's or writable by another user."""
    try:
        fd = os.open(name, os.O_RDONLY | _NO_LINK, dir_fd=folder)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and _is_private(st)):
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def replace_private(folder: int, name: str, data: bytes) -> None:
    """Makes `name` in `folder` hold `data` (mode 0600); readers see the old content
    or the new, never half of it. Where it cannot, nothing changes."""
    partial = f"{name.rsplit('.', 1)[0]}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_LINK
    try:
        try:
            fd = os.open(partial, flags, 0o600, dir_fd=folder)
        except FileExistsError:
            # Left by a process of the same pid that died while writing (the folder
            # is this user's): unlink removes a link itself, not what it names.
            os.unlink(partial, dir_fd=folder)
            fd = os.open(partial, flags, 0o600, dir_fd=folder)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb", closefd=False) as fh:
            fh.write(data)
        os.replace(partial, name, src_dir_fd=folder, dst_dir_fd=folder)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(partial, dir_fd=folder)
    finally:
        os.close(fd)


def lock_private(folder: int, name: str) -> int:
    """An open descriptor of the lock file `name` in `folder` holding its exclusive
    `flock` (closing it releases the lock); OSError where the file is a link or the
    file system has no locks."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | _NO_LINK, 0o600, dir_fd=folder)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        raise
    return fd


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NO_LINK)


def _is_private(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & _OTHERS_WRITE
