"""Block copies on vLLM's CPU platform: torch views and `copy_`, no Triton.

Same interface as `triton_kernels.TritonBlockCopier`. The device KV caches are ordinary
host memory here, so a copy is a memcpy between two strided views. What makes it fast:

- Layers that sit at one fixed distance from each other in one allocation (vLLM
  allocates all layers of a group in one buffer) form a *stack*: one `[blocks, layers,
  runs, words]` view, so one `copy_` moves a block of every layer of the stack.
- Pairs are sorted by device block and merged into runs where both ids are consecutive:
  one `copy_` per run, not per block, with no temporary (`index_select` + `index_copy_`
  writes every byte twice and measured 10x slower here).
- Bytes move as the widest integer word the alignment allows (uint8 copies measured 2x
  slower than int64 ones).
- On CPU, runs under `PARALLEL_MIN_BYTES` are cut into pieces of at most `PIECE_BYTES`,
  and pieces adding up to `SPLIT_MIN_BYTES` are shared with helper threads
  (`copy_threads`), each copying with torch's intra-op pool at 1 thread. Only longer
  runs use ATen's OpenMP pool, whose parallel regions stall for milliseconds on a busy
  machine.

Imports torch (and the standard library) only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_cpu_offload.worker.copiers.copy_threads import (
    CopyThreads,
    default_threads,
    helper_cores,
    set_threads,
)
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.kv_layout import KVLayout

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

Run = tuple[int, int, int]  # (first device block, first host block, blocks)

# Measured here (2 vCPUs, see docs/transfer.md): one thread copies ~6-10 GB/s of
# scattered blocks; two ~12-15 GB/s when the second core is free, and 5-10% less than
# one when another process holds it (the two threads then share one core).
#
# Runs of at least this many bytes use ATen's OpenMP pool on the calling thread: a long
# strided copy there matched or beat a plain memcpy, and a ~7 ms stall costs no more
# than the single-thread time it saves.
PARALLEL_MIN_BYTES = 64 << 20
# Shorter runs are cut into pieces of at most this size: small enough that two threads
# share a long run, large enough that the few microseconds of Python per piece vanish.
PIECE_BYTES = 4 << 20
# Pieces adding up to less than this are copied by the calling thread alone. On a busy
# machine sharing measured 10-25% slower at 1-16 MiB, and a helper that loses its core
# in the middle of a piece can hold the call for milliseconds, which only a batch that
# takes that long on one thread can absorb.
SPLIT_MIN_BYTES = 32 << 20


@dataclass
class _Stack:
    """Layers with one layout whose data sit `layer_step` bytes apart in one storage."""

    layout: KVLayout
    names: list[str]
    storage: torch.UntypedStorage
    first_offset: int  # bytes from the storage start to the first layer's data
    layer_step: int  # bytes between consecutive layers' data (0 for a single layer)
    first_slot: int  # byte offset of the first layer's slot in a host block
    slot_step: int  # bytes between consecutive layers' slots

    def accepts(self, layout: KVLayout, t: torch.Tensor, slot: int) -> bool:
        if (
            layout != self.layout
            or t.untyped_storage().data_ptr() != self.storage.data_ptr()
        ):
            return False
        step = (
            _byte_offset(t)
            - self.first_offset
            - self.layer_step * (len(self.names) - 1)
        )
        slot_step = slot - self.first_slot - self.slot_step * (len(self.names) - 1)
        if len(self.names) == 1:
            return step > 0 and slot_step > 0
        return step == self.layer_step and slot_step == self.slot_step

    def add(self, name: str, t: torch.Tensor, slot: int) -> None:
        if len(self.names) == 1:
            self.layer_step = _byte_offset(t) - self.first_offset
            self.slot_step = slot - self.first_slot
        self.names.append(name)

    def views(self, host: HostBuffer) -> tuple[torch.Tensor, torch.Tensor]:
        """Word views `[blocks, layers, runs, words]` of the device caches and the host
        buffer."""
        lay = self.layout
        word = math.gcd(
            8,
            lay.block_stride,
            lay.chunk_stride,
            lay.chunk_bytes,
            self.first_offset,
            self.layer_step,
            self.first_slot,
            self.slot_step,
            host.block_bytes,
        )
        dtype = _WORD_DTYPES[word]
        shape = (len(self.names), lay.num_chunks, lay.chunk_bytes // word)
        flat = torch.empty(0, dtype=dtype, device=self.storage.device)
        flat.set_(self.storage, 0, (self.storage.nbytes() // word,), (1,))
        device = flat.as_strided(
            (lay.num_blocks, *shape),
            (
                lay.block_stride // word,
                self.layer_step // word or 1,
                lay.chunk_stride // word or 1,
                1,
            ),
            self.first_offset // word,
        )
        host_flat = host.tensor.view(-1).view(dtype)
        host_view = host_flat.as_strided(
            (host.num_slots, *shape),
            (
                host.block_bytes // word,
                self.slot_step // word or 1,
                lay.chunk_bytes // word,
                1,
            ),
            self.first_slot // word,
        )
        return device, host_view


def _byte_offset(t: torch.Tensor) -> int:
    return int(t.storage_offset()) * t.element_size()


def runs_of(device_ids: Sequence[int], host_ids: Sequence[int]) -> list[Run]:
    """Sorts the pairs by device block and merges consecutive ones. O(n log n)."""
    pairs = sorted(zip(device_ids, host_ids, strict=True))
    runs: list[Run] = []
    for d, h in pairs:
        if runs:
            d0, h0, n = runs[-1]
            if d == d0 + n and h == h0 + n:
                runs[-1] = (d0, h0, n + 1)
                continue
        runs.append((d, h, 1))
    return runs


class TorchBlockCopier:
    """Copies blocks between the KV caches and a `HostBuffer` with torch `copy_` on
    views.

    `kv_caches` holds the layers that own a host slot. Synchronous (on CUDA tensors it
    queues on the current stream, from the calling thread only). Block ids must be
    validated by the caller, and destination blocks must be distinct (which of two
    copies into one block lands is unspecified). A copy that raises in any thread raises
    from `copy`, after every thread has stopped touching the buffers.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        host: HostBuffer,
        *,
        threads: int | None = None,
    ) -> None:
        devices = {t.device.type for t in kv_caches.values()}
        self._on_cpu = devices == {"cpu"}
        count = (threads or default_threads()) if self._on_cpu else 1
        self._threads = CopyThreads(count, helper_cores(count)) if count > 1 else None
        stacks: list[_Stack] = []
        for name, t in kv_caches.items():
            layout, slot = host.layouts[name], host.slot_offsets[name]
            if stacks and stacks[-1].accepts(layout, t, slot):
                stacks[-1].add(name, t, slot)
            else:
                stacks.append(
                    _Stack(
                        layout, [name], t.untyped_storage(), _byte_offset(t), 0, slot, 0
                    )
                )
        self._stacks = [
            (*s.views(host), len(s.names) * s.layout.block_bytes) for s in stacks
        ]
        self._layers: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        for stack, (device, host_view, _) in zip(stacks, self._stacks, strict=True):
            for i, name in enumerate(stack.names):
                view = (
                    device[:, i : i + 1],
                    host_view[:, i : i + 1],
                    stack.layout.block_bytes,
                )
                self._layers[name] = view

    @property
    def num_stacks(self) -> int:
        return len(self._stacks)

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor | Sequence[int],
        host_ids: torch.Tensor | Sequence[int],
        layers: Sequence[str] | None = None,
    ) -> None:
        """Copies block `device_ids[i]` <-> host block `host_ids[i]` for the given
        layers."""
        runs = runs_of(_as_list(device_ids), _as_list(host_ids))
        views = self._stacks if layers is None else [self._layers[n] for n in layers]
        pieces: list[_Piece] = []
        pieces_bytes = 0
        for device, host, block_bytes in views:
            step = max(1, PIECE_BYTES // block_bytes)
            for d, h, n in runs:
                if not self._on_cpu or n * block_bytes >= PARALLEL_MIN_BYTES:
                    # CUDA stream, or ATen's CPU pool
                    _copy(to_host, device, host, d, h, n)
                    continue
                pieces_bytes += n * block_bytes
                for i in range(0, n, step):
                    pieces.append((device, host, d + i, h + i, min(step, n - i)))
        if pieces:
            self._copy_pieces(to_host, pieces, pieces_bytes)

    def _copy_pieces(self, to_host: bool, pieces: list[_Piece], nbytes: int) -> None:
        pool = torch.get_num_threads()
        set_threads(1)
        try:
            if self._threads is not None and nbytes >= SPLIT_MIN_BYTES:
                self._threads.run(pieces, lambda piece: _copy(to_host, *piece))
            else:
                for piece in pieces:
                    _copy(to_host, *piece)
        finally:
            set_threads(pool)


# device view, host view, d, h, n
_Piece = tuple[torch.Tensor, torch.Tensor, int, int, int]


def _copy(
    to_host: bool, device: torch.Tensor, host: torch.Tensor, d: int, h: int, n: int
) -> None:
    if to_host:
        host[h : h + n].copy_(device[d : d + n])
    else:
        device[d : d + n].copy_(host[h : h + n])


def _as_list(ids: torch.Tensor | Sequence[int]) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
