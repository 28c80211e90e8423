"""What every block copier is: the `BlockCopier` protocol and its capabilities.

A copier moves pairs of (device block, host block) between vLLM's KV caches and a
`HostBuffer`, for some layers or all of them, on the current stream. The transfer engine
drives copiers through this protocol only; which copier runs is `select.py`'s choice.

Capabilities are class attributes a copier may set:
- `ids_on_host`: it reads block ids from host tensors (else from tensors on the caches'
  device, moved there once per batch by the engine);
- `whole_block_loads`: a load of every layer is one call, so the engine queues it once
  and each layer's wait covers the whole load.

A copier that finishes part of a copy on the host, after the stream has passed it (the
bounce copier's stores), returns that part from `copy` as `HostWork`: the copy is done
once the stream has passed the launch and the host work is done.

Imports torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class HostWork(Protocol):
    """The host's part of a copy, running off the calling thread."""

    def query(self) -> bool:
        """Whether it is done; raises RuntimeError if it failed. Never blocks."""
        ...

    def synchronize(self) -> None:
        """Blocks until it is done; raises RuntimeError if it failed."""
        ...


class BlockCopier(Protocol):
    """Copies `device_ids[i]` <-> `host_ids[i]` for `layers` (all when None).

    Block ids come as int64 tensors on the caches' device, or on the host where the
    copier has a true `ids_on_host` attribute. Ids are validated by the caller. A copy
    that cannot be done raises; the engine fails the jobs of that call.
    """

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> HostWork | None: ...


def finish_on_host(work: HostWork | None) -> None:
    """Waits for a copy's host work, if any: synchronous callers (the CPU path, the
    start-up check, benchmarks) see the copy whole."""
    if work is not None:
        work.synchronize()


def ids_on_host(copier: BlockCopier) -> bool:
    """Whether `copier` reads its block ids from host tensors."""
    return bool(getattr(copier, "ids_on_host", False))


def loads_whole_blocks(copier: BlockCopier) -> bool:
    """Whether `copier` loads every layer of a block in one call."""
    return bool(getattr(copier, "whole_block_loads", False))
