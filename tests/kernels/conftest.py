"""Kernel tests run the Triton kernels in interpreter mode on CPU tensors when there is
no GPU.

`TRITON_INTERPRET` is read when a kernel is decorated, so it is set here, before any
test module imports triton or `copy_kernels`. On a CUDA machine the kernels compile for
real and the tests use CUDA tensors.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Logical per-layer view [B, H, N, C] of vLLM 0.32; each layout
# is a permutation of the logical axes [L, B, H, N, C] into
# memory order (vllm.v1.kv_cache_layout.KVCacheLayout).
V032_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LEGACY_LAYOUTS = ("2N_NHD", "2N_HND", "N2_NHD", "MLA")
ALL_LAYOUTS = (*V032_LAYOUTS, *LEGACY_LAYOUTS)


def make_kv_caches(
    layout: str,
    num_layers: int = 3,
    num_blocks: int = 7,
    heads: int = 2,
    block_size: int = 4,
    head_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    device: str = DEVICE,
) -> tuple[dict[str, torch.Tensor], int]:
    """Per-layer KV caches shaped as vLLM hands them over, and the block dim of each
    tensor.

    Bytes are random: every byte of every block is distinct enough to catch a misplaced
    copy.
    """
    if layout in V032_LAYOUTS:
        order = V032_LAYOUTS[layout]
        logical = (num_layers, num_blocks, heads, block_size, 2 * head_dim)
        physical = _random((logical[i] for i in order), dtype, device)
        inverse = [order.index(i) for i in range(5)]
        full = physical.permute(*inverse)
        return {f"layer.{i}": full[i] for i in range(num_layers)}, 0
    caches: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        if layout == "2N_NHD":
            t = _random((2, num_blocks, block_size, heads, head_dim), dtype, device)
        elif layout == "2N_HND":
            t = _random((2, num_blocks, heads, block_size, head_dim), dtype, device)
            t = t.permute(0, 1, 3, 2, 4)
        elif layout == "N2_NHD":
            t = _random((num_blocks, 2, block_size, heads, head_dim), dtype, device)
        elif layout == "MLA":
            t = _random((num_blocks, block_size, heads * head_dim), dtype, device)
        else:
            raise AssertionError(layout)
        caches[f"layer.{i}"] = t
    return caches, 1 if layout.startswith("2N") else 0


def _random(shape: object, dtype: torch.dtype, device: str) -> torch.Tensor:
    shape = tuple(shape)  # type: ignore[arg-type]
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    if dtype.is_floating_point and dtype.itemsize > 1:
        # Keep values finite so comparisons of the typed tensor are meaningful too.
        raw.view(-1, dtype.itemsize)[:, -1] &= 0x3F
    return raw.view(dtype).view(shape)


def block_bytes(t: torch.Tensor, block_dim: int, block: int) -> torch.Tensor:
    """Reference: the bytes of one block in memory order (dims sorted by stride)."""
    b = t.select(block_dim, block)
    dims = sorted(range(b.dim()), key=lambda d: b.stride(d), reverse=True)
    return b.permute(*dims).contiguous().view(torch.uint8).reshape(-1).cpu()
