"""The worker half of the connector: runs each step's loads and stores, reports jobs
back.

One instance per worker. It owns the host buffer (through the transfer engine) and its
seam to a shared store (`shared`, `tier_seams.py`: a null object without one),
and keeps the book of which finished requests still wait for their stores, so that
their device blocks are freed only after the copies read them.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from vllm_cpu_offload.block_transfer import AsyncLoad, BlockTransfer
from vllm_cpu_offload.metadata import OffloadStepMetadata, OffloadWorkerReport
from vllm_cpu_offload.worker.copiers.select import Candidate
from vllm_cpu_offload.worker.host_buffer import HostBuffer, MappedMemory
from vllm_cpu_offload.worker.tier_seams import (
    FetchedLoad,
    NoSharedTierWorker,
    SharedTierDone,
)
from vllm_cpu_offload.worker.transfer_engine import FinishedJobs, TransferEngine

logger = logging.getLogger(__name__)

# Opens the worker's seam to a shared store once its host buffer exists: a layer's
# (`worker/shared_tier.py`), given the buffer and the KV caches it was made for.
SharedTierOpener = Callable[[HostBuffer, dict[str, torch.Tensor]], NoSharedTierWorker]


class TransferFaults(Protocol):
    """What a test puts in `HostTierWorker.faults` to fail transfers on purpose
    (`tests/fault_injection.py`): the fault path of a real engine, without a broken
    copy."""

    def fails(self) -> bool:
        """Whether the next transfer job fails, uncopied."""
        ...


class HostTierWorker:
    """Drives the transfer engine through one engine step at a time.

    `num_slots`: the host buffer's slots, each holding one device block;
    `blocks_per_host_block` of them make one of the scheduler's host blocks.
    `copier_candidates` replaces the platform's copier choice (tests: the start-up
    check of CUDA's copiers, run on any platform; `copiers/select.py`).
    """

    def __init__(
        self,
        num_slots: int,
        num_device_blocks: int,
        *,
        memory: MappedMemory | None = None,
        copy_backend: str = "auto",
        fence_stores: bool = False,
        copier_candidates: Sequence[Candidate] | None = None,
        blocks_per_host_block: int = 1,
    ) -> None:
        self.num_slots = num_slots
        self.blocks_per_host_block = blocks_per_host_block
        self.fence_stores = fence_stores
        self.copy_backend = copy_backend
        self.copier_candidates = copier_candidates
        self.num_device_blocks = num_device_blocks
        # Where a layer puts the host buffer (a file of the tier, a region every rank
        # of a stage maps); None: private memory of this process.
        self.memory = memory
        # Whether another rank copies this worker's stores (into memory both map).
        self._stores_elsewhere = False
        self.engine: TransferEngine | None = None
        self._step_stores: list[BlockTransfer] = []
        self._store_req: dict[int, str] = {}  # store job in flight -> its request
        # async load in flight -> its request, reported in `finished_recving` when done
        self._async_req: dict[int, str] = {}
        # load in flight -> its device block ids
        self._load_device_blocks: dict[int, Sequence[int]] = {}
        # request -> store jobs in flight
        self._stores_in_flight: Counter[str] = Counter()
        # The seam to a shared store (`tier_seams.py`), opened by a layer's
        # `open_shared_tier` once the host buffer exists (`register_kv_caches`).
        self.shared: NoSharedTierWorker = NoSharedTierWorker()
        self.open_shared_tier: SharedTierOpener | None = None
        # async loads of several KV cache groups in flight: a failed copy fails the
        # request, not single blocks
        self._whole_loads: set[int] = set()
        # async load job -> device blocks it will not fill (recomputed by vLLM)
        self._async_unloaded: dict[int, list[int]] = {}
        self._finished_recving: set[str] = set()
        # Requests whose whole load failed since the last `take_failed_loads`.
        self._failed_loads: set[str] = set()
        self._awaiting_free: set[str] = set()  # finished requests the scheduler holds
        self._report = OffloadWorkerReport()
        self._load_errors: set[int] = set()
        # Seconds this worker's steps spent in transfer calls since the last stats
        # report: the copies themselves on the CPU platform, queueing and waits on CUDA.
        self._load_seconds = 0.0
        self._store_seconds = 0.0
        # A test's injector of transfer faults (`TransferFaults`); None in service.
        self.faults: TransferFaults | None = None
        self._idle_step = False
        # The epoch of what this worker computes with: one more at each change of
        # its weights or of an adapter's. A load's result is taken only if the
        # epoch when it is used equals the one its step was planned under (the
        # scheduler half's count of this worker's changes, heard from its reports
        # by `token`); else vLLM recomputes it.
        self.token = secrets.token_hex(8)
        self._epoch = 0
        self._plan_epoch = 0  # the current step's
        self._async_epochs: dict[int, int] = {}  # async load in flight -> its plan's

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        host = HostBuffer.for_kv_caches(
            kv_caches,
            self.num_slots,
            num_blocks=self.num_device_blocks,
            memory=self.memory,
        )
        memory = self.memory
        self._stores_elsewhere = (
            host.shared and memory is not None and not memory.copies_stores
        )
        self.engine = TransferEngine(
            kv_caches,
            host,
            backend=self.copy_backend,
            candidates=self.copier_candidates,
            fence_stores=self.fence_stores,
        )
        if self.open_shared_tier is not None:
            self.shared = self.open_shared_tier(host, kv_caches)

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
        self._idle_step = metadata.idle
        self._plan_epoch = metadata.epochs_heard.get(self.token, 0)
        for transfer in metadata.stores:
            self._store_req[transfer.job_id] = transfer.req_id
            self._stores_in_flight[transfer.req_id] += 1
        # Before the stores: a store that ends at once ends its write-through too.
        self.shared.plan_writes(metadata.writes)
        if self._stores_elsewhere:
            # The stage's first rank copies them into the region every rank maps.
            self._step_stores = []
            self._collect(FinishedJobs(stores={t.job_id for t in metadata.stores}))
        else:
            self._step_stores = self._to_run(metadata.stores)
        for async_load in metadata.async_loads:
            self._start_async_load(async_load)
        self.shared.place_threads(idle=metadata.idle)

    def _start_async_load(self, async_load: AsyncLoad) -> None:
        """Fetches the hit's missing blocks on the store thread; `get_finished` loads
        the hit once they are in host memory. A hit in host memory alone loads now."""
        load = async_load.load
        self._async_req[load.job_id] = load.req_id
        self._async_epochs[load.job_id] = self._plan_epoch
        if async_load.whole:
            self._whole_loads.add(load.job_id)
        self._apply(self.shared.fetch(async_load))

    def start_loads(self, metadata: OffloadStepMetadata) -> None:
        """Queues the step's loads; vLLM calls this before the forward when there are
        any."""
        if not metadata.loads:
            return
        for t in metadata.loads:
            self._load_device_blocks[t.job_id] = t.device_block_ids
        # The step's forward reads these loads, and nothing changes the epoch
        # between here and there (vLLM changes weights between steps, and loads
        # adapters in `_prepare_inputs`, before `start_load_kv`:
        # gpu_model_runner.py:4022, kv_connector_model_runner_mixin.py:85): their
        # start is their last check.
        loads = self._to_run(metadata.loads, refused=not self._plan_is_current)
        start = time.perf_counter()
        self._engine().start_loads(loads)
        self._load_seconds += time.perf_counter() - start

    def _to_run(
        self, transfers: list[BlockTransfer], *, refused: bool = False
    ) -> list[BlockTransfer]:
        """The transfers to run; the others are reported failed, uncopied (vLLM
        recomputes their blocks): every one when `refused` (loads planned from KV of
        weights this worker no longer has), else those a test's injector fails."""
        if self.faults is None and not refused:
            return transfers
        kept: list[BlockTransfer] = []
        failed: set[int] = set()
        for t in transfers:
            if refused or (self.faults is not None and self.faults.fails()):
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

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests held by the scheduler whose device jobs are all done,
        requests whose async loads are done); both None when empty."""
        if self.engine is None:
            return None, None
        self._collect(self.engine.poll_finished())
        shared_done = self.shared.poll(idle=self._idle_step)
        self._apply(shared_done)
        if shared_done.fetched:
            # The CPU platform loaded them already.
            self._collect(self.engine.poll_finished())
        done = {r for r in self._awaiting_free if not self._stores_in_flight[r]}
        self._awaiting_free -= done
        recving, self._finished_recving = self._finished_recving, set()
        return done or None, recving or None

    def _apply(self, done: SharedTierDone) -> None:
        """Takes over what the shared tier finished: loads, then reports."""
        for fetched in done.fetched:
            self._load_fetched(fetched)
        for job_id, stored in done.written.items():
            self._wrote(job_id, stored)

    def _load_fetched(self, fetched: FetchedLoad) -> None:
        """An async load's fetch ended: loads the part of the hit in host memory;
        vLLM recomputes the rest."""
        job_id, load = fetched.job_id, fetched.load
        if fetched.failed:
            self._failed_loads.add(load.req_id)
        self._report.fetched[job_id] = fetched.arrived
        self._report.fetch_reports[job_id] += 1
        self._async_unloaded[job_id] = fetched.unloaded
        self._load_device_blocks[job_id] = load.device_block_ids
        if len(load.device_block_ids) == 0:
            self._collect(FinishedJobs(loads={job_id}))
            return
        # Its result is checked again where it ends (`_collect`); a load already
        # stale is not copied at all.
        loads = self._to_run([load], refused=not self._current(job_id))
        start = time.perf_counter()
        # No step waits for it: vLLM schedules the request once it is reported.
        self._engine().start_background_loads(loads)
        self._load_seconds += time.perf_counter() - start

    def take_failed_loads(self) -> set[str]:
        """The requests whose whole load failed since the last call: vLLM recomputes
        them (its `failed_recving`); each is also among the finished loads."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def _collect(self, finished: FinishedJobs) -> None:
        stale = self._stale_loads(finished.loads)
        if stale:
            # Async loads that ran while the epoch changed: their KV is of the
            # weights or adapter before. They fail as a copy that failed.
            finished.loads -= stale
            finished.failed |= stale
        for job_id in finished.broken:
            # A load of this step that will fail: the step's compute must not trust
            # its blocks. It is reported failed (and its blocks released) once the
            # copies already queued for it have run.
            if job_id not in self._async_req:
                self._load_errors.update(self._load_device_blocks.pop(job_id, ()))
        for job_id in finished.failed:
            self._report.failed[job_id] += 1
            if job_id in self._whole_loads:
                # Several KV cache groups: vLLM recomputes the whole request.
                self._load_device_blocks.pop(job_id, None)
                self._failed_loads.add(self._async_req[job_id])
            elif job_id in self._load_device_blocks:
                # vLLM recomputes the tokens of these blocks: a miss, never
                # a wrong token.
                self._load_errors.update(self._load_device_blocks.pop(job_id))
            self._job_done(job_id, stored=False)
        for job_id in (*finished.stores, *finished.loads):
            self._report.finished[job_id] += 1
            self._load_device_blocks.pop(job_id, None)
            self._job_done(job_id, stored=True)

    def _job_done(self, job_id: int, *, stored: bool) -> None:
        self._whole_loads.discard(job_id)
        self._async_epochs.pop(job_id, None)
        unloaded = self._async_unloaded.pop(job_id, None)
        if unloaded is not None:
            # An async load: vLLM recomputes what it did not fill, and may schedule
            # the request again.
            self._load_errors.update(unloaded)
            self._finished_recving.add(self._async_req.pop(job_id))
        self._apply(self.shared.copy_ended(job_id, stored=stored))
        self._store_done(job_id)

    def _wrote(self, job_id: int, stored: list[bool]) -> None:
        """A store job's write-through ended: for each block, whether the store holds
        it now."""
        self._report.written[job_id] += 1
        self._report.write_stored[job_id] = stored

    def _store_done(self, job_id: int) -> None:
        req_id = self._store_req.pop(job_id, None)
        if req_id is not None:
            self._stores_in_flight[req_id] -= 1
            if not self._stores_in_flight[req_id]:
                del self._stores_in_flight[req_id]

    def weights_changed(self, why: str) -> None:
        """The model's weights are about to change (`why`): nothing computed from now
        on reaches the shared store, no load planned before the scheduler half hears
        of it runs, and the next report tells that half, which drops the host tier's
        blocks and stops sharing and keeping the tier's files (`runtime_weights.py`)."""
        self.shared.seal()
        self._report.weights_changed = self._report.weights_changed or why
        self._next_epoch()

    def adapter_changed(self) -> None:
        """A LoRA adapter this worker computes with was loaded again with other
        weights (`adapter_reloads.py`): no load planned or started before takes
        effect. The tiers keep their blocks: the scheduler half keys an adapter's
        blocks by its files (`lora_identity.py`)."""
        self._next_epoch()

    def _next_epoch(self) -> None:
        self._epoch += 1
        self._report.epochs[self.token] = self._epoch

    @property
    def _plan_is_current(self) -> bool:
        """Whether the current step was planned under this worker's epoch (after
        the scheduler half heard of its last change)."""
        return self._plan_epoch == self._epoch

    def _stale_loads(self, loads: set[int]) -> set[int]:
        """The async loads among `loads` planned under an epoch that has passed."""
        return {j for j in loads if not self._current(j)}

    def _current(self, job_id: int) -> bool:
        """Whether an async load's result would be of the epoch its step was
        planned under (True for other jobs)."""
        return self._async_epochs.get(job_id, self._epoch) == self._epoch

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> OffloadWorkerReport | None:
        report = self._report
        if report.empty:
            return None
        self._report = OffloadWorkerReport()
        return report

    def take_stats(self) -> dict[str, float] | None:
        """Copy time and the shared tier's counts since the last call (None: none)."""
        remote = self.shared.take_stats()
        if not (self._load_seconds or self._store_seconds or remote):
            return None
        data: dict[str, float] = {
            "load_seconds": self._load_seconds,
            "store_seconds": self._store_seconds,
            **remote,
        }
        self._load_seconds = self._store_seconds = 0.0
        return data

    def drain(self) -> None:
        """Waits for every copy in flight; their results are reported as usual."""
        if self.engine is not None:
            self.engine.wait_all()

    def shutdown(self) -> None:
        self.drain()
        self.shared.close()
        if self.memory is not None:
            self.memory.close()
