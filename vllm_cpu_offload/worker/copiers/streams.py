"""Stream and batch helpers of the copy-engine copiers (`dma.py`, `staged.py`).

- `forked`: side streams that start after, and end before, the caller's stream;
- `copy_attributes` and `queue_batches`: batches of runs for `cudaMemcpyBatchAsync`,
  split over streams;
- `merge_runs`: runs that continue each other on both sides joined into one.

Streams and the runtime come through `device_streams.py` and `cuda_runtime.py`'s
protocols, which tests replace with stand-ins. Imports torch only (the CUDA runtime
through ctypes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from vllm_cpu_offload.worker.copiers.cuda_runtime import (
    CopyEngines,
    MemcpyAttributes,
    MemLocation,
)
from vllm_cpu_offload.worker.copiers.device_streams import Stream, Streams

# cudaMemcpySrcAccessOrderStream: the source is read in stream
# order, like cudaMemcpyAsync.
_ACCESS_ORDER_STREAM = 1
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2
# cudaMemcpyFlagPreferOverlapWithCompute: keep the copies off the SMs the forward uses.
_FLAG_PREFER_OVERLAP = 1


def copy_attributes(
    device: int, *, buffer_on_device: bool = False
) -> dict[bool, MemcpyAttributes]:
    """Batch attributes by direction (True: caches to buffer) for copies between the
    caches on `device` and a pinned host buffer, or a staging buffer on the same
    device."""
    caches = MemLocation(_LOCATION_DEVICE, device)
    buffer = caches if buffer_on_device else MemLocation(_LOCATION_HOST, 0)
    order, flags = _ACCESS_ORDER_STREAM, _FLAG_PREFER_OVERLAP
    return {
        True: MemcpyAttributes(order, caches, buffer, flags),
        False: MemcpyAttributes(order, buffer, caches, flags),
    }


@contextmanager
def forked(streams: Sequence[Stream], order: Streams) -> Iterator[None]:
    """Side `streams` start after the current stream's work so far, and its later work
    waits for them, also when the body raises (no copy is left running behind the
    caller)."""
    current = order.current()
    for stream in streams:
        stream.wait_stream(current)
    try:
        yield
    finally:
        for stream in streams:
            current.wait_stream(stream)


def queue_batches(
    runtime: CopyEngines,
    attrs: MemcpyAttributes,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    streams: Sequence[Stream],
) -> None:
    """Queues each (dsts, srcs, sizes) batch of copies split evenly over `streams`."""
    for dst, src, sizes in batches:
        bounds = [len(dst) * k // len(streams) for k in range(len(streams) + 1)]
        for stream, lo, hi in zip(streams, bounds, bounds[1:], strict=False):
            if hi > lo:
                stream_handle = stream.cuda_stream
                runtime.memcpy_batch(
                    dst[lo:hi], src[lo:hi], sizes[lo:hi], attrs, stream_handle
                )


def merge_runs(
    device: torch.Tensor, host: torch.Tensor, chunk_bytes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(device, host, sizes): runs of `chunk_bytes` at these addresses, each joined to
    the previous one where it continues it on both sides. O(runs), vectorized."""
    if device.numel() <= 1:
        return device, host, torch.full_like(device, chunk_bytes)
    joins = (device[1:] == device[:-1] + chunk_bytes) & (
        host[1:] == host[:-1] + chunk_bytes
    )
    starts = torch.ones_like(device, dtype=torch.bool)
    starts[1:] = ~joins
    first = starts.nonzero().reshape(-1)
    ends = torch.cat([first[1:], torch.tensor([device.numel()])])
    return (
        device[first].contiguous(),
        host[first].contiguous(),
        (ends - first) * chunk_bytes,
    )
