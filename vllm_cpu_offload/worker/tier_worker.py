"""The worker half of the connector: runs each step's loads and stores, reports jobs
back.

One instance per worker. It owns the host buffer (through the transfer engine), and
keeps the book of which finished requests still wait for their stores, so that their
device blocks are freed only after the copies read them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence

import torch

from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.metadata import OffloadStepMetadata, OffloadWorkerReport
from vllm_cpu_offload.metrics import OffloadStats
from vllm_cpu_offload.persist.data_file import TierDataFile
from vllm_cpu_offload.worker.copiers.select import Candidate
from vllm_cpu_offload.worker.fault_injection import FaultInjector
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.transfer_engine import FinishedJobs, TransferEngine

logger = logging.getLogger(__name__)


class HostTierWorker:
    """Drives the transfer engine through one engine step at a time.

    `copier_candidates` replaces the platform's copier choice (tests: the start-up
    check of CUDA's copiers, run on any platform; `copiers/select.py`).
    """

    def __init__(
        self,
        num_host_blocks: int,
        num_device_blocks: int,
        *,
        data_file: TierDataFile | None = None,
        copy_backend: str = "auto",
        fence_stores: bool = False,
        copier_candidates: Sequence[Candidate] | None = None,
    ) -> None:
        self.num_host_blocks = num_host_blocks
        self.fence_stores = fence_stores
        self.copy_backend = copy_backend
        self.copier_candidates = copier_candidates
        self.num_device_blocks = num_device_blocks
        # With --swap-space-path the host buffer is this file, mapped;
        # else anonymous memory.
        self.data_file = data_file
        self.engine: TransferEngine | None = None
        self._step_stores: list[BlockTransfer] = []
        self._store_req: dict[int, str] = {}  # store job in flight -> request
        # load in flight -> its device block ids
        self._load_device_blocks: dict[int, Sequence[int]] = {}
        # request -> store jobs in flight
        self._stores_in_flight: Counter[str] = Counter()
        self._awaiting_free: set[str] = set()  # finished requests the scheduler holds
        self._report = OffloadWorkerReport()
        self._load_errors: set[int] = set()
        # Seconds this worker's steps spent in transfer calls since the last stats
        # report: the copies themselves on the CPU platform, queueing and waits on CUDA.
        self._load_seconds = 0.0
        self._store_seconds = 0.0
        self._faults = FaultInjector.from_env()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        host = HostBuffer.for_kv_caches(
            kv_caches,
            self.num_host_blocks,
            num_blocks=self.num_device_blocks,
            data_file=self.data_file,
        )
        self.engine = TransferEngine(
            kv_caches,
            host,
            backend=self.copy_backend,
            candidates=self.copier_candidates,
            fence_stores=self.fence_stores,
        )

    def _engine(self) -> TransferEngine:
        assert self.engine is not None, "register_kv_caches was not called"
        return self.engine

    def handle_preemptions(self, metadata: OffloadStepMetadata) -> None:
        """Preempted requests' device blocks can be reused this step: drain their
        stores."""
        if any(self._stores_in_flight[r] for r in metadata.preempted_req_ids):
            self._engine().wait_all()
            self._collect(self._engine().poll_finished())

    def begin_step(self, metadata: OffloadStepMetadata) -> None:
        """Registers the step's stores and delayed frees; called before the forward."""
        if self.engine is not None:
            self.engine.begin_step()
        self._awaiting_free.update(metadata.delayed_free_req_ids)
        for transfer in metadata.stores:
            self._store_req[transfer.job_id] = transfer.req_id
            self._stores_in_flight[transfer.req_id] += 1
        self._step_stores = self._without_injected_faults(metadata.stores)

    def start_loads(self, metadata: OffloadStepMetadata) -> None:
        """Queues the step's loads; vLLM calls this before the forward when there are
        any."""
        if not metadata.loads:
            return
        for t in metadata.loads:
            self._load_device_blocks[t.job_id] = t.device_block_ids
        loads = self._without_injected_faults(metadata.loads)
        start = time.perf_counter()
        self._engine().start_loads(loads)
        self._load_seconds += time.perf_counter() - start

    def _without_injected_faults(
        self, transfers: list[BlockTransfer]
    ) -> list[BlockTransfer]:
        """The transfers to run; the test-only injector fails the others, uncopied."""
        if self._faults is None:
            return transfers
        kept: list[BlockTransfer] = []
        failed: set[int] = set()
        for t in transfers:
            if self._faults.fails():
                failed.add(t.job_id)
            else:
                kept.append(t)
        if failed:
            self._collect(FinishedJobs(failed=failed))
        return kept

    def wait_for_layer_load(self, layer_name: str) -> None:
        start = time.perf_counter()
        self._engine().wait_for_layer_load(layer_name)
        self._load_seconds += time.perf_counter() - start

    def save_layer(self, layer_name: str) -> None:
        if self._step_stores:
            start = time.perf_counter()
            self._engine().store_layer(layer_name, self._step_stores)
            self._store_seconds += time.perf_counter() - start

    def finish_step(self) -> None:
        if self.engine is None:
            return
        start = time.perf_counter()
        self.engine.finish_step()  # the CPU platform copies the step's stores here
        self._store_seconds += time.perf_counter() - start
        self._step_stores = []

    def get_finished(self) -> set[str] | None:
        """Finished requests held by the scheduler whose stores are all done."""
        if self.engine is None:
            return None
        self._collect(self.engine.poll_finished())
        done = {r for r in self._awaiting_free if not self._stores_in_flight[r]}
        self._awaiting_free -= done
        return done or None

    def _collect(self, finished: FinishedJobs) -> None:
        for job_id in finished.failed:
            self._report.failed.add(job_id)
            if job_id in self._load_device_blocks:
                # vLLM recomputes the tokens of these blocks: a miss, never
                # a wrong token.
                self._load_errors.update(self._load_device_blocks.pop(job_id))
            self._store_done(job_id)
        for job_id in (*finished.stores, *finished.loads):
            self._report.finished[job_id] += 1
            self._load_device_blocks.pop(job_id, None)
            self._store_done(job_id)

    def _store_done(self, job_id: int) -> None:
        req_id = self._store_req.pop(job_id, None)
        if req_id is not None:
            self._stores_in_flight[req_id] -= 1
            if not self._stores_in_flight[req_id]:
                del self._stores_in_flight[req_id]

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> OffloadWorkerReport | None:
        report = self._report
        if not report.finished and not report.failed:
            return None
        self._report = OffloadWorkerReport()
        return report

    def take_stats(self) -> OffloadStats | None:
        if not self._load_seconds and not self._store_seconds:
            return None
        stats = OffloadStats(
            data={
                "load_seconds": self._load_seconds,
                "store_seconds": self._store_seconds,
            }
        )
        self._load_seconds = self._store_seconds = 0.0
        return stats

    def drain(self) -> None:
        """Waits for every copy in flight; their results are reported as usual."""
        if self.engine is not None:
            self.engine.wait_all()

    def shutdown(self) -> None:
        self.drain()
        if self.data_file is not None:
            self.data_file.close()
