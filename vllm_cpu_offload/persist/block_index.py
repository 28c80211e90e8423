"""The persisted index of a tier: which key each host block holds, kept by the scheduler
half.

`index.bin` has one fixed-size record per host block, in a shared mapping of the file,
and `tier.json` says what the tier is: its fingerprint, its size, and the incarnation of
every worker's data file it describes. A record is written when a block's store has
finished on every worker (its bytes are complete in the data files) and cleared when the
block leaves the pool, which happens before its host block can be handed to a new store.
So a crash at any moment leaves records only for complete blocks; a record torn by the
crash fails its checksum and is dropped. Records carry a monotonic stamp (restore order,
oldest first) and the key of the block's parent in its chain (the eviction policies'
chain links).

Both calls are O(1) per block: one `struct.pack_into` into the mapping.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_cpu_offload.persist import directory as tier_dir
from vllm_cpu_offload.persist.data_file import read_incarnation
from vllm_cpu_offload.persist.fingerprint import differences
from vllm_cpu_offload.persist.tier_file import TierFile

# A record: crc32 of the rest, valid, group id, key length, parent key length, stamp,
# key, parent key.
_RECORD = struct.Struct("<IBHBBQ32s32s")
RECORD_BYTES = 96
_BODY = slice(4, _RECORD.size)
MAX_KEY_BYTES = 32
_CLEARED = bytes(8)  # crc 0 and valid 0: a record that no checksum matches
# The weights of a tier made private to its start (`BlockIndex.make_private`).
PRIVATE_WEIGHTS = "changed at run time"


@dataclass(frozen=True)
class IndexedBlock:
    """A host block the index holds: where, which key, under which parent key."""

    host_id: int
    key: tuple[int, bytes]
    parent: tuple[int, bytes] | None
    stamp: int


def _encode(stamp: int, key: Any, parent: Any) -> bytes | None:
    group_id, block_hash = key
    parent_hash = b"" if parent is None else parent[1]
    if not isinstance(block_hash, bytes) or len(block_hash) > MAX_KEY_BYTES:
        return None
    if len(parent_hash) > MAX_KEY_BYTES:
        parent_hash = b""
    packed = bytearray(
        _RECORD.pack(
            0,
            1,
            group_id,
            len(block_hash),
            len(parent_hash),
            stamp,
            block_hash,
            parent_hash,
        )
    )
    struct.pack_into("<I", packed, 0, zlib.crc32(packed[_BODY]))
    return bytes(packed)


def _decode(host_id: int, raw: bytes) -> IndexedBlock | None:
    crc, valid, group_id, key_len, parent_len, stamp, key, parent = _RECORD.unpack(
        raw[: _RECORD.size]
    )
    if not valid or crc != zlib.crc32(raw[_BODY]) or not key_len:
        return None
    parent_key = (group_id, parent[:parent_len]) if parent_len else None
    return IndexedBlock(host_id, (group_id, key[:key_len]), parent_key, stamp)


class BlockIndex:
    """The index file of the tier at `path`, for `num_blocks` host blocks."""

    def __init__(
        self,
        path: str,
        fingerprint: dict[str, Any],
        num_blocks: int,
        workers: Sequence[str],
    ) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.num_blocks = num_blocks
        self.workers = list(workers)
        self.rebuilt_because: str | None = None
        self.torn_records = 0
        self._stamp = 0
        self._file = TierFile(path, Path(path) / "index.bin", Path(path) / "tier.json")
        self._map: mmap.mmap | None = None
        # Could not be made private (`make_private`): records nothing more.
        self.unusable = False

    def open(self) -> list[IndexedBlock]:
        """Locks and validates the index; returns the blocks it holds, oldest first, or
        nothing when it had to be rebuilt (`rebuilt_because` says why)."""
        fd = self._file.open_locked()
        size = self.num_blocks * RECORD_BYTES
        incarnations = {w: read_incarnation(self.path, w) for w in self.workers}
        old = self._file.read_meta()
        why = self._why_rebuild(old, incarnations, os.fstat(fd).st_size, size)
        self._file.meta = {
            "format": tier_dir.FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "workers": incarnations,
        }
        if why is not None:
            self.rebuilt_because = why
            # Cleared before the new metadata names the workers' files: a
            # crash in between leaves a tier that the next open rebuilds
            # again, never stale records.
            os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
        self._file.write_meta("open")
        self._map = self._file.map(size)
        if why is not None:
            return []
        return self._scan()

    def _why_rebuild(
        self,
        old: dict[str, Any] | None,
        incarnations: dict[str, str | None],
        file_size: int,
        size: int,
    ) -> str | None:
        if old is None:
            return "new" if file_size == 0 else "its metadata is missing or unreadable"
        if old.get("format") != tier_dir.FORMAT_VERSION:
            return f"it has format {old.get('format')!r}"
        if old.get("fingerprint") != self.fingerprint:
            old_fp = old.get("fingerprint")
            changed = (
                differences(old_fp, self.fingerprint)
                if isinstance(old_fp, dict)
                else ""
            )
            return f"it was written by a different configuration ({changed})"
        if file_size != size:
            return f"its index is truncated ({file_size} of {size} bytes)"
        missing = [w for w, inc in incarnations.items() if inc is None]
        if missing:
            return f"the KV data of worker {missing[0]} is missing"
        if old.get("workers") != incarnations:
            return "a worker's KV data file was rebuilt"
        if tier_dir.needs_rebuild_after_reboot(old):
            return "it was not closed before the machine restarted"
        return None

    def _scan(self) -> list[IndexedBlock]:
        assert self._map is not None
        view = memoryview(self._map)
        blocks: dict[tuple[int, bytes], IndexedBlock] = {}
        for host_id in range(self.num_blocks):
            raw = view[host_id * RECORD_BYTES : (host_id + 1) * RECORD_BYTES]
            if not raw[4]:  # not valid: a cleared or never written record
                continue
            block = _decode(host_id, bytes(raw))
            if block is None:
                self.torn_records += 1
                self.clear(host_id)
                continue
            kept = blocks.get(block.key)
            if kept is not None:  # one key twice: keep the newer copy
                older = min(kept, block, key=lambda b: b.stamp)
                self.clear(older.host_id)
                block = max(kept, block, key=lambda b: b.stamp)
            blocks[block.key] = block
        view.release()
        ordered = sorted(blocks.values(), key=lambda b: b.stamp)
        self._stamp = ordered[-1].stamp + 1 if ordered else 0
        return ordered

    def record(self, entries: Sequence[tuple[int, Any, Any]]) -> None:
        """Records (host id, key, parent key) of blocks whose bytes are complete, in
        chain order (a parent before its children). O(1) per block."""
        if self.unusable:
            return
        mapping = self._map
        assert mapping is not None, "open() first"
        for host_id, key, parent in entries:
            packed = _encode(self._stamp, key, parent)
            self._stamp += 1
            if packed is None:  # a key this format cannot hold stays in memory only
                continue
            offset = host_id * RECORD_BYTES
            mapping[offset : offset + len(packed)] = packed

    def clear(self, host_id: int) -> None:
        """Forgets a host block before it can be reused. O(1)."""
        mapping = self._map
        if mapping is None and self.unusable:
            return  # the index is gone: nothing of it is restored
        assert mapping is not None, "open() first"
        offset = host_id * RECORD_BYTES
        mapping[offset : offset + len(_CLEARED)] = _CLEARED

    def make_private(self, why: str) -> None:
        """From now on the tier describes blocks of this start only (`why`: the
        weights may have changed at run time): its fingerprint names this start, so
        the next start finds it written by a different configuration and restores
        nothing. Records written before stay valid for this start's pool. Where the
        metadata cannot be written (ENOSPC, EIO) the tier becomes unusable
        (`_drop_records`) and the OSError is raised for the caller to log."""
        if str(self.fingerprint.get("weights", "")).startswith(PRIVATE_WEIGHTS):
            return
        self.fingerprint = {
            **self.fingerprint,
            "weights": f"{PRIVATE_WEIGHTS} ({why}; start {secrets.token_hex(4)})",
        }
        self._file.meta = {**self._file.meta, "fingerprint": self.fingerprint}
        try:
            self._file.write_meta("open")
        except OSError:
            self._drop_records()
            raise

    def _drop_records(self) -> None:
        """The tier could not be made private: nothing more is recorded and, where
        the file system lets the index be emptied, nothing of it is restored (the
        next start finds it truncated). Emptied without writing a byte: a full file
        system refuses writes, not a truncation. Records left (the truncation failed
        too) are of blocks stored before the change, kept valid by `clear`."""
        self.unusable = True
        fd = self._file.fd
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            return
        if self._map is not None:
            self._map.close()  # past the file's end now: never touched again
        self._map = self._file.mapping = None

    def close(self) -> None:
        """Flushes the index, marks the tier closed and releases the lock."""
        self._file.close()
