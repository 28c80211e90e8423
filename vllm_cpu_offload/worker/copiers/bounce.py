"""Block copies for a host buffer CUDA could not pin, through a pinned bounce buffer.

A `--swap-space-path` tier on a disk file system is a shared mapping of a file, which
recent kernels refuse to page-lock (`host_buffer.py`). Torch copies between the device
and pageable memory go one run at a time, each a synchronous `cudaMemcpy` through the
driver's own small staging area, and a store issued per layer blocks the step's host
thread at every layer until that layer's compute is done. Here the device side moves
whole batches between the caches and a small pinned buffer of the same layout (one
launch of a pinned copier: kernels or copy engines), and the host side moves rows
between that buffer and the tier with one indexed copy:

    store   device blocks -> bounce rows 0..k (pinned copier), queued; then, on a
            thread of its own, once the stream has passed it: bounce rows -> tier
            rows (host copy). `copy` returns that host hop (`HostWork`): the engine
            reports the store when it is done.
    load    wait until no device hop or host hop still uses the bounce rows; tier
            rows -> bounce rows (host copy); bounce rows -> device blocks (pinned
            copier), left queued

Batches larger than the bounce buffer go in chunks of its size, each waiting for the
last to free the rows. Both capabilities are set: ids on the host (stores go at
`finish_step`, one call for every layer) and whole-block loads (one host copy per
load). The step's thread waits only where a copy needs rows that an earlier one still
uses: a load right after a store waits for that store's forward; on a tmpfs the tier
is pinned and none of this runs.

Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent import futures

import torch

from vllm_cpu_offload.worker.copiers.base import BlockCopier, HostWork, ids_on_host
from vllm_cpu_offload.worker.copiers.device_streams import CudaStreams, Streams
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
    `streams` order the copies; CUDA's on a CUDA device, none on the CPU platform but
    a test's stand-ins (`testing/held_streams.py`).
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
        streams: Streams | None = None,
    ) -> None:
        blocks = bounce_blocks or max(1, BOUNCE_BYTES // host.block_bytes)
        self._host = host
        self._bounce = HostBuffer(host.layouts, min(blocks, host.num_slots), pin=pin)
        self._inner = make_inner(kv_caches, self._bounce)
        self._device = next(iter(kv_caches.values())).device
        self._on_cuda = self._device.type == "cuda"
        self._order: Streams | None = streams
        if self._on_cuda:
            self._order = streams or CudaStreams(self._device)
        self._inner_ids_device = (
            torch.device("cpu")
            if not self._on_cuda or ids_on_host(self._inner)
            else self._device
        )
        # The bounce rows as the inner copier reads ids, placed there once.
        self._slots = torch.arange(self._bounce.num_slots, dtype=torch.int64).to(
            self._inner_ids_device
        )
        # The last load's device hop: the bounce rows are free once it has run. Until
        # a load records it, waiting on it returns at once.
        self._read_done = self._order.event() if self._order is not None else None
        # Stores' host hops, in order, on one thread of their own; the last one queued
        # holds the bounce rows until it is done.
        self._hops = futures.ThreadPoolExecutor(1, thread_name_prefix="kv-bounce")
        self._hop: futures.Future[None] | None = None

    @property
    def bounce_blocks(self) -> int:
        return self._bounce.num_slots

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> HostWork | None:
        """Loads are queued on the current stream when this returns; a store returns
        its host hop, which ends after the stream has passed the store."""
        d_all = torch.as_tensor(device_ids, dtype=torch.int64).cpu()
        h_all = torch.as_tensor(host_ids, dtype=torch.int64).cpu()
        step = self.bounce_blocks
        hops = []
        for start in range(0, d_all.numel(), step):
            d = d_all[start : start + step]
            h = h_all[start : start + step]
            if to_host:
                hops.append(self._store(d, h, layers))
            else:
                self._load(d, h, layers)
        return _HostHop(hops) if hops else None

    def _store(
        self, d: torch.Tensor, h: torch.Tensor, layers: Sequence[str] | None
    ) -> futures.Future[None]:
        slots = self._slots[: d.numel()]
        self._wait_for_hop()
        if self._order is not None and self._read_done is not None:
            # A load queued on another stream may still read these rows.
            self._order.current().wait_event(self._read_done)
        self._inner.copy(True, self._for_inner(d), slots, layers)
        event = None
        if self._order is not None:
            event = self._order.event()
            event.record(self._order.current())
        pairs = self._row_views(layers, words=True)
        count = d.numel()

        def hop() -> None:
            if event is not None:
                event.synchronize()
            for tier, bounce in pairs:
                tier.index_copy_(0, h, bounce[:count])

        self._hop = self._hops.submit(hop)
        return self._hop

    def _load(
        self, d: torch.Tensor, h: torch.Tensor, layers: Sequence[str] | None
    ) -> None:
        slots = self._slots[: d.numel()]
        self._wait_for_hop()  # a store's hop still reads the bounce rows
        if self._read_done is not None:
            self._read_done.synchronize()
        for tier, bounce in self._row_views(layers, words=False):
            torch.index_select(tier, 0, h, out=bounce[: d.numel()])
        self._inner.copy(False, self._for_inner(d), slots, layers)
        if self._order is not None and self._read_done is not None:
            self._read_done.record(self._order.current())

    def _wait_for_hop(self) -> None:
        """Blocks until the last store's host hop has read the bounce rows. Its failure
        is its own store's to report (`_HostHop`), not the next copy's."""
        if self._hop is not None:
            self._hop.exception()  # waits; does not raise
            self._hop = None

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


class _HostHop:
    """A store's host hops (one per chunk), as `HostWork`: done once the thread has
    copied every chunk's rows into the tier (each after its device hop: the thread
    waits for the stream first)."""

    __slots__ = ("_futures",)

    def __init__(self, hops: list[futures.Future[None]]) -> None:
        self._futures = hops

    def query(self) -> bool:
        if not all(f.done() for f in self._futures):
            return False
        self.synchronize()
        return True

    def synchronize(self) -> None:
        for f in self._futures:
            try:
                f.result()
            except Exception as e:
                raise RuntimeError(f"host copy into the tier failed: {e}") from e
