"""Where each block of one layer's device KV cache lives, derived from the tensor's
strides.

vLLM hands a connector one tensor per layer (`register_kv_caches`). Its shape and
strides depend on the attention backend and on the resolved `KVCacheLayout`; this module
reads them from the tensor itself and never from names. Every layout we accept reduces
to one rule:

    block b of the layer = `num_chunks` runs of `chunk_bytes` contiguous bytes;
    run c starts at byte `b * block_stride + c * chunk_stride` of the tensor's data.

Layouts vLLM 0.32 produces (per-layer view `[B, H, N, C]`, C = K then V of one token):
    LBHNC / LBNHC / BLHNC / BLNHC: the block interior is dense -> one chunk per block.
    LHBNC / BHLNC: heads lie outside the block -> one chunk per head (`chunk_stride` = H
    stride).
Older shapes are covered by the same rule: `(2, num_blocks, ...)` -> two chunks (K and
V), `(num_blocks, 2, ...)` -> one chunk, MLA-like `(num_blocks, block_size, D)` -> one
chunk.

This module imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """One layer's device KV cache, in bytes from the tensor's `data_ptr()`.

    Attributes:
        num_blocks: device blocks the layer holds.
        block_stride: bytes between the starts of block b and block b + 1.
        num_chunks: contiguous runs that make up one block (1 when the block is dense).
        chunk_stride: bytes between the starts of runs c and c + 1 of one block (0 if
            one run).
        chunk_bytes: bytes of one run.
        element_size: bytes of one element of the tensor's dtype.

    """

    num_blocks: int
    block_stride: int
    num_chunks: int
    chunk_stride: int
    chunk_bytes: int
    element_size: int

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block of this layer (what a host block holds for it)."""
        return self.num_chunks * self.chunk_bytes

    @property
    def alignment(self) -> int:
        """Largest power of two (up to 16) dividing every byte offset the layout
        produces."""
        strides = (self.block_stride, self.chunk_stride, self.chunk_bytes)
        return math.gcd(16, *strides)

    def block_view(self, kv_cache: torch.Tensor, block: int) -> torch.Tensor:
        """uint8 `[num_chunks, chunk_bytes]` view of one block of `kv_cache` (this
        layout's)."""
        storage = torch.empty(0, dtype=torch.uint8, device=kv_cache.device)
        storage.set_(kv_cache.untyped_storage())
        offset = (
            int(kv_cache.storage_offset()) * self.element_size
            + block * self.block_stride
        )
        return storage.as_strided(
            (self.num_chunks, self.chunk_bytes), (self.chunk_stride or 1, 1), offset
        )

    @classmethod
    def from_tensor(
        cls,
        kv_cache: torch.Tensor,
        *,
        num_blocks: int | None = None,
        block_dim: int | None = None,
    ) -> KVLayout:
        """Derives the layout from the tensor's shape and strides.

        Args:
            kv_cache: one layer's KV cache as vLLM registers it.
            num_blocks: the KV manager's block count, if known. A block dim of `k *
                num_blocks` (vLLM's kernel blocks: a manager block split into `k`) is
                grouped back into manager blocks.
            block_dim: which dim indexes blocks. By default dim 0, or dim 1 for the
                legacy `(2, num_blocks, ...)` shape (5 dims with `shape[0] == 2`, or
                `shape[1] == num_blocks` where `shape[0] == 2`).

        Raises:
            ValueError: the blocks of this tensor are not a fixed set of evenly strided,
                contiguous runs; the message names the shape and strides.

        """
        t = kv_cache
        if t.dim() == 0:
            raise ValueError("KV cache tensor has no dims; expected a block dim")
        dim = _block_dim(t, num_blocks) if block_dim is None else block_dim
        if not 0 <= dim < t.dim():
            raise ValueError(
                f"block_dim {block_dim} out of range for KV cache shape {_desc(t)}"
            )
        if num_blocks is not None and t.shape[dim] != num_blocks:
            if dim != 0 or num_blocks <= 0 or t.shape[0] % num_blocks:
                raise ValueError(
                    f"KV cache shape {_desc(t)} has no block dim of {num_blocks} blocks"
                )
            t = t.unflatten(0, (num_blocks, t.shape[0] // num_blocks))
        inner = [
            (t.stride(d), t.shape[d])
            for d in range(t.dim())
            if d != dim and t.shape[d] > 1
        ]
        chunk_elems, num_chunks, chunk_stride = _runs(inner, kv_cache)
        size = t.element_size()
        return cls(
            num_blocks=t.shape[dim],
            block_stride=t.stride(dim) * size,
            num_chunks=num_chunks,
            chunk_stride=chunk_stride * size,
            chunk_bytes=chunk_elems * size,
            element_size=size,
        )


def _desc(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} (strides {tuple(t.stride())}, {t.dtype})"


def _block_dim(t: torch.Tensor, num_blocks: int | None) -> int:
    if t.dim() >= 2 and t.shape[0] == 2:
        if num_blocks is not None:
            if t.shape[0] != num_blocks and t.shape[1] == num_blocks:
                return 1
        elif t.dim() == 5:
            return 1
    return 0


def _runs(dims: list[tuple[int, int]], original: torch.Tensor) -> tuple[int, int, int]:
    """(elements per run, runs per block, run stride in elements) of the non-block dims.

    `dims` holds (stride, size) of every non-block dim of size > 1. The innermost dims
    must form one dense run; whatever stays outside must merge into a single evenly
    strided dim.
    """
    dims = sorted(dims, reverse=True)
    if any(a[0] == b[0] for a, b in zip(dims, dims[1:], strict=False)):
        raise ValueError(f"KV cache shape {_desc(original)} has overlapping dims")
    run = 1
    while dims and dims[-1][0] == run:
        run *= dims.pop()[1]
    if not dims:
        return run, 1, 0
    # The remaining dims must nest into one: outer stride == inner stride * inner size.
    stride, count = dims.pop()
    while dims and dims[-1][0] == stride * count:
        count *= dims.pop()[1]
    if dims or stride < run:
        raise ValueError(
            f"unsupported KV cache layout: shape {_desc(original)} does not split into "
            "evenly strided contiguous runs per block"
        )
    return run, count, stride


def canonical_layers(kv_caches: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Maps each layer name to the first name whose tensor views the same memory.

    vLLM lets layers share a KV cache (cross-layer KV sharing): the same tensor appears
    under several names. Those bytes are stored and loaded once. O(layers).
    """
    first: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    canonical: dict[str, str] = {}
    for name, t in kv_caches.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        canonical[name] = first.setdefault(key, name)
    return canonical
