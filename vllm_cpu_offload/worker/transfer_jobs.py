"""The transfer engine's jobs in flight: what a step joined into one copy
(`join_jobs`), what is queued on a stream (`Pending`), and what a poll reports
finished (`JobsInFlight`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.worker.copiers.base import HostWork
from vllm_cpu_offload.worker.copiers.device_streams import Event

logger = logging.getLogger(__name__)


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

    def __init__(self, event: Event, work: list[HostWork]) -> None:
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

    event: Event | StreamThenHost
    job_ids: list[int]
    is_store: bool
    keep_alive: list[Batch]
    failed: bool = False  # a launch of the batch raised: the jobs fail once done


def join_jobs(
    jobs: Sequence[BlockTransfer],
    num_device_blocks: int,
    num_slots: int,
    *,
    pin: bool,
) -> tuple[Batch | None, set[int]]:
    """(the valid jobs' ids joined into one batch, or None if none is valid; the ids
    of the rejected jobs). `pin`: the batch's ids are pinned, the source of a
    non-blocking copy to a CUDA device. O(blocks)."""
    job_ids: list[int] = []
    device: list[torch.Tensor] = []
    host: list[torch.Tensor] = []
    rejected: set[int] = set()
    for job in jobs:
        d = torch.as_tensor(job.device_block_ids, dtype=torch.int64).reshape(-1)
        h = torch.as_tensor(job.host_block_ids, dtype=torch.int64).reshape(-1)
        error = _check(d, h, num_device_blocks, num_slots)
        if error:
            logger.error("transfer job %d rejected: %s", job.job_id, error)
            rejected.add(job.job_id)
            continue
        job_ids.append(job.job_id)
        device.append(d.cpu())
        host.append(h.cpu())
    if not job_ids:
        return None, rejected
    ids = torch.stack([torch.cat(device), torch.cat(host)])
    if pin:
        ids = ids.pin_memory()
    return Batch(job_ids, [t.numel() for t in device], ids[0], ids[1]), rejected


def _check(
    d: torch.Tensor, h: torch.Tensor, num_device_blocks: int, num_slots: int
) -> str | None:
    if d.numel() != h.numel():
        return f"{d.numel()} device blocks but {h.numel()} host slots"
    if d.numel() == 0:
        return None
    if int(d.min()) < 0 or int(d.max()) >= num_device_blocks:
        return f"device block id out of range [0, {num_device_blocks})"
    if int(h.min()) < 0 or int(h.max()) >= num_slots:
        return f"host slot id out of range [0, {num_slots})"
    return None


class JobsInFlight:
    """The book of the engine's jobs from their queueing to their report.

    A queued batch ends when its completion (`Pending.event`) is done, which only
    `poll` asks, without blocking: a job whose copies run late (its request aborted
    meanwhile, a held stream) is reported, and its blocks released, only then. A batch
    whose launch raised is reported failed at that point too, and `broken` until then.
    """

    def __init__(self) -> None:
        self.failed: set[int] = set()  # failed before any copy was queued
        self.broken: set[int] = set()
        self.finished = FinishedJobs()  # copied synchronously (the CPU platform)
        self._pending: list[Pending] = []

    @property
    def has_stores(self) -> bool:
        """Whether a store is still queued."""
        return any(p.is_store for p in self._pending)

    def track(self, done: Event, batch: Batch, *, is_store: bool) -> None:
        """The batch's jobs end when `done` has fired and the batch's host work is
        done."""
        event = StreamThenHost(done, batch.host_work) if batch.host_work else done
        self._pending.append(
            Pending(event, batch.job_ids, is_store, [batch], failed=batch.failed)
        )

    def poll(self) -> FinishedJobs:
        """Jobs finished or failed since the last poll. O(batches queued), never
        blocks (`Event.query`)."""
        still: list[Pending] = []
        for p in self._pending:
            try:
                done = p.event.query()
            except RuntimeError:
                logger.exception("transfer of jobs %s failed on the device", p.job_ids)
                self.failed.update(p.job_ids)
                continue
            if not done:
                still.append(p)
            elif p.failed:
                self.failed.update(p.job_ids)
            elif p.is_store:
                self.finished.stores.update(p.job_ids)
            else:
                self.finished.loads.update(p.job_ids)
        self._pending = still
        finished, self.finished = self.finished, FinishedJobs()
        finished.failed, self.failed = self.failed, set()
        finished.broken, self.broken = self.broken, set()
        finished.stores -= finished.failed
        finished.loads -= finished.failed
        return finished

    def wait_all(self) -> None:
        """Blocks until every queued copy is done; the next poll reports them."""
        for p in self._pending:
            try:
                p.event.synchronize()
            except RuntimeError:
                logger.exception("transfer of jobs %s failed on the device", p.job_ids)
