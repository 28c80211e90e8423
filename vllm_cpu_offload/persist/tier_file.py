"""One file of a tier that this process writes, with the metadata document beside it.

Opened private (`directory.open_private`), locked for as long as it is open, mapped
shared. The metadata says what the file holds and whether it was closed in order, and in
which boot it was opened: `close()` flushes the mapping first, so "closed" means every
byte is on its way to the file system.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import weakref
from pathlib import Path
from typing import Any

from vllm_cpu_offload.persist import directory as tier_dir


class TierFile:
    """`path` and its metadata document `meta_path`, in the tier directory
    `directory`."""

    def __init__(self, directory: str, path: Path, meta_path: Path) -> None:
        self.directory = directory
        self.path = path
        self.meta_path = meta_path
        self.meta: dict[str, Any] = {}  # what the file is; `write_meta` adds its state
        self.fd: int | None = None
        self.mapping: mmap.mmap | None = None
        # Closes the descriptor when the owner goes without close(). The mapping keeps a
        # duplicate of it, and with it the lock, until the mapping goes too.
        self._closer: weakref.finalize | None = None

    def open_locked(self) -> int:
        """Opens (creating 0600) and locks the file; refuses one another engine
        holds."""
        fd = tier_dir.open_private(self.path)
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        tier_dir.lock(fd, self.directory)
        return fd

    def read_meta(self) -> dict[str, Any] | None:
        return tier_dir.read_json(self.meta_path)

    def map(self, size: int) -> mmap.mmap:
        assert self.fd is not None, "open_locked() first"
        self.mapping = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        return self.mapping

    def write_meta(self, state: str) -> None:
        meta = {**self.meta, "state": state, "boot_id": tier_dir.boot_id()}
        tier_dir.write_json(self.meta_path, meta)

    def close(self) -> None:
        """Flushes the mapping, marks the file closed and releases the lock."""
        if self.fd is None:
            return
        if self.mapping is not None:
            self.mapping.flush()
            self.write_meta("closed")
        assert self._closer is not None
        fcntl.flock(self.fd, fcntl.LOCK_UN)  # the mapping's duplicate would keep it
        self._closer()
        self.fd = None
