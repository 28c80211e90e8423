"""Block copies for a host buffer CUDA could not pin, through a pinned bounce buffer.

A `--swap-space-path` tier on a disk file system is a shared mapping of a file, which
recent kernels refuse to page-lock (`host_buffer.py`). Torch copies between the device
and pageable memory go one run at a time, each a synchronous `cudaMemcpy` through the
driver's own small staging area, and a store issued per layer blocks the step's host
thread at every layer until that layer's compute is done. Here the device side moves
whole batches between the caches and a small pinned buffer of the same layout (one
launch of a pinned copier: kernels or copy engines), and the host side moves rows
between that buffer and the tier with one indexed copy:

    store   device blocks -> bounce rows 0..k (pinned copier); wait for the stream;
            bounce rows -> tier rows (host copy)
    load    wait until the device no longer reads the bounce rows; tier rows -> bounce
            rows (host copy); bounce rows -> device blocks (pinned copier), left queued

Batches larger than the bounce buffer go in chunks of its size. Both capabilities are
set: ids on the host (stores wait for `finish_step`, one call for every layer, where
the step's forward is already queued) and whole-block loads (one host copy per load).
A store still holds the host until the copies queued before it are done, which is the
cost of a tier the device cannot reach; on a tmpfs the tier is pinned and none of this
runs.

Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from vllm_cpu_offload.worker.copiers.base import BlockCopier, ids_on_host
from vllm_cpu_offload.worker.host_buffer import HostBuffer

# Pinned memory of one bounce buffer: 128 of Llama-3-8B's 2 MiB blocks (16 tokens) per
# chunk, small beside any `--swap-space`.
BOUNCE_BYTES = 256 << 20

# Builds the pinned copier between the caches and the bounce buffer.
InnerFactory = Callable[[Mapping[str, torch.Tensor], HostBuffer], BlockCopier]


class BounceBlockCopier:
    """Copies `device_ids[i]` <-> host block `host_ids[i]` of an unpinned `host`.

    `make_inner` builds the copier of the device hop over the bounce buffer; the bounce
    buffer is pinned where CUDA is available (`pin`, default) and holds `bounce_blocks`
    blocks (default: `BOUNCE_BYTES` worth, at least 1, at most the tier's size).
    """

    ids_on_host = True
    whole_block_loads = True

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        host: HostBuffer,
        make_inner: InnerFactory,
        *,
        bounce_blocks: int | None = None,
        pin: bool | None = None,
    ) -> None:
        blocks = bounce_blocks or max(1, BOUNCE_BYTES // host.block_bytes)
        self._host = host
        self._bounce = HostBuffer(
            host.layouts, min(blocks, host.num_host_blocks), pin=pin
        )
        self._inner = make_inner(kv_caches, self._bounce)
        self._device = next(iter(kv_caches.values())).device
        self._on_cuda = self._device.type == "cuda"
        self._inner_ids_device = (
            torch.device("cpu")
            if not self._on_cuda or ids_on_host(self._inner)
            else self._device
        )
        # The bounce rows as the inner copier reads ids, placed there once.
        self._slots = torch.arange(self._bounce.num_host_blocks, dtype=torch.int64).to(
            self._inner_ids_device
        )
        # The last load's device hop: the bounce rows are free once it has run.
        self._read_done = torch.cuda.Event() if self._on_cuda else None
        self._read_pending = False

    @property
    def bounce_blocks(self) -> int:
        return self._bounce.num_host_blocks

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> None:
        d_all = torch.as_tensor(device_ids, dtype=torch.int64).cpu()
        h_all = torch.as_tensor(host_ids, dtype=torch.int64).cpu()
        step = self.bounce_blocks
        for start in range(0, d_all.numel(), step):
            d = d_all[start : start + step]
            h = h_all[start : start + step]
            if to_host:
                self._store(d, h, layers)
            else:
                self._load(d, h, layers)

    def _store(
        self, d: torch.Tensor, h: torch.Tensor, layers: Sequence[str] | None
    ) -> None:
        slots = self._slots[: d.numel()]
        if self._read_pending:
            # A load queued on another stream may still read these rows.
            assert self._read_done is not None
            torch.cuda.current_stream(self._device).wait_event(self._read_done)
        self._inner.copy(True, self._for_inner(d), slots, layers)
        if self._on_cuda:
            torch.cuda.current_stream(self._device).synchronize()
            self._read_pending = False
        for tier, bounce in self._row_views(layers, words=True):
            tier.index_copy_(0, h, bounce[: d.numel()])

    def _load(
        self, d: torch.Tensor, h: torch.Tensor, layers: Sequence[str] | None
    ) -> None:
        slots = self._slots[: d.numel()]
        if self._read_pending:
            assert self._read_done is not None
            self._read_done.synchronize()
            self._read_pending = False
        for tier, bounce in self._row_views(layers, words=False):
            torch.index_select(tier, 0, h, out=bounce[: d.numel()])
        self._inner.copy(False, self._for_inner(d), slots, layers)
        if self._read_done is not None:
            self._read_done.record(torch.cuda.current_stream(self._device))
            self._read_pending = True

    def _for_inner(self, ids: torch.Tensor) -> torch.Tensor:
        if self._inner_ids_device.type == "cpu":
            return ids
        return ids.to(self._inner_ids_device, non_blocking=True)

    def _row_views(
        self, layers: Sequence[str] | None, *, words: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tier rows, bounce rows) to copy: whole blocks, or only these layers'
        slots; as integer words (`_words`) or bytes."""
        pairs = (
            [(self._host.tensor, self._bounce.tensor)]
            if layers is None
            else [
                (self._host.layer_view(n), self._bounce.layer_view(n)) for n in layers
            ]
        )
        if not words:
            return pairs
        return [(_words(tier), _words(bounce)) for tier, bounce in pairs]


def _words(rows: torch.Tensor) -> torch.Tensor:
    """uint8 rows as the widest integer words their length allows (slot offsets are
    16-byte aligned). Stores use them: on the H100 host `index_copy_` moved 9-10 GB/s
    of bytes and 38-40 of int64 words. Loads keep bytes, whose `index_select` moved
    37-42 GB/s there against 24-31 as words (docs/transfer.md)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if rows.shape[-1] % dtype.itemsize == 0:
            return rows.view(dtype)
    return rows
