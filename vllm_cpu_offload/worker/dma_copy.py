"""Block copies on the GPU's copy engines: one `cudaMemcpyBatchAsync` call per launch.

Same interface as `copy_kernels.TritonBlockCopier`, different hardware. A kernel that
moves bytes over PCIe occupies streaming multiprocessors for the whole transfer, and the
forward pass running beside it loses them (a persistent GEMM can stall behind them). The
DMA engines cost the forward nothing but a call on the host: CUDA 12.8 added
`cudaMemcpyBatchAsync`, which queues thousands of scattered copies in one call.

Each (block pair, layer, run) is one copy of one contiguous run, `chunk_bytes` long, on
both sides (see `kv_layout.py` and `host_buffer.py`). Copies that continue each other on
both sides (a layout whose block holds every layer contiguously, consecutive blocks) are
merged first. The address table of a batch is built once, with torch on the host, and
sliced per layer: a layer-wise load costs one slice and a few calls.

One batch feeds one copy engine at a time, and each copy costs the engine about a
microsecond of set-up, so 64 KiB runs (one layer of one Llama-3-8B block) move at ~60% of
the link on one stream. A launch therefore forks over up to `NUM_STREAMS` streams of its
own, one slice of the copies each, and joins them back into the caller's stream. Measured
on an H100 (PCIe 5.0 x16), 128 scattered Llama-3-8B blocks: 1 / 2 / 4 / 8 streams move
60 / 74 / 84 / 91% of a plain pinned memcpy (`benchmarks/transfer.py`).

Imports torch only (the CUDA runtime through ctypes).
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Mapping, Sequence

import torch

from vllm_cpu_offload.worker.host_buffer import HostBuffer

# cudaMemcpySrcAccessOrderStream: the source is read in stream order, like cudaMemcpyAsync.
_ACCESS_ORDER_STREAM = 1
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2
# cudaMemcpyFlagPreferOverlapWithCompute: keep the copies off the SMs the forward uses.
_FLAG_PREFER_OVERLAP = 1
_MIN_RUNTIME = 12080  # CUDA 12.8: first runtime with cudaMemcpyBatchAsync
# Streams a launch forks over, and the fewest copies worth one more stream.
NUM_STREAMS = 8
MIN_COPIES_PER_STREAM = 8
_CACHED_BATCHES = 4


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", _MemLocation),
        ("dst_loc_hint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class _BatchMemcpy:
    """`cudaMemcpyBatchAsync` of the CUDA runtime that torch loaded, or unavailable."""

    def __init__(self) -> None:
        self._fn = None
        self.version = 0
        self.why_unavailable = ""
        lib = _load_cudart()
        if lib is None:
            self.why_unavailable = "no CUDA runtime library found"
            return
        version = ctypes.c_int(0)
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            self.why_unavailable = "cudaRuntimeGetVersion failed"
            return
        self.version = version.value
        if self.version < _MIN_RUNTIME or not hasattr(lib, "cudaMemcpyBatchAsync"):
            self.why_unavailable = f"CUDA runtime {self.version} has no cudaMemcpyBatchAsync"
            return
        self._fn = lib.cudaMemcpyBatchAsync
        self._fn.restype = ctypes.c_int
        # CUDA 13 dropped the `failIdx` out-parameter that 12.8 and 12.9 have.
        self._has_fail_index = self.version < 13000

    @property
    def available(self) -> bool:
        return self._fn is not None

    def __call__(
        self,
        dsts: torch.Tensor,
        srcs: torch.Tensor,
        sizes: torch.Tensor,
        attrs: _MemcpyAttributes,
        stream: int,
    ) -> None:
        """Queues `len(dsts)` copies on `stream`; the tensors are int64 on the host."""
        assert self._fn is not None
        count = dsts.numel()
        if count == 0:
            return
        attr_index = ctypes.c_size_t(0)
        args: list[object] = [
            ctypes.c_void_p(dsts.data_ptr()),
            ctypes.c_void_p(srcs.data_ptr()),
            ctypes.c_void_p(sizes.data_ptr()),
            ctypes.c_size_t(count),
            ctypes.byref(attrs),
            ctypes.byref(attr_index),
            ctypes.c_size_t(1),
        ]
        fail_index = ctypes.c_size_t(0)
        if self._has_fail_index:
            args.append(ctypes.byref(fail_index))
        args.append(ctypes.c_void_p(stream))
        code = self._fn(*args)
        if code != 0:
            raise RuntimeError(f"cudaMemcpyBatchAsync of {count} copies returned error {code}")


def _load_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch was built with: by soname if loaded, else from its wheels."""
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcudart.so.{major}"] if major else []
    names.append("libcudart.so")
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    roots = {os.path.dirname(os.path.dirname(torch.__file__))}
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so*"))):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


_BATCH_MEMCPY: _BatchMemcpy | None = None


def batch_memcpy() -> _BatchMemcpy:
    """The process-wide binding, loaded on first use."""
    global _BATCH_MEMCPY
    if _BATCH_MEMCPY is None:
        _BATCH_MEMCPY = _BatchMemcpy()
    return _BATCH_MEMCPY


class _Group:
    """Layers that share one layout: their run addresses as `[layers, 1, runs]` tables."""

    def __init__(self, names: list[str], caches: list[torch.Tensor], host: HostBuffer) -> None:
        layout = host.layouts[names[0]]
        self.names = names
        self.chunk_bytes = layout.chunk_bytes
        runs = torch.arange(layout.num_chunks, dtype=torch.int64)
        device_base = torch.tensor([t.data_ptr() for t in caches], dtype=torch.int64)
        host_base = host.tensor.data_ptr() + torch.tensor(
            [host.slot_offsets[n] for n in names], dtype=torch.int64
        )
        self.device_runs = (device_base[:, None] + runs * layout.chunk_stride)[:, None, :]
        self.host_runs = (host_base[:, None] + runs * layout.chunk_bytes)[:, None, :]
        self.device_block_stride = layout.block_stride
        self.host_block_stride = host.block_bytes


class DmaBlockCopier:
    """Copies blocks between the device KV caches and a pinned `HostBuffer` by DMA.

    `kv_caches` holds the layers that own a host slot. Launches go to the current stream.
    Block ids are int64 tensors on the host (`ids_on_host`), validated by the caller.
    `copy` raises if the runtime rejects a batch (the engine fails those jobs).
    """

    ids_on_host = True

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], host: HostBuffer) -> None:
        memcpy = batch_memcpy()
        if not memcpy.available:
            raise RuntimeError(memcpy.why_unavailable)
        if not host.pinned:
            raise RuntimeError("DMA block copies need a pinned host buffer")
        self._memcpy = memcpy
        self._device = next(iter(kv_caches.values())).device
        index = self._device.index if self._device.index is not None else 0
        by_layout: dict[object, list[str]] = {}
        for name in kv_caches:
            by_layout.setdefault(host.layouts[name], []).append(name)
        self._groups = [
            _Group(names, [kv_caches[n] for n in names], host) for names in by_layout.values()
        ]
        self._where = {n: (g, i) for g in self._groups for i, n in enumerate(g.names)}
        device = _MemLocation(_LOCATION_DEVICE, index)
        on_host = _MemLocation(_LOCATION_HOST, 0)
        order, flags = _ACCESS_ORDER_STREAM, _FLAG_PREFER_OVERLAP
        self._attrs = {
            True: _MemcpyAttributes(order, device, on_host, flags),
            False: _MemcpyAttributes(order, on_host, device, flags),
        }
        # Tables of the latest batches (a step's loads and stores): per-layer calls reuse them.
        self._cached: list[tuple[torch.Tensor, torch.Tensor, list[_Tables]]] = []
        # The runtime refuses batches on the legacy default stream; these never are.
        self._streams = [torch.cuda.Stream(self._device) for _ in range(NUM_STREAMS)]

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> None:
        """Copies block `device_ids[i]` <-> host block `host_ids[i]` for the given layers."""
        if device_ids.numel() == 0:
            return
        tables = self._tables(device_ids, host_ids)
        attrs = self._attrs[to_host]
        batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if layers is None:
            batches = [t.merged(to_host) for t in tables]
        for name in layers or ():
            group, i = self._where[name]
            t = tables[self._groups.index(group)]
            dst, src = (t.host[i], t.device[i]) if to_host else (t.device[i], t.host[i])
            batches.append((dst, src, t.layer_sizes))
        count = sum(b[0].numel() for b in batches)
        num_streams = max(1, min(len(self._streams), count // MIN_COPIES_PER_STREAM))
        current = torch.cuda.current_stream(self._device)
        # Fork: every side stream starts after the work queued so far, then the caller's
        # stream waits for all of them. Slices keep each batch's copies together.
        used = self._streams[:num_streams]
        for stream in used:
            stream.wait_stream(current)
        for dst, src, sizes in batches:
            bounds = [len(dst) * k // num_streams for k in range(num_streams + 1)]
            for stream, lo, hi in zip(used, bounds, bounds[1:], strict=False):
                if hi > lo:
                    self._memcpy(dst[lo:hi], src[lo:hi], sizes[lo:hi], attrs, stream.cuda_stream)
        for stream in used:
            current.wait_stream(stream)

    def _tables(self, device_ids: torch.Tensor, host_ids: torch.Tensor) -> list[_Tables]:
        for d, h, tables in self._cached:
            if d is device_ids and h is host_ids:
                return tables
        d = device_ids.to("cpu", torch.int64).reshape(-1)
        h = host_ids.to("cpu", torch.int64).reshape(-1)
        tables = [_Tables(g, d, h) for g in self._groups]
        # Holding the id tensors keeps their identity from being reused by another batch.
        self._cached = [(device_ids, host_ids, tables), *self._cached[: _CACHED_BATCHES - 1]]
        return tables


class _Tables:
    """Source and destination addresses of every run of one batch for one layout group."""

    def __init__(self, group: _Group, d: torch.Tensor, h: torch.Tensor) -> None:
        order = d.argsort(stable=True)  # device order: neighbouring blocks can merge
        d, h = d[order], h[order]
        # [layers, pairs, runs]: one layer's runs are one contiguous row.
        self._device = group.device_runs + (d * group.device_block_stride)[None, :, None]
        self._host = group.host_runs + (h * group.host_block_stride)[None, :, None]
        layers = len(group.names)
        self.device = self._device.reshape(layers, -1)
        self.host = self._host.reshape(layers, -1)
        self.chunk_bytes = group.chunk_bytes
        self.layer_sizes = torch.full((self.device.shape[1],), group.chunk_bytes, dtype=torch.int64)
        self._merged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def merged(self, to_host: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dsts, srcs, sizes) of every layer, with copies that continue each other merged."""
        if self._merged is None:
            # Pair-major order, so that a block's layers merge where memory allows.
            device = self._device.permute(1, 0, 2).reshape(-1)
            host = self._host.permute(1, 0, 2).reshape(-1)
            self._merged = _merge(device, host, self.chunk_bytes)
        device, host, sizes = self._merged
        return (host, device, sizes) if to_host else (device, host, sizes)


def _merge(
    device: torch.Tensor, host: torch.Tensor, chunk_bytes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Joins runs that continue the previous run on both sides. O(runs), vectorized."""
    if device.numel() <= 1:
        return device, host, torch.full_like(device, chunk_bytes)
    joins = (device[1:] == device[:-1] + chunk_bytes) & (host[1:] == host[:-1] + chunk_bytes)
    starts = torch.ones_like(device, dtype=torch.bool)
    starts[1:] = ~joins
    first = starts.nonzero().reshape(-1)
    ends = torch.cat([first[1:], torch.tensor([device.numel()])])
    return device[first].contiguous(), host[first].contiguous(), (ends - first) * chunk_bytes
