"""One worker's share of a persisted tier: its host blocks in a memory-mapped file.

`kv-<worker>.bin` holds exactly `num_slots * slot_bytes` bytes, the host buffer's tensor
mapped shared (so every store is in the page cache the moment it is written and survives
the process); `kv-<worker>.json` says what they are: the fingerprint with this worker's
KV layout, the sizes, and an incarnation id. A file that does not match this worker's
fingerprint or sizes, or that was left open in an earlier boot, is rebuilt empty under a
new incarnation, which tells the scheduler half that the index no longer describes it. A
new file gets its space reserved up front (`posix_fallocate`): a tier the file system
cannot hold fails at start, not with SIGBUS in the middle of serving. Of third-party
modules it imports torch only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Any

import torch

from vllm_cpu_offload.errors import GIB, OffloadConfigError
from vllm_cpu_offload.persist import directory as tier_dir
from vllm_cpu_offload.persist.tier_file import TierFile
from vllm_cpu_offload.worker.host_buffer import MADV_POPULATE_WRITE, pin_mapped_file


def data_path(path: str, worker: str) -> Path:
    return Path(path) / f"kv-{worker}.bin"


def meta_path(path: str, worker: str) -> Path:
    return Path(path) / f"kv-{worker}.json"


def read_incarnation(path: str, worker: str) -> str | None:
    """The incarnation a worker's data file has now (None: no usable metadata)."""
    meta = tier_dir.read_json(meta_path(path, worker))
    value = None if meta is None else meta.get("incarnation")
    return value if isinstance(value, str) else None


class TierDataFile:
    """The mapped file of one worker; locked from `map` until `close`, or until both
    this object and the mapping are gone. The host buffer's `MappedMemory`."""

    shared = False  # one worker's file
    copies_stores = True

    def __init__(self, path: str, worker: str, fingerprint: dict[str, Any]) -> None:
        self.path = path
        self.worker = worker
        self.fingerprint = fingerprint
        self.incarnation: str | None = None
        self.rebuilt_because: str | None = None
        self._file = TierFile(path, data_path(path, worker), meta_path(path, worker))

    def map(
        self, num_slots: int, slot_bytes: int, layouts: dict[str, Any]
    ) -> torch.Tensor:
        """The uint8 `[num_slots, slot_bytes]` tensor over the file, kept or rebuilt."""
        size = num_slots * slot_bytes
        fingerprint = {**self.fingerprint, "worker": self.worker, "layouts": layouts}
        fd = self._file.open_locked()
        old = self._file.read_meta()
        why = self._why_rebuild(
            old, fingerprint, num_slots, slot_bytes, os.fstat(fd).st_size
        )
        if why is None:
            assert old is not None
            self.incarnation = str(old["incarnation"])
        else:
            self.rebuilt_because = why
            self.incarnation = secrets.token_hex(8)
            os.ftruncate(fd, 0)  # nothing of an old tier survives into the new one
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.ftruncate(fd, 0)
                raise OffloadConfigError(
                    f"--swap-space-path {self.path} cannot hold {size / GIB:.2f} GiB "
                    f"of host KV for worker {self.worker} ({e.strerror}); lower "
                    "--swap-space or free space there"
                ) from None
        self._file.meta = {
            "format": tier_dir.FORMAT_VERSION,
            "fingerprint": fingerprint,
            "num_slots": num_slots,
            "slot_bytes": slot_bytes,
            "incarnation": self.incarnation,
        }
        self._file.write_meta("open")
        mapping = self._file.map(size)
        if why is not None:
            # An older kernel refuses: pages are then backed on first use instead.
            with contextlib.suppress(OSError, ValueError):
                mapping.madvise(MADV_POPULATE_WRITE)
        return torch.frombuffer(mapping, dtype=torch.uint8).view(num_slots, slot_bytes)

    @staticmethod
    def _why_rebuild(
        old: dict[str, Any] | None,
        fingerprint: dict[str, Any],
        num_slots: int,
        slot_bytes: int,
        file_size: int,
    ) -> str | None:
        if old is None:
            return "new" if file_size == 0 else "its metadata is missing or unreadable"
        if old.get("format") != tier_dir.FORMAT_VERSION:
            return f"it has format {old.get('format')!r}"
        if old.get("fingerprint") != fingerprint:
            return "it was written by a different configuration"
        if (old.get("num_slots"), old.get("slot_bytes")) != (num_slots, slot_bytes):
            return "its size differs"
        if file_size != num_slots * slot_bytes:
            return f"it is truncated ({file_size} of {num_slots * slot_bytes} bytes)"
        if tier_dir.needs_rebuild_after_reboot(old):
            return "it was not closed before the machine restarted"
        if not isinstance(old.get("incarnation"), str):
            return "its metadata is incomplete"
        return None

    def pin(self, tensor: torch.Tensor) -> bool:
        return pin_mapped_file(tensor, self.path)

    def close(self) -> None:
        """Flushes the blocks to the file, marks it closed and releases the lock."""
        self._file.close()
