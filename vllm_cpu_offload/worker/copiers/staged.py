"""Whole-block copies through a few blocks of staging in device memory.

What a copy-engine transfer costs beyond its bytes is paid per contiguous run: over 8
streams an H100 moves 64 KiB runs at 87-88% of a plain pinned memcpy and 128 KiB runs at
95% (`benchmarks/transfer.py --run-sweep`, docs/transfer.md). A block of a layer-compact
layout is one 32-64 KiB run per layer on the device but one contiguous range, all
layers, in the host buffer. Staging hands the PCIe hop whole blocks:

    store: caches --gather, device to device--> staging slot --one DMA per block--> host
    load: host --one DMA per block--> staging slot --scatter, device to device--> caches

The device-to-device hop is an inner copier (the pitched copy-engine path of `dma`,
or the Triton kernels) pointed at a staging `HostBuffer` in device memory; it moves the
same bytes at HBM speed, a small share of the PCIe hop's time. A batch goes in chunks of
`chunk_blocks`, alternating between two halves of each direction's staging, so one
chunk's device hop runs beside the previous chunk's PCIe hop. One event per half marks
its last use; whatever refills the half waits for it, so calls from any streams never
overwrite a chunk still in flight. Loads and stores each have a lane of their own
(staging halves, streams, device-hop copier), so a load never queues behind a store, or
the reverse.

Only whole-block calls (`layers is None`) are staged; a call for some layers goes to the
direct copier. Device memory: `4 * chunk_blocks` blocks of staging (two lanes of two
halves).

On the CPU platform there is nothing to gain, but the same class runs there (torch
copies for the device hop, `memmove` for the other), which is how its addressing is
tested without a GPU; given stand-ins for the runtime and the streams
(`testing/held_streams.py`), its stream path runs there too, which is how its ordering
is. Imports torch only (triton through the kernel copier, when chosen).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from vllm_cpu_offload.worker.copiers.base import BlockCopier, ids_on_host
from vllm_cpu_offload.worker.copiers.cuda_runtime import CopyEngines, cuda_runtime
from vllm_cpu_offload.worker.copiers.device_streams import (
    CudaStreams,
    Event,
    Streams,
)
from vllm_cpu_offload.worker.copiers.dma import DmaBlockCopier
from vllm_cpu_offload.worker.copiers.streams import (
    copy_attributes,
    forked,
    merge_runs,
    queue_batches,
)
from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier
from vllm_cpu_offload.worker.host_buffer import HostBuffer

# Blocks per chunk: 16 MiB of the 8B shape per PCIe hop, enough to fill the hop streams.
CHUNK_BLOCKS = 8
HOP_STREAMS = 4
GATHERS = ("dma", "kernel")


class _Lane:
    """One direction's staging halves, streams and device-hop copier."""

    def __init__(
        self,
        inner: BlockCopier,
        slots: torch.Tensor,
        device: torch.device,
        order: Streams | None,
    ) -> None:
        self.inner = inner
        self.slots = slots  # [2, chunk_blocks] on the host: the slots of each half
        # The same ids where the device hop reads them (on the device for the kernels).
        on_host = ids_on_host(inner) or device.type != "cuda"
        self.inner_slots = slots if on_host else slots.to(device)
        if order is not None:
            self.gather_stream = order.stream()
            self.hop_streams = [order.stream() for _ in range(HOP_STREAMS)]
            self.last_use = [order.event(), order.event()]


class StagedBlockCopier:
    """Copies whole blocks between the device KV caches and `host` through device
    staging.

    Block ids are int64 tensors on the host (`ids_on_host`). Launches go to the current
    stream (forked over the lane's streams and joined back), like the other copiers.
    `whole_block_loads` tells the transfer engine to load every layer in one call.
    `runtime` and `streams` are CUDA's on a CUDA device; tests pass stand-ins to run
    the stream path on the CPU platform (copy-engine gather only).
    """

    ids_on_host = True
    whole_block_loads = True

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        host: HostBuffer,
        *,
        chunk_blocks: int = CHUNK_BLOCKS,
        gather: str = "dma",
        runtime: CopyEngines | None = None,
        streams: Streams | None = None,
    ) -> None:
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        if gather not in GATHERS:
            raise ValueError(
                f"gather {gather!r} is not known; choose one of: {', '.join(GATHERS)}"
            )
        self._device = next(iter(kv_caches.values())).device
        # Copies go on streams: on CUDA, or on a test's stand-ins.
        self._order: Streams | None = None
        if streams is not None or self._device.type == "cuda":
            self._order = streams or CudaStreams(self._device)
        self.chunk_blocks = chunk_blocks
        self._host = host
        self.staging = HostBuffer(
            host.layouts, 4 * chunk_blocks, pin=False, device=self._device
        )
        self._direct: BlockCopier
        if self._order is not None:
            self._direct = self._streamed_direct(kv_caches, host, runtime)
        else:
            self._direct = TorchBlockCopier(kv_caches, host, threads=1)
        slots = torch.arange(4 * chunk_blocks, dtype=torch.int64).view(
            2, 2, chunk_blocks
        )
        self._lanes = {
            to_host: _Lane(
                self._device_hop(kv_caches, gather),
                lane_slots,
                self._device,
                self._order,
            )
            for to_host, lane_slots in zip((True, False), slots, strict=True)
        }

    def _streamed_direct(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        host: HostBuffer,
        runtime: CopyEngines | None,
    ) -> BlockCopier:
        runtime = runtime or cuda_runtime()
        if not runtime.available:
            raise RuntimeError(runtime.why_unavailable)
        if self._device.type == "cuda" and not host.pinned:
            raise RuntimeError("staged block copies need a pinned host buffer")
        self._runtime = runtime
        index = self._device.index if self._device.index is not None else 0
        # In the PCIe hop, the staging buffer is the "device" side, the host
        # buffer the host.
        self._attrs = copy_attributes(index)
        return DmaBlockCopier(kv_caches, host, runtime=runtime, streams=self._order)

    def _device_hop(
        self, kv_caches: Mapping[str, torch.Tensor], gather: str
    ) -> BlockCopier:
        """A copier between the caches and the staging buffer, with streams of its own.

        Without streams (the CPU platform), "dma" stands for torch copies; "kernel"
        runs in Triton's interpreter only."""
        if self._order is None and gather == "dma":
            return TorchBlockCopier(kv_caches, self.staging, threads=1)
        if gather == "kernel":
            # Triton is imported only where its kernels are asked for: the CPU
            # platform's copies and the DMA gather run without it.
            from vllm_cpu_offload.worker.copiers.triton_kernels import TritonBlockCopier

            return TritonBlockCopier(kv_caches, self.staging)
        inner = DmaBlockCopier(
            kv_caches, self.staging, runtime=self._runtime, streams=self._order
        )
        if not inner.pitched:
            raise RuntimeError("a copy-engine gather needs a layer-compact KV layout")
        return inner

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> None:
        """Copies block `device_ids[i]` <-> host block `host_ids[i]` for the given
        layers."""
        if layers is not None:
            self._direct.copy(to_host, device_ids, host_ids, layers)
            return
        d = device_ids.to("cpu", torch.int64).reshape(-1)
        h = host_ids.to("cpu", torch.int64).reshape(-1)
        lane = self._lanes[to_host]
        with self._forked(lane):
            for k, start in enumerate(range(0, d.numel(), self.chunk_blocks)):
                end = min(start + self.chunk_blocks, d.numel())
                if to_host:
                    self._store_chunk(lane, k % 2, d[start:end], h[start:end])
                else:
                    self._load_chunk(lane, k % 2, d[start:end], h[start:end])

    # ---- one chunk ----

    def _store_chunk(
        self, lane: _Lane, half: int, d: torch.Tensor, h: torch.Tensor
    ) -> None:
        n = d.numel()
        if self._order is None:
            lane.inner.copy(True, d, lane.inner_slots[half, :n])
            self._hop(lane, True, h, lane.slots[half, :n])
            return
        gathered = self._order.event()
        lane.gather_stream.wait_event(lane.last_use[half])
        with self._order.using(lane.gather_stream):
            self._device_hop_copy(lane, True, half, d)
        gathered.record(lane.gather_stream)
        self._hop(
            lane,
            True,
            h,
            lane.slots[half, :n],
            after=gathered,
            done=lane.last_use[half],
        )

    def _load_chunk(
        self, lane: _Lane, half: int, d: torch.Tensor, h: torch.Tensor
    ) -> None:
        n = d.numel()
        if self._order is None:
            self._hop(lane, False, h, lane.slots[half, :n])
            lane.inner.copy(False, d, lane.inner_slots[half, :n])
            return
        landed = self._order.event()
        self._hop(
            lane, False, h, lane.slots[half, :n], after=lane.last_use[half], done=landed
        )
        lane.gather_stream.wait_event(landed)
        with self._order.using(lane.gather_stream):
            self._device_hop_copy(lane, False, half, d)
        lane.last_use[half].record(lane.gather_stream)

    def _device_hop_copy(
        self, lane: _Lane, to_host: bool, half: int, d: torch.Tensor
    ) -> None:
        """The device hop of one chunk on the current stream, ids where the copier reads
        them."""
        slots = lane.inner_slots[half, : d.numel()]
        lane.inner.copy(to_host, d.to(slots.device, non_blocking=True), slots)

    def _hop(
        self,
        lane: _Lane,
        to_host: bool,
        host_ids: torch.Tensor,
        slots: torch.Tensor,
        after: Event | None = None,
        done: Event | None = None,
    ) -> None:
        """Whole blocks between staging `slots` and host blocks `host_ids`: one run per
        block, runs that continue each other on both sides merged."""
        size = self._host.block_bytes
        staged = self.staging.tensor.data_ptr() + slots * size
        hosted = self._host.tensor.data_ptr() + host_ids * size
        staged, hosted, sizes = merge_runs(staged, hosted, size)
        dsts, srcs = (hosted, staged) if to_host else (staged, hosted)
        if self._order is None:
            for dst, src, nbytes in zip(
                dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True
            ):
                ctypes.memmove(dst, src, nbytes)
            return
        assert after is not None and done is not None
        used = lane.hop_streams[: min(len(lane.hop_streams), dsts.numel())]
        for stream in used:
            stream.wait_event(after)
        queue_batches(self._runtime, self._attrs[to_host], [(dsts, srcs, sizes)], used)
        for stream in used[1:]:
            joined = self._order.event()
            joined.record(stream)
            used[0].wait_event(joined)
        done.record(used[0])

    def _forked(self, lane: _Lane) -> AbstractContextManager[None]:
        """The lane's streams start after, and end before, the current stream's later
        work."""
        if self._order is None:
            return nullcontext()
        return forked([lane.gather_stream, *lane.hop_streams], self._order)
