"""Block copies on vLLM's CPU platform: torch views and `copy_`, no Triton.

Same interface as `copy_kernels.TritonBlockCopier`. The device KV caches are ordinary host
memory here, so a copy is a memcpy between two strided views. What makes it fast:

- Layers that sit at one fixed distance from each other in one allocation (vLLM allocates
  all layers of a group in one buffer) form a *stack*: one `[blocks, layers, runs, words]`
  view, so one `copy_` moves a block of every layer of the stack.
- Pairs are sorted by device block and merged into runs where both ids are consecutive: one
  `copy_` per run, not per block, with no temporary (`index_select` + `index_copy_` writes
  every byte twice and measured 10x slower here).
- Bytes move as the widest integer word the alignment allows (uint8 copies measured 2x
  slower than int64 ones).
- A run below `PARALLEL_MIN_BYTES` is copied on one thread. ATen splits copies above 32K
  elements over its OpenMP pool, and a parallel region waits for its slowest thread: on a
  machine whose cores are busy with anything else (here: another process on one of 2
  cores) a 2 MiB copy took 7 ms with 2 threads and 0.15 ms with 1. Only a run large enough
  to amortize such a wait gets the pool.

Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.kv_layout import KVLayout

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

Run = tuple[int, int, int]  # (first device block, first host block, blocks)

# Runs of at least this many bytes use torch's thread pool. Measured here: one thread copies
# ~5.6 GB/s; two threads ~12 GB/s on an idle machine, but a parallel region can stall ~7 ms
# on a busy one. At 64 MiB a stall costs no more than the single-thread time it saves.
PARALLEL_MIN_BYTES = 64 << 20


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
        if layout != self.layout or t.untyped_storage().data_ptr() != self.storage.data_ptr():
            return False
        step = _byte_offset(t) - self.first_offset - self.layer_step * (len(self.names) - 1)
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
        """Word views `[blocks, layers, runs, words]` of the device caches and the host buffer."""
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
            (host.num_host_blocks, *shape),
            (host.block_bytes // word, self.slot_step // word or 1, lay.chunk_bytes // word, 1),
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
    """Copies blocks between the KV caches and a `HostBuffer` with torch `copy_` on views.

    `kv_caches` holds the layers that own a host slot. Synchronous (on CUDA tensors it
    queues on the current stream). Block ids must be validated by the caller.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        host: HostBuffer,
        *,
        small_runs_one_thread: bool = True,
    ) -> None:
        devices = {t.device.type for t in kv_caches.values()}
        self._one_thread = small_runs_one_thread and devices == {"cpu"}
        stacks: list[_Stack] = []
        for name, t in kv_caches.items():
            layout, slot = host.layouts[name], host.slot_offsets[name]
            if stacks and stacks[-1].accepts(layout, t, slot):
                stacks[-1].add(name, t, slot)
            else:
                stacks.append(
                    _Stack(layout, [name], t.untyped_storage(), _byte_offset(t), 0, slot, 0)
                )
        self._stacks = [stack.views(host) for stack in stacks]
        self._stack_block_bytes = [len(s.names) * s.layout.block_bytes for s in stacks]
        self._layers: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        for stack, (device, host_view) in zip(stacks, self._stacks, strict=True):
            for i, name in enumerate(stack.names):
                view = (device[:, i : i + 1], host_view[:, i : i + 1], stack.layout.block_bytes)
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
        """Copies block `device_ids[i]` <-> host block `host_ids[i]` for the given layers."""
        runs = runs_of(_as_list(device_ids), _as_list(host_ids))
        if layers is None:
            views = [(*v, b) for v, b in zip(self._stacks, self._stack_block_bytes, strict=True)]
        else:
            views = [self._layers[n] for n in layers]
        pool = torch.get_num_threads()
        current = pool
        try:
            for device, host, block_bytes in views:
                for d, h, n in runs:
                    wanted = pool if n * block_bytes >= PARALLEL_MIN_BYTES else 1
                    if self._one_thread and wanted != current:
                        torch.set_num_threads(wanted)
                        current = wanted
                    if to_host:
                        host[h : h + n].copy_(device[d : d + n])
                    else:
                        device[d : d + n].copy_(host[h : h + n])
        finally:
            if current != pool:
                torch.set_num_threads(pool)


def _as_list(ids: torch.Tensor | Sequence[int]) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
