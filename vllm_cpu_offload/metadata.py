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

from vllm_cpu_offload.block_transfer import BlockTransfer


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


@dataclass
class OffloadWorkerReport(KVConnectorWorkerMetadata):
    """Jobs that finished on workers since the last report.

    `finished` counts workers per job id, so the scheduler knows a job is done once
    every worker reported it; `failed` holds jobs that failed on any worker.
    """

    finished: Counter[int] = field(default_factory=Counter)
    failed: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> OffloadWorkerReport:
        assert isinstance(other, OffloadWorkerReport)
        return OffloadWorkerReport(
            self.finished + other.finished, self.failed | other.failed
        )
