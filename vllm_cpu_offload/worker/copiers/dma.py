"""Block copies on the GPU's copy engines (DMA), with the same interface as the kernels.

A kernel that moves bytes over PCIe holds streaming multiprocessors for the whole
transfer, and the forward pass beside it loses them: a persistent GEMM stalls behind a
single busy SM. The copy engines cost the forward nothing; they cost the host a call per
copy instead.

Two ways to feed them (`cuda_runtime.py`, `streams.py`):
- Pitched: where one layout group's layers sit at a fixed distance in one allocation, as
  in vLLM 0.32's layer-compact layouts, and each layer-block is one run, a block's runs
  of every layer are `layers` rows of one 2D copy: one `cudaMemcpy2DAsync` per block
  moves the whole block. Used when a call copies every layer (stores at the end of a
  step).
- Batched: every (pair, layer, run) is one copy of one contiguous run, queued by
  `cudaMemcpyBatchAsync` (CUDA 12.8+), thousands per call. Copies that continue each
  other on both sides (a block-outermost layout, consecutive blocks) are merged first.
  The address table of a batch is built once, with torch on the host, and sliced per
  layer.

A stream feeds one copy engine at a time, and each copy costs the engine set-up time, so
a launch forks over up to `NUM_STREAMS` streams of its own and joins them back into the
caller's stream. Measured on an H100 (PCIe 5.0 x16), 64 KiB runs: 1 / 4 / 8 streams move
56 / 81 / 90% of a plain pinned memcpy (`benchmarks/transfer.py --run-sweep`).

On the CPU platform the same class runs with stand-ins for the runtime and the streams
(`testing/held_streams.py`): how its tables and ordering are tested without a GPU.

Imports torch only (the CUDA runtime through ctypes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from vllm_cpu_offload.worker.copiers.cuda_runtime import CopyEngines, cuda_runtime
from vllm_cpu_offload.worker.copiers.device_streams import (
    CudaStreams,
    Stream,
    Streams,
)
from vllm_cpu_offload.worker.copiers.streams import (
    copy_attributes,
    forked,
    merge_runs,
    queue_batches,
)
from vllm_cpu_offload.worker.host_buffer import HostBuffer

# Streams a launch forks over, and the fewest copies worth one more stream.
NUM_STREAMS = 8
MIN_COPIES_PER_STREAM = 8
_CACHED_BATCHES = 4


class _Group:
    """Layers that share one layout: their run addresses as `[layers, 1, runs]`
    tables."""

    def __init__(
        self,
        names: list[str],
        caches: list[torch.Tensor],
        host: HostBuffer,
        max_pitch: int,
    ) -> None:
        layout = host.layouts[names[0]]
        self.names = names
        self.chunk_bytes = layout.chunk_bytes
        runs = torch.arange(layout.num_chunks, dtype=torch.int64)
        device_addrs = [t.data_ptr() for t in caches]
        slots = [host.slot_offsets[n] for n in names]
        device_base = torch.tensor(device_addrs, dtype=torch.int64)
        host_base = host.tensor.data_ptr() + torch.tensor(slots, dtype=torch.int64)
        self.device_runs = (device_base[:, None] + runs * layout.chunk_stride)[
            :, None, :
        ]
        self.host_runs = (host_base[:, None] + runs * layout.chunk_bytes)[:, None, :]
        self.device_block_stride = layout.block_stride
        self.host_block_stride = host.block_bytes
        # (device pitch, host pitch) when a block of every layer is one 2D
        # copy, else None.
        self.pitches: tuple[int, int] | None = None
        device_step, host_step = _step(device_addrs), _step(slots)
        one_run = layout.num_chunks == 1 and len(names) > 1
        if one_run and layout.chunk_bytes <= min(device_step, host_step) <= max_pitch:
            self.pitches = (device_step, host_step)
        self.first_device = device_addrs[0]
        self.first_host = host.tensor.data_ptr() + slots[0]


def _step(values: list[int]) -> int:
    """The fixed positive distance between consecutive values, or 0 if there is none."""
    if len(values) < 2:
        return 0
    step = values[1] - values[0]
    ok = step > 0 and all(
        b - a == step for a, b in zip(values, values[1:], strict=False)
    )
    return step if ok else 0


class DmaBlockCopier:
    """Copies blocks between the device KV caches and a pinned `HostBuffer` by DMA.

    `kv_caches` holds the layers that own a host slot. Launches go to the current stream
    (forked over the copier's own streams and joined back). Block ids are int64 tensors
    on the host (`ids_on_host`), validated by the caller. `copy` raises if the runtime
    rejects a copy (the engine fails those jobs). `runtime` and `streams` default to
    CUDA's (tests: stand-ins).
    """

    ids_on_host = True

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        host: HostBuffer,
        *,
        runtime: CopyEngines | None = None,
        streams: Streams | None = None,
    ) -> None:
        runtime = runtime or cuda_runtime()
        if not runtime.available:
            raise RuntimeError(runtime.why_unavailable)
        self._device = next(iter(kv_caches.values())).device
        on_cuda = self._device.type == "cuda"
        if on_cuda and not host.pinned and not host.tensor.is_cuda:
            raise RuntimeError("DMA block copies need a pinned host buffer")
        self._runtime = runtime
        self._order = streams or CudaStreams(self._device)
        index = self._device.index if self._device.index is not None else 0
        max_pitch = runtime.max_pitch(index)
        self._groups = [
            _Group(names, [kv_caches[n] for n in names], host, max_pitch)
            for names in host.layout_groups(kv_caches)
        ]
        # layer name -> (its group's index, its row in the group's tables)
        self._where = {
            n: (k, i) for k, g in enumerate(self._groups) for i, n in enumerate(g.names)
        }
        self._attrs = copy_attributes(index, buffer_on_device=host.tensor.is_cuda)
        # Tables of the latest batches (a step's loads and stores): per-layer
        # calls reuse them.
        self._cached: list[tuple[torch.Tensor, torch.Tensor, list[_Tables]]] = []
        # The runtime refuses batches on the legacy default stream; these never are.
        self._streams = [self._order.stream() for _ in range(NUM_STREAMS)]

    @property
    def pitched(self) -> bool:
        """Whether whole-block copies go as one 2D copy per block."""
        return all(g.pitches is not None for g in self._groups)

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> None:
        """Copies block `device_ids[i]` <-> host block `host_ids[i]` for the given
        layers."""
        if device_ids.numel() == 0:
            return
        if layers is None and self.pitched:
            self._fork(
                device_ids.numel(),
                lambda used: self._pitched(to_host, device_ids, host_ids, used),
            )
            return
        tables = self._tables(device_ids, host_ids)
        batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if layers is None:
            batches = [t.merged(to_host) for t in tables]
        for name in layers or ():
            k, i = self._where[name]
            t = tables[k]
            dst, src = (t.host[i], t.device[i]) if to_host else (t.device[i], t.host[i])
            batches.append((dst, src, t.layer_sizes))
        count = sum(b[0].numel() for b in batches)
        attrs = self._attrs[to_host]
        self._fork(
            count, lambda used: queue_batches(self._runtime, attrs, batches, used)
        )

    def _fork(self, count: int, queue: Callable[[list[Stream]], None]) -> None:
        """Runs `queue` over as many of the copier's streams as `count` copies fill."""
        num_streams = max(1, min(len(self._streams), count // MIN_COPIES_PER_STREAM))
        used = self._streams[:num_streams]
        with forked(used, self._order):
            queue(used)

    def _pitched(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        used: list[Stream],
    ) -> None:
        memcpy_2d = self._runtime.memcpy_2d
        handles = [s.cuda_stream for s in used]
        pairs = list(zip(device_ids.tolist(), host_ids.tolist(), strict=True))
        for g in self._groups:
            assert g.pitches is not None
            device_pitch, host_pitch = g.pitches
            rows, width = len(g.names), g.chunk_bytes
            for k, (d, h) in enumerate(pairs):
                device = g.first_device + d * g.device_block_stride
                host = g.first_host + h * g.host_block_stride
                stream = handles[k % len(handles)]
                if to_host:
                    memcpy_2d(
                        host, host_pitch, device, device_pitch, width, rows, stream
                    )
                else:
                    memcpy_2d(
                        device, device_pitch, host, host_pitch, width, rows, stream
                    )

    def _tables(
        self, device_ids: torch.Tensor, host_ids: torch.Tensor
    ) -> list[_Tables]:
        for d, h, tables in self._cached:
            if d is device_ids and h is host_ids:
                return tables
        d = device_ids.to("cpu", torch.int64).reshape(-1)
        h = host_ids.to("cpu", torch.int64).reshape(-1)
        tables = [_Tables(g, d, h) for g in self._groups]
        # Holding the id tensors keeps their identity from being reused
        # by another batch.
        self._cached = [
            (device_ids, host_ids, tables),
            *self._cached[: _CACHED_BATCHES - 1],
        ]
        return tables


class _Tables:
    """Source and destination addresses of every run of one batch for one layout
    group."""

    def __init__(self, group: _Group, d: torch.Tensor, h: torch.Tensor) -> None:
        order = d.argsort(stable=True)  # device order: neighbouring blocks can merge
        d, h = d[order], h[order]
        # [layers, pairs, runs]: one layer's runs are one contiguous row.
        self._device = (
            group.device_runs + (d * group.device_block_stride)[None, :, None]
        )
        self._host = group.host_runs + (h * group.host_block_stride)[None, :, None]
        layers = len(group.names)
        self.device = self._device.reshape(layers, -1)
        self.host = self._host.reshape(layers, -1)
        self.chunk_bytes = group.chunk_bytes
        self.layer_sizes = torch.full(
            (self.device.shape[1],), group.chunk_bytes, dtype=torch.int64
        )
        self._merged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def merged(self, to_host: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dsts, srcs, sizes) of every layer, with copies that continue each other
        merged."""
        if self._merged is None:
            # Pair-major order, so that a block's layers merge where memory allows.
            device = self._device.permute(1, 0, 2).reshape(-1)
            host = self._host.permute(1, 0, 2).reshape(-1)
            self._merged = merge_runs(device, host, self.chunk_bytes)
        device, host, sizes = self._merged
        return (host, device, sizes) if to_host else (device, host, sizes)
