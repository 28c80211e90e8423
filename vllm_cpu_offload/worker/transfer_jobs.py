"""The transfer engine's jobs in flight: what a step joined into one copy, what is
queued on a stream, and what a poll reports finished."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from vllm_cpu_offload.worker.copiers.base import HostWork


@dataclass
class FinishedJobs:
    """Jobs that completed (or failed) since the last poll. A job is in exactly one
    of `stores`, `loads` and `failed`.

    `broken` are jobs known to fail whose copies already queued still run: the
    blocks they load must not be trusted (this step's compute reads them), and their
    host and device blocks must not be reused before the job shows in `failed`.
    """

    stores: set[int] = field(default_factory=set)
    loads: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    broken: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.failed or self.broken)


@dataclass
class Batch:
    """The valid jobs of one call joined into one id list, on the host (pinned on CUDA)
    and, once a kernel needs them, on the device; one copier call serves them all."""

    job_ids: list[int]
    sizes: list[int]  # blocks of each job, in order
    device_ids: torch.Tensor  # on the host
    host_ids: torch.Tensor  # on the host
    on_device: tuple[torch.Tensor, torch.Tensor] | None = None
    layers_done: set[str] = field(default_factory=set)
    layer_calls: Counter[str] = field(default_factory=Counter)  # store hooks per tensor
    failed: bool = False
    # What the copier finishes on the host after the stream (`HostWork`).
    host_work: list[HostWork] = field(default_factory=list)


class StreamThenHost:
    """Done when a stream's event has fired and the host work queued behind it is
    done: the completion of a batch with `HostWork`."""

    def __init__(self, event: torch.cuda.Event, work: list[HostWork]) -> None:
        self._event = event
        self._work = work

    def query(self) -> bool:
        return self._event.query() and all(w.query() for w in self._work)

    def synchronize(self) -> None:
        self._event.synchronize()
        for w in self._work:
            w.synchronize()


@dataclass
class Pending:
    """Jobs whose copies are queued; done when `event` has fired."""

    event: torch.cuda.Event | StreamThenHost
    job_ids: list[int]
    is_store: bool
    keep_alive: list[Batch]
    failed: bool = False  # a launch of the batch raised: the jobs fail once done
