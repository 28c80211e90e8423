"""What travels between the two halves of the connector each engine step.

Scheduler -> workers: `OffloadStepMetadata` (this step's loads and stores, and the
requests whose device blocks the scheduler holds until their stores finish). Workers ->
scheduler: `OffloadWorkerReport` (job completions), aggregated over workers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_cpu_offload.block_transfer import AsyncLoad, BlockTransfer, RemoteBlocks


@dataclass
class OffloadStepMetadata(KVConnectorMetadata):
    """One engine step's work for every worker.

    Loads complete inside the step, before each layer's attention reads them; stores are
    queued after each layer's KV is written.
    """

    loads: list[BlockTransfer] = field(default_factory=list)
    stores: list[BlockTransfer] = field(default_factory=list)
    # Finished requests whose device blocks stay allocated until their stores
    # finish; each worker reports them in `finished_sending` once it has no store
    # of theirs left.
    delayed_free_req_ids: list[str] = field(default_factory=list)
    # Requests preempted this step: their device blocks may be reused at once.
    preempted_req_ids: list[str] = field(default_factory=list)
    # With a shared store: hits that wait for blocks from it (they span steps), and
    # the store jobs whose blocks each worker writes through once its store is done.
    async_loads: list[AsyncLoad] = field(default_factory=list)
    writes: list[RemoteBlocks] = field(default_factory=list)
    # No request computes this step: a worker may wait (bounded) for its fetches.
    idle: bool = False
    # Each worker's epoch (by its token) as the scheduler had heard of it when it
    # planned this step (`OffloadWorkerReport.epochs`; a worker not in it: 0): a
    # worker whose epoch moved on since refuses the step's loads, which read KV of
    # weights it no longer has (`HostTierWorker._plan_is_current`).
    epochs_heard: dict[str, int] = field(default_factory=dict)


@dataclass
class OffloadWorkerReport(KVConnectorWorkerMetadata):
    """Jobs that finished on workers since the last report.

    `finished` and `failed` count workers per job id: a job is done once every worker
    reported it, finished or failed (its blocks may still be read or written on a
    worker until then), and it failed if any worker said so.
    """

    finished: Counter[int] = field(default_factory=Counter)
    failed: Counter[int] = field(default_factory=Counter)
    # Async loads whose fetch ended: for each fetched host block, whether it arrived
    # (on every worker that reported: an AND over workers), and the workers counted.
    fetched: dict[int, list[bool]] = field(default_factory=dict)
    fetch_reports: Counter[int] = field(default_factory=Counter)
    # Store jobs whose write-through ended (stored, refused or dropped), per worker,
    # and for each block whether the store holds it (an AND over workers).
    written: Counter[int] = field(default_factory=Counter)
    write_stored: dict[int, list[bool]] = field(default_factory=dict)
    # Why a worker's weights changed since the last report (a weight update or
    # reload ran on it; `runtime_weights.py`), any worker's; None where none did.
    # Each worker's change is in the report that follows it, whichever step it
    # came at, so every one is heard.
    weights_changed: str | None = None
    # The epoch of each worker whose epoch moved on since its last report, by the
    # worker's token (one per worker half, so a restarted worker counts anew).
    epochs: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (
            self.finished
            or self.failed
            or self.fetched
            or self.written
            or self.weights_changed
            or self.epochs
        )

    def aggregate(self, other: KVConnectorWorkerMetadata) -> OffloadWorkerReport:
        assert isinstance(other, OffloadWorkerReport)
        return OffloadWorkerReport(
            self.finished + other.finished,
            self.failed + other.failed,
            all_of(self.fetched, other.fetched),
            self.fetch_reports + other.fetch_reports,
            self.written + other.written,
            all_of(self.write_stored, other.write_stored),
            self.weights_changed or other.weights_changed,
            self.epochs | other.epochs,
        )


def all_of(
    mine: dict[int, list[bool]], theirs: dict[int, list[bool]]
) -> dict[int, list[bool]]:
    """Per job and block, whether it holds on both sides (a job one side lacks: the
    other's)."""
    both = dict(mine)
    for job_id, flags in theirs.items():
        both[job_id] = and_of(both.get(job_id), flags)
    return both


def and_of(so_far: list[bool] | None, flags: list[bool]) -> list[bool]:
    """Per block, whether it holds in `so_far` (None: nothing yet) and in `flags`."""
    if so_far is None:
        return list(flags)
    return [a and b for a, b in zip(so_far, flags, strict=True)]
