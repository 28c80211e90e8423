"""One host region that every tensor-parallel rank of a pipeline stage maps: the host
tier of KV that every rank holds alike (`kv_shards.py`).

The stage's first rank (the leader) makes the region an anonymous memory file
(`memfd_create`), reserves its size (where memory cannot back it, it refuses here, not
with a bus error on first touch) and seals its size; it sends the other ranks where
its descriptor is (`RegionHandle`). Each of them opens that descriptor through
`/proc/{pid}/fd/{fd}` (the kernel allows it to processes of the leader's user only)
and checks that it is the leader's file. Every rank maps it shared and backs its
pages; then all agree, and where any rank failed, none uses it: each falls back to
memory of its own, and the tier works as with sharded KV.

The file has no name in any directory, so by construction:
- two engines never share a region, whatever their engine ids: each leader makes its
  own;
- no other user can make or open it first;
- nothing outlives the processes that map it: a rank that dies at any step leaves
  nothing behind (the memory goes with the last descriptor or mapping).

Its memory is shared memory of the host (not of `/dev/shm`'s tmpfs, so no
`--shm-size` limits it), counted once per stage by the check of host memory before
start (`flags.host_tier_copies`).

The collectives (`StageCollectives`) are made once each by every rank, in the same
order, whatever failed on the rank: a rank that skipped one would hang the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import uuid
from typing import Any, ClassVar, Protocol

import torch

from vllm_cpu_offload.errors import GIB
from vllm_cpu_offload.worker.host_buffer import MADV_POPULATE_WRITE, pin_or_refuse

logger = logging.getLogger(__name__)

# memfd_create(2): MFD_NOEXEC_SEAL (Linux 6.3+; Python 3.11 does not name it).
MFD_NOEXEC_SEAL = getattr(os, "MFD_NOEXEC_SEAL", 0x0008)
# The longest name memfd_create takes, in bytes (the name only labels the mapping in
# /proc/PID/maps).
MEMFD_NAME_MAX = 249


class StageCollectives(Protocol):
    """The collective calls of one pipeline stage's tensor-parallel ranks. Every rank
    makes each call once, in the same order."""

    def broadcast(self, payload: bytes) -> bytes:
        """The leader's `payload` on every rank (the others pass one of the same
        length, which is ignored)."""
        ...

    def agree(self, ok: bool) -> bool:
        """Whether every rank passed `ok`."""
        ...


@dataclasses.dataclass(frozen=True)
class RegionHandle:
    """Where the other ranks find the leader's region: its open descriptor `fd` in
    process `pid` on the host that booted as `boot_id`, and the identity (`dev`,
    `ino`) of the file that descriptor must lead to."""

    boot_id: bytes
    pid: int
    fd: int
    dev: int
    ino: int

    PACKED: ClassVar[struct.Struct] = struct.Struct("<16sqqQQ")

    def pack(self) -> bytes:
        return self.PACKED.pack(self.boot_id, self.pid, self.fd, self.dev, self.ino)

    @classmethod
    def unpack(cls, payload: bytes) -> RegionHandle | None:
        """The handle in `payload`, or None where the leader sent `NO_REGION`."""
        if payload == NO_REGION:
            return None
        return cls(*cls.PACKED.unpack(payload))


# What the leader sends where it has no region; what the others pass to `broadcast`.
NO_REGION = bytes(RegionHandle.PACKED.size)


class SharedRegion:
    """The host region of one pipeline stage's replicated KV.

    `name` labels the region's memory (in /proc/PID/maps); it need not be unique. The
    `leader` (the stage's first rank) makes the region and copies the stores into it;
    the others only load from it.
    """

    def __init__(
        self, name: str, collectives: StageCollectives, *, leader: bool
    ) -> None:
        self.name = name
        self._collectives = collectives
        self.leader = leader

    # The host buffer's `MappedMemory`: every rank of the stage maps it; the leader
    # alone copies stores into it.
    shared = True

    @property
    def copies_stores(self) -> bool:
        return self.leader

    def pin(self, tensor: torch.Tensor) -> bool:
        pin_or_refuse(tensor)
        return True

    def close(self) -> None:
        """The mapping lives as long as the tensor over it."""

    def map(
        self, num_slots: int, slot_bytes: int, layouts: dict[str, str] | None = None
    ) -> torch.Tensor | None:
        """The uint8 `[num_slots, slot_bytes]` tensor over the shared region, or None
        where some rank could not map it (then none uses it)."""
        size = num_slots * slot_bytes
        fd, why = _create(self.name, size) if self.leader else (None, None)
        mapping = None
        try:
            sent = self._collectives.broadcast(
                _handle_of(fd).pack() if fd is not None else NO_REGION
            )
            if not self.leader:
                fd, why = _open_leaders(RegionHandle.unpack(sent), size)
            if fd is not None:
                mapping, why = _map(fd, size)
            # The leader's descriptor stays open until every rank has opened it.
            every_rank = self._collectives.agree(mapping is not None)
        except BaseException:
            if mapping is not None:
                mapping.close()
            raise
        finally:
            if fd is not None:
                os.close(fd)
        if not every_rank or mapping is None:
            if why is not None:
                logger.warning(
                    "CPU offload: the host tier of replicated (MLA) KV cannot be one "
                    "region of %.2f GiB that the ranks of a pipeline stage share (%s); "
                    "each rank keeps its own copy, more host memory than the start-up "
                    "check counted (one copy per stage)",
                    size / GIB,
                    why,
                )
            if mapping is not None:
                mapping.close()
            return None
        return torch.frombuffer(mapping, dtype=torch.uint8).view(num_slots, slot_bytes)


def _create(name: str, size: int) -> tuple[int | None, str | None]:
    """The leader's region: a new memory file of `size` bytes, reserved, its size
    sealed; or None and why not."""
    try:
        fd = _memfd(os.fsdecode(os.fsencode(name)[:MEMFD_NAME_MAX]))
    except (OSError, ValueError) as e:
        return None, f"making it: {e}"
    try:
        os.posix_fallocate(fd, 0, size)
        # No rank can shrink it under another's mapping (a bus error there).
        fcntl.fcntl(
            fd,
            fcntl.F_ADD_SEALS,
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
        )
    except OSError as e:
        os.close(fd)
        return None, f"reserving its memory: {e.strerror}"
    return fd, None


def _memfd(name: str) -> int:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    # Data, never code: a kernel with vm.memfd_noexec=2 refuses a memory file without
    # MFD_NOEXEC_SEAL; one before Linux 6.3 does not know it (EINVAL).
    try:
        return os.memfd_create(name, flags | MFD_NOEXEC_SEAL)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return os.memfd_create(name, flags)


def _handle_of(fd: int) -> RegionHandle:
    st = os.fstat(fd)
    return RegionHandle(_boot_id(), os.getpid(), fd, st.st_dev, st.st_ino)


def _open_leaders(
    handle: RegionHandle | None, size: int
) -> tuple[int | None, str | None]:
    """The leader's region, opened through its descriptor and checked to be the file
    the leader made; or None and why not (None without a why where the leader has
    none: the leader says why)."""
    if handle is None:
        return None, None
    if handle.boot_id != _boot_id():
        return None, "the first rank of the stage runs on another host"
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        # EACCES: the leader runs as another user (or is not dumpable).
        return None, f"opening the first rank's region at {path}: {e.strerror}"
    st = os.fstat(fd)
    if (
        (st.st_dev, st.st_ino) != (handle.dev, handle.ino)
        or st.st_uid != os.geteuid()
        or not stat.S_ISREG(st.st_mode)
        or st.st_size != size
    ):
        os.close(fd)
        return None, f"{path} is not the first rank's region"
    return fd, None


def _map(fd: int, size: int) -> tuple[mmap.mmap | None, str | None]:
    """The region `fd`, mapped shared with its pages backed; or None and why not."""
    try:
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
    except (OSError, ValueError) as e:
        return None, f"mapping it: {e}"
    # An older kernel refuses: pages are then backed on first use.
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(MADV_POPULATE_WRITE)
    return mapping, None


def _boot_id() -> bytes:
    """This host's boot id: a pid means something only on the host that has it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        return bytes(16)


def region_name(vllm_config: Any, pp_rank: int) -> str:
    """The label of one engine's pipeline stage's region: vLLM's engine id, its data
    parallel rank and the stage."""
    engine_id = vllm_config.kv_transfer_config.engine_id
    dp_rank = vllm_config.parallel_config.data_parallel_rank
    return f"vllm-cpu-offload-{engine_id}-dp{dp_rank}-pp{pp_rank}"


class TensorParallelCollectives:
    """`StageCollectives` over this worker's tensor-parallel group (its CPU group);
    its first rank leads."""

    def __init__(self) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        coordinator = get_tp_group()
        self._group = coordinator.cpu_group
        self._leader = coordinator.first_rank  # a global rank, as torch wants it

    def broadcast(self, payload: bytes) -> bytes:
        tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        torch.distributed.broadcast(tensor, src=self._leader, group=self._group)
        return tensor.numpy().tobytes()

    def agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MIN, group=self._group
        )
        return bool(flag.item())
