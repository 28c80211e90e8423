"""The host tier's memory: one allocation of `num_slots` slots, slot-major.

A slot holds every layer's KV of one device block back to back (layer slots in
registration order; for each layer its runs in order), so one slot is one contiguous
byte range: evicting, copying or hashing a block never touches another block's memory.
The scheduler's host block is `blocks_per_host_block` consecutive slots.

    byte of (slot h, layer l, run c)
        = h * block_bytes + slot_offset[l] + c * chunk_bytes

Pinned (page-locked and mapped) when CUDA is available, so device kernels read and write
it directly; plain memory on the CPU platform, written once at allocation so that every
page is backed from the start: a store into a page never touched costs a page fault per
4 KiB (measured in a vLLM CPU worker: 5-36 ms for a 1,000-token document of the 8-layer
benchmark model, against 1.3 ms once its pages exist), and memory the host cannot back
fails at start, not in the middle of serving. Pinning registers an ordinary allocation
with `cudaHostRegister` instead of asking torch for pinned memory: torch's pinned
allocator rounds every request up to a power of two, so a 40 GiB `--swap-space` would
lock 64 GiB. With `--swap-space-path` the same layout lives in a shared mapping of a
file that outlives the process, and KV that every tensor-parallel rank holds alike
(MLA) in one region all ranks map: a layer's `MappedMemory` (`memory=`), which also
says how it is pinned. The same layout can live in device memory (`device=`): a few
blocks of staging for copies that move whole blocks over PCIe (`copiers/staged.py`).
Of third-party modules it imports torch only.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import weakref
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

from vllm_cpu_offload.errors import GIB
from vllm_cpu_offload.worker.kv_layout import KVLayout, canonical_layers

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from kernels on any device.
_REGISTER_FLAGS = 0x1 | 0x2
# Every layer slot starts on a 16-byte boundary so copies can move 8- or 16-byte words.
SLOT_ALIGNMENT = 16


# madvise(MADV_POPULATE_WRITE), Linux 5.14+: backs every page of a mapping at start.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class MappedMemory(Protocol):
    """Memory a layer maps for the host buffer instead of this process's own.

    `shared`: other processes map the same memory (the ranks of a stage);
    `copies_stores`: this process copies stores into it (False where another rank
    does and this one only loads from it).
    """

    @property
    def shared(self) -> bool: ...

    @property
    def copies_stores(self) -> bool: ...

    def map(
        self, num_slots: int, slot_bytes: int, layouts: dict[str, str]
    ) -> torch.Tensor | None:
        """uint8 `[num_slots, slot_bytes]` over the memory, or None where it
        cannot be had (the buffer then allocates its own)."""
        ...

    def pin(self, tensor: torch.Tensor) -> bool:
        """Page-locks the mapped `tensor` for CUDA where it can; whether it did."""
        ...

    def close(self) -> None: ...


class HostBufferError(RuntimeError):
    """The host memory asked for by `--swap-space` could not be allocated or pinned."""


def _align(n: int) -> int:
    return -(-n // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


class HostBuffer:
    """Host memory for `num_slots` KV blocks of the given layers, one per slot.

    Attributes:
        tensor: uint8 `[num_slots, block_bytes]`, contiguous.
        num_slots: how many device blocks it holds (host blocks times
            `blocks_per_host_block`).
        layouts: layer name -> its device layout, for the layers that own a slot.
        slot_offsets: layer name -> byte offset of its layer slot inside every slot.
        block_bytes: bytes of one slot (all layers).
        pinned: whether the memory is page-locked.
        shared: whether other ranks map this memory (replicated KV, stored once).

    """

    def __init__(
        self,
        layouts: Mapping[str, KVLayout],
        num_slots: int,
        *,
        pin: bool | None = None,
        device: torch.device | None = None,
        memory: MappedMemory | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not layouts:
            raise ValueError("a host buffer needs at least one layer")
        self.layouts = dict(layouts)
        self.slot_offsets: dict[str, int] = {}
        offset = 0
        for name, layout in self.layouts.items():
            self.slot_offsets[name] = offset
            offset += _align(layout.block_bytes)
        self.block_bytes = offset
        self.num_slots = num_slots
        on_device = device is not None and device.type != "cpu"
        self.pinned = not on_device and (
            torch.cuda.is_available() if pin is None else pin
        )
        mapped = None
        if memory is not None and not on_device:
            described = {name: repr(layout) for name, layout in self.layouts.items()}
            mapped = memory.map(num_slots, self.block_bytes, described)
        self.shared = mapped is not None and memory is not None and memory.shared
        # Staging, not --swap-space: an allocation error speaks for itself.
        if mapped is not None:
            self.tensor = mapped
        elif on_device:
            shape = (num_slots, self.block_bytes)
            self.tensor = torch.empty(shape, dtype=torch.uint8, device=device)
        else:
            self.tensor = _allocate(num_slots, self.block_bytes)
        if self.pinned and mapped is not None and memory is not None:
            self.pinned = memory.pin(self.tensor)
        elif self.pinned:
            pin_or_refuse(self.tensor)
        if self.pinned:
            # Unpinned when this buffer goes away, while its tensor is still alive.
            weakref.finalize(self, _host_unregister, self.tensor.data_ptr())

    @classmethod
    def for_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        num_slots: int,
        *,
        num_blocks: int | None = None,
        pin: bool | None = None,
        memory: MappedMemory | None = None,
    ) -> HostBuffer:
        """A buffer with one slot per distinct layer tensor (shared KV caches share a
        slot)."""
        canonical = canonical_layers(kv_caches)
        layouts = {
            name: KVLayout.from_tensor(kv_caches[name], num_blocks=num_blocks)
            for name in dict.fromkeys(canonical.values())
        }
        return cls(
            layouts,
            num_slots,
            pin=pin,
            memory=memory,
        )

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.block_bytes

    def block(self, host_block_id: int) -> torch.Tensor:
        """The bytes of one slot (a view)."""
        return self.tensor[host_block_id]

    def layout_groups(self, names: Iterable[str]) -> list[list[str]]:
        """`names` grouped by their layout, in first-seen order: a copier's launch
        groups."""
        groups: dict[KVLayout, list[str]] = {}
        for name in names:
            groups.setdefault(self.layouts[name], []).append(name)
        return list(groups.values())

    def layer_view(self, layer_name: str) -> torch.Tensor:
        """uint8 `[num_slots, layer block bytes]` view of one layer's layer slot in
        every slot."""
        start = self.slot_offsets[layer_name]
        return self.tensor[:, start : start + self.layouts[layer_name].block_bytes]


def _allocate(num_blocks: int, block_bytes: int) -> torch.Tensor:
    try:
        tensor = torch.empty((num_blocks, block_bytes), dtype=torch.uint8)
        tensor.fill_(0)  # backs every page now (pinning does the same on CUDA)
        return tensor
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise _error(
            num_blocks * block_bytes, "host", f"the allocation failed: {e}"
        ) from e


def pin_or_refuse(t: torch.Tensor) -> None:
    why = _register(t)
    if why is not None:
        raise _error(t.numel(), "pinned host", why)


def pin_mapped_file(t: torch.Tensor, path: str) -> bool:
    """Pins a `--swap-space-path` mapping if CUDA can; else the tier runs unpinned.

    Whether memory mapped from a file can be page-locked depends on the kernel and the
    file system (long-term pins of file pages that need writeback are refused by
    recent kernels), not on the request: the tier still works, with copies through
    pageable memory, so this warns instead of failing the engine.
    """
    why = _register(t)
    if why is None:
        return True
    logger.warning(
        "--swap-space-path %s: CUDA cannot page-lock memory mapped from this file "
        "system (%s); the host tier runs unpinned, copied through a pinned bounce "
        "buffer at about half the speed. Put "
        "--swap-space-path on a tmpfs (e.g. /dev/shm/vllm-kv) to pin it.",
        path,
        why,
    )
    return False


def _register(t: torch.Tensor) -> str | None:
    """Registers `t` with CUDA; why it failed, or None. A failed call leaves CUDA's
    last error set, which the next kernel launch would report as its own: cleared."""
    try:
        code = _host_register(t.data_ptr(), t.numel())
    except (RuntimeError, AttributeError) as e:
        return f"cudaHostRegister raised: {e}"
    if code == 0:
        return None
    _clear_cuda_error()
    return f"cudaHostRegister returned error {code}"


def _error(size: int, kind: str, why: str) -> HostBufferError:
    return HostBufferError(
        f"--swap-space asked for {size / GIB:.2f} GiB of {kind} memory and {why}. "
        "Lower --swap-space or free host memory."
    )


def _clear_cuda_error() -> None:
    # torch exposes no cudaGetLastError; its launch check reads (and so resets) the
    # last error, raising it once: a one-element fill takes that raise here.
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda")


def _host_register(ptr: int, size: int) -> int:
    """Page-locks and maps `size` bytes at `ptr`; returns the CUDA error code (0:
    success)."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, size, _REGISTER_FLAGS))


def _host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
