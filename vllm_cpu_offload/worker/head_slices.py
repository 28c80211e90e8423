"""A host block cut into one value per KV head, and joined back: the shared store's
values of sharded attention (`kv_shards.py`), which a rank of any TP size reads.

vLLM hands the connector each layer's cache as a logical `[B, H, N, C]` view (blocks,
this rank's KV heads, tokens, K then V of one token; `[B*r, ...]` where a block is split
into r kernel blocks), with strides of the resolved KV cache layout. The host slot holds
a block's bytes as the device lays them out, in runs (`kv_layout.py`); this module maps
the logical dims onto the slot. The value of head h of a host block is, for each of its
slots and each layer in slot order, that layer's `[r, N, C]` bytes of head h, dense, in
logical order: bytes that depend on the model and the layout, not on the TP size.

Cutting and joining are a strided copy per layer for a batch of blocks, on the store's
thread: numpy, which copies on the calling thread alone (torch would fork its OpenMP
team onto the model's cores), in the widest words (up to 8 bytes) that every offset and
run length allows (a gather of single bytes runs at a tenth of the speed). The store
never sees a host slot's own bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.kv_layout import KVLayout


class HeadSliceError(ValueError):
    """A layer's KV cache cannot be cut per KV head."""


@dataclass(frozen=True)
class _LayerCut:
    """Where one layer's heads lie in a host slot, and its part of a head's value."""

    view_sizes: tuple[int, ...]  # [heads, *rest], the last dim in bytes
    view_strides: tuple[int, ...]  # byte strides of those dims in the host slot
    slot_offset: int  # byte offset of the layer slot in every slot
    part_offset: int  # byte offset of this layer's part in a slot's share of a value
    part_bytes: int

    @property
    def rest(self) -> tuple[int, ...]:
        return self.view_sizes[1:]


class HeadSlices:
    """Cuts host blocks into per-head values and joins values into host blocks.

    Attributes:
        num_heads: the KV heads of this rank: values per host block.
        value_bytes: bytes of one value (a head of every layer of every slot of a
            host block).

    """

    def __init__(
        self, host: HostBuffer, cuts: Sequence[_LayerCut], num_heads: int, k: int
    ) -> None:
        self._host = host  # its memory outlives the views
        self._cuts = list(cuts)
        self._k = k
        self.num_heads = num_heads
        self._slot_part = sum(c.part_bytes for c in cuts)
        self.value_bytes = k * self._slot_part
        word = self._word = _word_dtype(host, cuts)
        size = word.itemsize
        memory = host.tensor.view(-1).numpy()
        self._views = [
            np.lib.stride_tricks.as_strided(
                memory[c.slot_offset :].view(word),
                (host.num_slots, *c.view_sizes[:-1], c.view_sizes[-1] // size),
                (host.block_bytes, *c.view_strides[:-1], size),
            )
            for c in cuts
        ]

    @classmethod
    def for_kv_caches(
        cls,
        host: HostBuffer,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        num_heads: int,
        num_blocks: int,
        blocks_per_host_block: int,
    ) -> HeadSlices:
        """The cuts of `host`'s layers (built for `kv_caches`).

        Raises:
            HeadSliceError: a layer's cache is not a `[B, H, N, C]` view of
                `num_heads` heads; the message names the layer and its shape.

        """
        cuts, offset = [], 0
        for name, layout in host.layouts.items():
            sizes, strides = _head_view(
                name, kv_caches[name], layout, num_heads, num_blocks
            )
            part = math.prod(sizes[1:])
            cuts.append(
                _LayerCut(sizes, strides, host.slot_offsets[name], offset, part)
            )
            offset += part
        return cls(host, cuts, num_heads, blocks_per_host_block)

    def slots_of(self, host_blocks: Sequence[int]) -> np.ndarray:
        """`[n, k]` slot ids of host blocks."""
        first = np.asarray(host_blocks, dtype=np.int64) * self._k
        return first[:, None] + np.arange(self._k)

    def cut(self, host_blocks: Sequence[int], out: torch.Tensor) -> None:
        """Writes the values of `host_blocks` into `out`, uint8 `[n, num_heads,
        value_bytes]` (block i's head j is `out[i, j]`)."""
        slots = self.slots_of(host_blocks)
        for part, view in self._parts(out, len(host_blocks)):
            part[...] = view[slots].swapaxes(1, 2)

    def join(self, values: torch.Tensor, host_blocks: Sequence[int]) -> None:
        """Writes `values` (uint8 `[n, num_heads, value_bytes]`, as `cut` makes them)
        into `host_blocks`."""
        slots = self.slots_of(host_blocks)
        for part, view in self._parts(values, len(host_blocks)):
            view[slots] = part.swapaxes(1, 2)

    def _parts(
        self, values: torch.Tensor, n: int
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Per layer: its part of `values` (`[n, heads, k, *dims past the heads]`,
        in words) and its host view."""
        size = self._word.itemsize
        joined = (
            values.numpy()
            .view(self._word)
            .reshape(n, self.num_heads, self._k, self._slot_part // size)
        )
        for cut, view in zip(self._cuts, self._views, strict=True):
            start = cut.part_offset // size
            part = joined[..., start : start + cut.part_bytes // size]
            yield part.reshape(*part.shape[:3], *view.shape[2:]), view


def _word_dtype(host: HostBuffer, cuts: Sequence[_LayerCut]) -> np.dtype:
    """The widest integer type whose size divides every offset, stride and run length
    of the cuts (and the buffer's address)."""
    sizes = [host.block_bytes, host.tensor.data_ptr(), host.tensor.numel()]
    for c in cuts:
        sizes += [c.slot_offset, c.part_offset, c.part_bytes, c.view_sizes[-1]]
        sizes += c.view_strides[:-1]
    width = math.gcd(8, *sizes)
    return np.dtype({8: np.int64, 4: np.int32, 2: np.int16}.get(width, np.uint8))


def _head_view(
    name: str,
    cache: torch.Tensor,
    layout: KVLayout,
    num_heads: int,
    num_blocks: int,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, byte strides) of one block of `cache` in its host layer slot, heads
    first, then the other dims in logical order, the last in bytes."""
    if cache.dim() != 4 or cache.shape[1] != num_heads or cache.stride(-1) != 1:
        raise HeadSliceError(
            f"layer {name}: KV cache {tuple(cache.shape)} (strides "
            f"{tuple(cache.stride())}) is not a [blocks, {num_heads} KV heads, "
            "tokens, content] view with dense content"
        )
    size = cache.element_size()
    dims = list(zip(cache.shape[1:], cache.stride()[1:], strict=True))
    if cache.shape[0] != num_blocks:
        # Kernel blocks: r of them make one block, strided as its outermost dim.
        dims.insert(0, (cache.shape[0] // num_blocks, cache.stride(0)))
    heads_at = len(dims) - 3
    sizes, strides = [], []
    for i, (n, stride) in enumerate(dims):
        sizes.append(n * size if i == len(dims) - 1 else n)
        strides.append(1 if i == len(dims) - 1 else _host_stride(stride * size, layout))
    order = [heads_at, *(i for i in range(len(dims)) if i != heads_at)]
    far = sum((sizes[i] - 1) * strides[i] for i in range(len(dims)))
    if far >= layout.block_bytes:
        raise HeadSliceError(f"layer {name}: KV heads reach past the block")
    return tuple(sizes[i] for i in order), tuple(strides[i] for i in order)


def _host_stride(device_stride: int, layout: KVLayout) -> int:
    """A dim's byte stride in the host slot, which packs a block's runs back to back:
    inside a run, as on the device; across runs, scaled from run stride to run
    size."""
    if layout.num_chunks == 1 or device_stride < layout.chunk_stride:
        return device_stride
    return device_stride // layout.chunk_stride * layout.chunk_bytes
