"""One host region that every tensor-parallel rank of a pipeline stage maps: the host
tier of KV that every rank holds alike (`kv_shards.py`).

Each rank opens the same file on a tmpfs (`/dev/shm`), reserves its size (a tmpfs
that cannot hold it refuses here, not with a bus error on first touch), maps it
shared and backs its pages; the ranks then agree, and the file is unlinked, so the
memory lives exactly as long as the last mapping. Where any rank could not map it, no
rank uses it: each falls back to memory of its own, and the tier works as with
sharded KV. The name carries vLLM's engine id, which every worker of an engine has
and no other engine shares.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable
from typing import Any

import torch

from vllm_cpu_offload.errors import GIB
from vllm_cpu_offload.persist.data_file import MADV_POPULATE_WRITE

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


class SharedRegion:
    """The host region of one pipeline stage's replicated KV.

    `agree(ok)` returns whether every rank of the stage succeeded; it is a collective
    call, made once by every rank. The `leader` (the stage's first rank) copies the
    stores into the region; the others only load from it.
    """

    def __init__(
        self, path: str, agree: Callable[[bool], bool], *, leader: bool
    ) -> None:
        self.path = path
        self._agree = agree
        self.leader = leader

    def map(self, num_slots: int, slot_bytes: int) -> torch.Tensor | None:
        """The uint8 `[num_slots, slot_bytes]` tensor over the shared region, or None
        where some rank could not map it (then none uses it)."""
        size = num_slots * slot_bytes
        mapping, why = _map(self.path, size)
        every_rank = self._agree(mapping is not None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if not every_rank or mapping is None:
            if why is not None:
                logger.warning(
                    "CPU offload: the host tier of replicated (MLA) KV cannot be one "
                    "region of %.2f GiB in %s (%s); each rank keeps its own copy. "
                    "Give %s more room (docker: --shm-size) or lower --swap-space",
                    size / GIB,
                    SHM_DIR,
                    why,
                    SHM_DIR,
                )
            if mapping is not None:
                mapping.close()
            return None
        return torch.frombuffer(mapping, dtype=torch.uint8).view(num_slots, slot_bytes)


def room_bytes() -> int:
    """What the tmpfs of the shared regions can hold now, in bytes (0 where there is
    none)."""
    try:
        fs = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return fs.f_bavail * fs.f_frsize


def _map(path: str, size: int) -> tuple[mmap.mmap | None, str | None]:
    """The file at `path`, `size` bytes reserved, mapped shared with its pages backed;
    or None and why not."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        return None, e.strerror
    try:
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
    except OSError as e:
        return None, e.strerror
    finally:
        os.close(fd)
    # An older kernel refuses: pages are then backed on first use.
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(MADV_POPULATE_WRITE)
    return mapping, None


def region_path(vllm_config: Any, pp_rank: int) -> str:
    """The file of one engine's pipeline stage (see the module docstring)."""
    engine_id = vllm_config.kv_transfer_config.engine_id
    dp_rank = vllm_config.parallel_config.data_parallel_rank
    return os.path.join(
        SHM_DIR, f"vllm-cpu-offload-{engine_id}-dp{dp_rank}-pp{pp_rank}"
    )


def tensor_parallel_agreement() -> Callable[[bool], bool]:
    """`agree` over this worker's tensor-parallel group (a collective on its CPU
    group)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group().cpu_group

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MIN, group=group
        )
        return bool(flag.item())

    return agree
