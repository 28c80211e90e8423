"""The tier directory of `--swap-space-path`: checks, private files, locks, small
metadata.

The tier holds users' prompts in KV form, so it is treated like them: the directory must
be owned by this user and writable by no one else; every file is created 0600 and opened
without following links. Each file is written by one process, which holds an exclusive
`flock` on it for its life: a second engine on the same directory is refused with one
line. Metadata files are small JSON documents replaced atomically (write, fsync,
rename), so a crash leaves the old or the new one, never half of each. This module uses
the standard library only.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path
from typing import Any

from vllm_cpu_offload.errors import GIB, OffloadConfigError

FILE_MODE = 0o600
DIR_MODE = 0o700
# Bumped whenever what the files mean changes: a tier of another format is rebuilt.
FORMAT_VERSION = 1
# Data files are named kv-<rank>.bin; the index is index.bin (see the modules
# that own them).
TIER_FILE_GLOB = "*.bin"


def check_tier_directory(path: str) -> None:
    """Creates `path` (0700) if missing; refuses one that others can write or another
    user owns, or that another engine uses now. Runs before the engine starts."""
    directory = Path(path)
    if not directory.exists():
        try:
            directory.mkdir(mode=DIR_MODE, parents=True)
        except OSError as e:
            raise OffloadConfigError(
                f"--swap-space-path {path} cannot be created ({e.strerror}); choose a "
                "directory you can write"
            ) from None
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise OffloadConfigError(
            f"--swap-space-path {path} is not a directory; give a directory for the "
            "tier"
        )
    if st.st_uid != os.getuid():
        raise OffloadConfigError(
            f"--swap-space-path {path} belongs to another user (uid {st.st_uid}); use "
            "a directory of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OffloadConfigError(
            f"--swap-space-path {path} is writable by other users (mode "
            f"{stat.S_IMODE(st.st_mode):o}); the tier holds prompts: run chmod go-w "
            f"{path} or use a subdirectory (e.g. {path.rstrip('/')}/vllm-kv, created "
            "0700)"
        )
    for tier_file in sorted(directory.glob(TIER_FILE_GLOB)):
        fd = os.open(tier_file, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            lock(fd, str(directory))
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def check_tier_fits(
    path: str, wanted: int, gib: float, copies: int, each: str = "worker(s)"
) -> None:
    """Refuses a tier larger than its file system can hold (what is free, plus the tier
    files already there, which are reused or replaced)."""
    fs = os.statvfs(path)
    room = fs.f_bavail * fs.f_frsize
    room += sum(f.stat().st_size for f in Path(path).glob(TIER_FILE_GLOB))
    if wanted > room:
        raise OffloadConfigError(
            f"--swap-space {gib:g} GiB x {copies} {each} exceeds the "
            f"{room / GIB:.1f} GiB that {path} can hold; lower --swap-space or free "
            "space there"
        )


def open_private(path: Path) -> int:
    """Opens (creating 0600) a tier file for reading and writing; never follows a
    link."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return fd


def lock(fd: int, directory: str) -> None:
    """Takes the exclusive lock on an open tier file, or refuses with one line."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OffloadConfigError(
            f"--swap-space-path {directory} is in use by another running engine; give "
            "each engine its own --swap-space-path"
        ) from None


def boot_id() -> str:
    """This boot of the machine: page-cache contents survive a process, not a reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def read_json(path: Path) -> dict[str, Any] | None:
    """A metadata document, or None when it is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replaces a metadata document atomically (0600)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.write(fd, json.dumps(data, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def needs_rebuild_after_reboot(meta: dict[str, Any]) -> bool:
    """A tier left open (not closed cleanly) in an earlier boot: its last writes may
    never have reached the disk."""
    return meta.get("state") != "closed" and meta.get("boot_id") != boot_id()
