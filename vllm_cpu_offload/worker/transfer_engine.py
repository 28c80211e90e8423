"""Moves KV blocks between the device caches and the host buffer, one engine step at a
time. Which copier moves them is `copiers/select.py`'s choice; this module only moves
jobs through a step.

On CUDA, loads run on a high-priority load stream and stores on a store stream, with
events so that compute waits only for what it reads and never for a store (streams and
events through `copiers/device_streams.py`, which tests replace with held stand-ins):

    call                    what it queues
    ----------------------  -----------------------------------------------------------
    start_loads(jobs)       load stream: wait for compute so far, then one launch per
                            layer, each followed by that layer's event
    start_background_loads  background stream: wait for compute so far, one launch
      (jobs)                for every layer, one completion event; nothing waits for
                            it (loads that span steps)
    wait_for_layer_load(l)  compute stream waits for layer l's event
    store_layer(l, jobs)    store stream waits for compute so far, then one launch for
                            layer l
    finish_step()           compute waits for any load not yet waited for; layers that
                            had no store hook are stored; one completion event per
                            stream
    poll_finished()         event.query(): jobs whose completion event fired; never
                            blocks

A copier that finishes a store on the host after the stream (the bounce copier of a
tier CUDA cannot pin) returns that part as `HostWork`; the batch is done when both its
event and that work are.

On the CPU platform the same calls copy synchronously (loads at `start_loads`, this
step's stores all at once in `finish_step`), and everything is finished when
`finish_step` returns.

A job whose ids are out of range, or whose copy raises, is reported failed (the
connector turns that into a recompute); it never raises out of a step or leaves a job
unreported. A launch that raises at one layer after others were queued fails its jobs
only once those queued copies have run (`FinishedJobs.broken` until then): a block is
released only when nothing copies from or into it any more. No call waits on the host
for a copy stream but `wait_all`. Imports torch (and, on CUDA, triton) only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TypeAlias

import torch

from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.worker.copiers.base import (
    BlockCopier,
    finish_on_host,
    ids_on_host,
    loads_whole_blocks,
)
from vllm_cpu_offload.worker.copiers.device_streams import CudaStreams, Stream, Streams
from vllm_cpu_offload.worker.copiers.select import (
    Candidate,
    Copiers,
    select_copiers,
)
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.kv_layout import KVLayout, canonical_layers
from vllm_cpu_offload.worker.transfer_jobs import (
    Batch,
    FinishedJobs,
    JobsInFlight,
    join_jobs,
)

logger = logging.getLogger(__name__)

Ids: TypeAlias = Sequence[int] | torch.Tensor


class TransferEngine:
    """Owns the copies between `kv_caches` and `host_buffer`; see the module docstring.

    Args:
        kv_caches: layer name -> device KV cache, as vLLM registers them. Names that
            view the same tensor (KV sharing) are copied once.
        host_buffer: built for the same caches (`HostBuffer.for_kv_caches`).
        copier: one copier for loads and stores; by default `select_copiers` picks
            each direction's by `backend`.
        backend: "auto", "triton", "dma" or "staged" (`copiers/select.py`).
        candidates: copiers to choose from instead of the platform's, each checked at
            start-up as on CUDA (`select_copiers`).
        fence_stores: on CUDA, each step's compute first waits for the stores still
            running. Needed when vLLM may reuse a device block of a running request in
            the next step (a sliding-window group releases the blocks that leave its
            window).
        streams: the streams and events the copies are ordered with; CUDA's on a CUDA
            device. Tests pass a stand-in (`testing/held_streams.py`) to run the
            stream path on the CPU platform.

    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        host_buffer: HostBuffer,
        *,
        copier: BlockCopier | None = None,
        backend: str = "auto",
        candidates: Sequence[Candidate] | None = None,
        fence_stores: bool = False,
        streams: Streams | None = None,
    ) -> None:
        if not kv_caches:
            raise ValueError("TransferEngine needs at least one KV cache")
        self.host = host_buffer
        self._canonical = canonical_layers(kv_caches)
        self._layers = list(dict.fromkeys(self._canonical.values()))
        # Layers writing each tensor: with the hybrid KV cache manager a tensor
        # holds the blocks of one layer of every group, complete only once each of
        # them has run.
        self._writers = Counter(self._canonical.values())
        self._fence_stores = fence_stores
        caches = {name: kv_caches[name] for name in self._layers}
        for name, t in caches.items():
            expected = host_buffer.layouts.get(name)
            if (
                expected is None
                or KVLayout.from_tensor(t, num_blocks=expected.num_blocks) != expected
            ):
                raise ValueError(f"host buffer has no slot matching layer {name!r}")
        self.num_device_blocks = min(
            host_buffer.layouts[n].num_blocks for n in self._layers
        )
        self.device = next(iter(caches.values())).device
        self.use_streams = streams is not None or self.device.type == "cuda"
        # Never called on the CPU platform without a stand-in.
        self.streams = streams or CudaStreams(self.device)
        self.copiers = (
            Copiers(copier, copier)
            if copier is not None
            else select_copiers(caches, host_buffer, backend, candidates=candidates)
        )
        # On CUDA each layer's stores go as soon as its hook runs (they finish early).
        # Copiers that read ids on the host (copy engines) defer to `finish_step`: a
        # DMA batch costs the host about a microsecond per run, which `finish_step`
        # pays while the device still runs the step's forward.
        self._layerwise_stores = self.use_streams and not ids_on_host(
            self.copiers.stores
        )

        self._jobs = JobsInFlight()
        # This step's state.
        self._loads: list[Batch] = []
        self._load_waited: set[str] = set()
        self._stores: dict[tuple[int, ...], Batch] = {}
        if self.use_streams:
            self._load_stream = self.streams.stream(priority=-1)
            self._store_stream = self.streams.stream()
            self._background_stream = self.streams.stream()
            self._load_events = {n: self.streams.event() for n in self._layers}

    # ---- one engine step ----

    def begin_step(self) -> None:
        """Before the step's forward: with `fence_stores`, compute waits for running
        stores."""
        if self.use_streams and self._fence_stores and self._jobs.has_stores:
            self.streams.current().wait_stream(self._store_stream)

    def start_loads(self, jobs: Sequence[BlockTransfer]) -> None:
        """Queues every layer's host->device copy of `jobs` (CPU: copies them now)."""
        batch = self._load_batch(jobs)
        if batch is None:
            return
        self._loads.append(batch)
        compute = self.streams.current()
        with self.streams.using(self._load_stream):
            # Blocks handed to these loads may still be read by earlier compute work.
            self._load_stream.wait_stream(compute)
            if loads_whole_blocks(self.copiers.loads):
                # One call for every layer; each layer's event then marks
                # the whole load.
                if self._launch(self.copiers.loads, False, batch, None):
                    for name in self._layers:
                        self._load_events[name].record(self._load_stream)
                return
            for name in self._layers:
                if not self._launch(self.copiers.loads, False, batch, [name]):
                    break
                self._load_events[name].record(self._load_stream)

    def start_background_loads(self, jobs: Sequence[BlockTransfer]) -> None:
        """Queues the host->device copy of `jobs` that no step waits for (loads that
        span steps): `poll_finished` reports them once done. CPU: copies them now.

        On CUDA they run on a stream of their own, so that neither this step's loads
        nor compute queue behind them; the caller makes no request read the blocks
        before they are reported.
        """
        batch = self._load_batch(jobs)
        if batch is None:
            return
        compute = self.streams.current()
        with self.streams.using(self._background_stream):
            # Blocks handed to these loads may still be read by earlier compute work.
            self._background_stream.wait_stream(compute)
            self._launch(self.copiers.loads, False, batch, None)
        self._track(self._background_stream, batch, is_store=False)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Makes the current stream wait for this layer's load only. O(1), never
        blocks."""
        name = self._canonical[layer_name]
        if not self._loads or name in self._load_waited:
            return
        self._load_waited.add(name)
        self.streams.current().wait_event(self._load_events[name])

    def store_layer(self, layer_name: str, jobs: Sequence[BlockTransfer]) -> None:
        """Queues this layer's device->host copy of `jobs` behind the compute written so
        far.

        On CPU the copy is deferred to `finish_step`, where all layers go in one pass.
        """
        batch = self._store_batch(jobs)
        if batch is None or not self._layerwise_stores:
            return
        name = self._canonical[layer_name]
        if name in batch.layers_done or batch.failed:
            return
        batch.layer_calls[name] += 1
        if batch.layer_calls[name] < self._writers[name]:
            return  # another layer still writes this tensor in this step
        batch.layers_done.add(name)
        compute = self.streams.current()
        with self.streams.using(self._store_stream):
            self._store_stream.wait_stream(compute)
            self._launch(self.copiers.stores, True, batch, [name])

    def finish_step(self) -> None:
        """Ends the step: waits compute on unwaited loads, completes this step's
        stores."""
        loads, stores = self._loads, list(self._stores.values())
        self._loads, self._stores, self._load_waited = [], {}, set()
        if not self.use_streams:
            for batch in stores:
                self._run_sync(True, batch)
                self._jobs.finished.stores.update(batch.job_ids)
            return
        compute = self.streams.current()
        if loads:
            # Layers without a load hook (or a failed launch) still must
            # not race compute.
            compute.wait_stream(self._load_stream)
        for batch in loads:
            self._track(self._load_stream, batch, is_store=False)
        for batch in stores:
            rest = [n for n in self._layers if n not in batch.layers_done]
            if rest and not batch.failed:
                with self.streams.using(self._store_stream):
                    self._store_stream.wait_stream(compute)
                    layers = None if len(rest) == len(self._layers) else rest
                    self._launch(self.copiers.stores, True, batch, layers)
            self._track(self._store_stream, batch, is_store=True)

    def poll_finished(self) -> FinishedJobs:
        """Jobs finished or failed since the last poll. Non-blocking
        (`Event.query`)."""
        return self._jobs.poll()

    def wait_all(self) -> None:
        """Blocks until every queued copy is done; the next poll reports them."""
        self._jobs.wait_all()

    # ---- all layers at once, no bookkeeping (CPU paths, benchmarks, tests) ----

    def copy_blocks(
        self,
        to_host: bool,
        device_ids: Ids,
        host_ids: Ids,
        layers: Sequence[str] | None = None,
    ) -> None:
        """Copies the pairs for `layers` (default all) on the current stream,
        unchecked."""
        copier = self._copier_for(to_host)
        on_device = self.use_streams and not ids_on_host(copier)
        where = self.device if on_device else torch.device("cpu")
        d = torch.as_tensor(device_ids, dtype=torch.int64).to(where)
        h = torch.as_tensor(host_ids, dtype=torch.int64).to(where)
        names = (
            None
            if layers is None
            else list(dict.fromkeys(self._canonical[n] for n in layers))
        )
        finish_on_host(copier.copy(to_host, d, h, names))

    # ---- internals ----

    def _load_batch(self, jobs: Sequence[BlockTransfer]) -> Batch | None:
        """The loads' batch for a stream; None when nothing is left to queue: no valid
        job, or the CPU platform, which copies them here."""
        batch = self._batch(jobs)
        if batch is None or self.use_streams:
            return batch
        self._run_sync(False, batch)
        self._jobs.finished.loads.update(batch.job_ids)
        return None

    def _copier_for(self, to_host: bool) -> BlockCopier:
        return self.copiers.stores if to_host else self.copiers.loads

    def _store_batch(self, jobs: Sequence[BlockTransfer]) -> Batch | None:
        if not jobs:
            return None
        key = tuple(j.job_id for j in jobs)
        if key not in self._stores:
            batch = self._batch(jobs)
            if batch is None:
                return None
            self._stores[key] = batch
        return self._stores[key]

    def _batch(self, jobs: Sequence[BlockTransfer]) -> Batch | None:
        """The valid jobs joined into one batch (bad ones fail). O(blocks)."""
        batch, rejected = join_jobs(
            jobs,
            self.num_device_blocks,
            self.host.num_slots,
            pin=self.device.type == "cuda",
        )
        self._jobs.failed.update(rejected)
        return batch

    def _ids(
        self, copier: BlockCopier, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's ids where `copier` reads them; moved on the current (side) stream
        once."""
        if not self.use_streams or ids_on_host(copier):
            return batch.device_ids, batch.host_ids
        if batch.on_device is None:
            batch.on_device = (
                batch.device_ids.to(self.device, non_blocking=True),
                batch.host_ids.to(self.device, non_blocking=True),
            )
        return batch.on_device

    def _launch(
        self, copier: BlockCopier, to_host: bool, batch: Batch, names: list[str] | None
    ) -> bool:
        """Copies these layers (None: all) on the current stream; a raise fails the
        batch."""
        try:
            work = copier.copy(to_host, *self._ids(copier, batch), names)
            if work is not None:
                batch.host_work.append(work)
            return True
        except Exception:
            logger.exception(
                "copy of layers %s failed; jobs %s fail", names, batch.job_ids
            )
            # Copies of other layers may be queued already: the jobs are reported
            # failed when the stream has run them (`_track`), broken until then.
            batch.failed = True
            self._jobs.broken.update(batch.job_ids)
            return False

    def _run_sync(self, to_host: bool, batch: Batch) -> None:
        """CPU: all layers at once; if that raises, job by job so only the bad ones
        fail."""
        try:
            finish_on_host(
                self._copier_for(to_host).copy(
                    to_host, batch.device_ids, batch.host_ids, None
                )
            )
            return
        except Exception:
            logger.exception(
                "batched copy of jobs %s failed; retrying one by one", batch.job_ids
            )
        ok: list[int] = []
        offset = 0
        for job_id, n in zip(batch.job_ids, batch.sizes, strict=True):
            d = batch.device_ids[offset : offset + n]
            h = batch.host_ids[offset : offset + n]
            offset += n
            try:
                finish_on_host(self._copier_for(to_host).copy(to_host, d, h, None))
                ok.append(job_id)
            except Exception:
                logger.exception("copy of job %d failed", job_id)
                self._jobs.failed.add(job_id)
        batch.job_ids = ok

    def _track(self, stream: Stream, batch: Batch, *, is_store: bool) -> None:
        """The batch's jobs end when what `stream` queued so far has run, a failed
        batch's too: a launch that raised at one layer leaves the layers before it
        queued, still reading or writing the jobs' blocks. Polled, never waited for."""
        event = self.streams.event()
        event.record(stream)
        self._jobs.track(event, batch, is_store=is_store)
