"""KVLayout: every block's bytes are found from the tensor's shape and strides alone."""

from __future__ import annotations

import pytest
import torch

from vllm_cpu_offload.worker.kv_layout import KVLayout, canonical_layers


def _runs_of(t: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The bytes the layout says block b holds: `[blocks, runs * chunk_bytes]`."""
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    view = storage.as_strided(
        (layout.num_blocks, layout.num_chunks, layout.chunk_bytes),
        (layout.block_stride, layout.chunk_stride or 1, 1),
        t.storage_offset() * t.element_size(),
    )
    return view.reshape(layout.num_blocks, -1)


def _memory_order(t: torch.Tensor, block_dim: int, b: int) -> torch.Tensor:
    block = t.select(block_dim, b)
    dims = sorted(range(block.dim()), key=block.stride, reverse=True)
    return block.permute(*dims).contiguous().view(torch.uint8).reshape(-1)


def _random(
    shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def test_flash_nhd_legacy_two_first() -> None:
    # (2, num_blocks, block_size, H, D): K and V are two runs per block.
    t = _random((2, 10, 16, 8, 128))
    layout = KVLayout.from_tensor(t)
    page = 16 * 8 * 128 * 2
    assert layout == KVLayout(10, page, 2, 10 * page, page, 2)
    assert layout.block_bytes == 2 * page


def test_hnd_stride_order_is_still_one_run_per_k_and_v() -> None:
    # Physical (2, N, H, bs, D) seen as logical (2, N, bs, H, D): each K/V
    # block is dense.
    t = _random((2, 10, 8, 16, 128)).permute(0, 1, 3, 2, 4)
    layout = KVLayout.from_tensor(t)
    assert (layout.num_chunks, layout.chunk_bytes) == (2, 16 * 8 * 128 * 2)


def test_blocks_first_and_mla_are_one_run() -> None:
    # (num_blocks, 2, ...) and MLA-like (num_blocks, block_size, D): one dense run.
    assert KVLayout.from_tensor(_random((10, 2, 16, 8, 64))).num_chunks == 1
    # fp8 as uint8
    mla = KVLayout.from_tensor(torch.zeros(10, 16, 576, dtype=torch.uint8))
    assert mla == KVLayout(10, 16 * 576, 1, 0, 16 * 576, 1)


def test_fp8_dtype_counts_bytes() -> None:
    # A float8_e4m3fn cache: one byte per element.
    t = torch.zeros(4, 2, 16, 32, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert KVLayout.from_tensor(t).block_bytes == 2 * 16 * 32


def test_kernel_blocks_group_into_manager_blocks() -> None:
    # 40 kernel blocks of 4 manager blocks' worth: block_stride covers all ten.
    t = _random((40, 2, 4, 16))
    layout = KVLayout.from_tensor(t, num_blocks=4)
    assert layout.num_blocks == 4
    assert layout.block_stride == layout.block_bytes == 10 * 2 * 4 * 16 * 2


def test_block_dim_hint() -> None:
    # num_blocks == 2 would be ambiguous: an explicit block_dim decides.
    t = _random((2, 2, 4, 8))
    assert KVLayout.from_tensor(t, block_dim=1).num_chunks == 2
    assert KVLayout.from_tensor(t, block_dim=0).num_chunks == 1


@pytest.mark.parametrize(
    "t",
    [
        torch.zeros(4, 8, 6)[:, ::2, ::2],  # two strided dims: not one run per chunk
        torch.zeros(4, 8).expand(3, 4, 8).permute(1, 0, 2),  # overlapping (stride 0)
    ],
)
def test_unsupported_layouts_raise_naming_the_shape(t: torch.Tensor) -> None:
    # A layout we cannot describe is refused, naming the shape.
    with pytest.raises(ValueError, match=r"\(4, "):
        KVLayout.from_tensor(t)


def test_wrong_num_blocks_raises() -> None:
    with pytest.raises(ValueError, match="7 blocks"):
        KVLayout.from_tensor(torch.zeros(10, 4), num_blocks=7)


def test_canonical_layers_merges_shared_caches() -> None:
    # Cross-layer KV sharing: two names, one tensor.
    a, b = torch.zeros(4, 8), torch.zeros(4, 8)
    assert canonical_layers({"x": a, "y": b, "z": a}) == {"x": "x", "y": "y", "z": "x"}


# ---- the views vLLM 0.32 itself builds, for every KVCacheLayout ----

vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")
KVCacheLayout = pytest.importorskip("vllm.v1.kv_cache_layout").KVCacheLayout


def _vllm_views(
    layout_name: str,
    num_blocks: int,
    padded: bool = False,
    kernel_block_size: int | None = None,
) -> tuple[list[torch.Tensor], object]:
    spec = vllm_kv.FullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.bfloat16,
        page_size_padded=16 * 2 * 64 * 2 + 512 if padded else None,
    )
    layout = KVCacheLayout[layout_name]
    num_layers = 3
    layer_stride, block_stride, *_ = vllm_kv.compute_layout_strides(
        spec, num_blocks, num_layers, layout
    )
    size = num_layers * num_blocks * spec.page_size_bytes
    tensor = vllm_kv.KVCacheTensor(
        size=size,
        layers=[f"l{i}" for i in range(num_layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8)
    views = vllm_kv.create_kv_cache_views(
        raw, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size
    )
    return views, spec


@pytest.mark.parametrize("layout_name", [m.name for m in KVCacheLayout])
def test_every_vllm_layout_maps_each_block(layout_name: str) -> None:
    # vLLM's own per-layer views: the derived runs are exactly each block's bytes.
    views, spec = _vllm_views(layout_name, num_blocks=5)
    for t in views:
        layout = KVLayout.from_tensor(t, num_blocks=5)
        assert layout.block_bytes == spec.real_page_size_bytes  # type: ignore[attr-defined]
        runs = _runs_of(t, layout)
        for b in range(5):
            assert torch.equal(runs[b], _memory_order(t, 0, b))


@pytest.mark.parametrize("layout_name", ["LBHNC", "BLHNC"])
def test_vllm_padded_pages_copy_only_the_data(layout_name: str) -> None:
    # Padded pages (hybrid models): the block stride skips the padding, the runs do
    # not hold it.
    views, spec = _vllm_views(layout_name, num_blocks=4, padded=True)
    layout = KVLayout.from_tensor(views[1], num_blocks=4)
    assert layout.block_bytes == spec.real_page_size_bytes  # type: ignore[attr-defined]
    assert layout.block_stride > layout.block_bytes


def test_vllm_kernel_block_split() -> None:
    # Manager blocks of 16 tokens served as 8-token kernel blocks: ids stay manager ids.
    views, spec = _vllm_views("LBNHC", num_blocks=4, kernel_block_size=8)
    assert views[0].shape[0] == 8
    layout = KVLayout.from_tensor(views[0], num_blocks=4)
    assert (layout.num_blocks, layout.num_chunks) == (4, 1)
    assert layout.block_bytes == spec.real_page_size_bytes  # type: ignore[attr-defined]


def test_block_view_is_the_blocks_bytes() -> None:
    # block_view reads one block's runs straight from the tensor's storage.
    t = torch.randn(2, 6, 4, 8).to(torch.float16)  # (2, N, ...): K and V runs
    layout = KVLayout.from_tensor(t, block_dim=1)
    assert torch.equal(layout.block_view(t, 3).reshape(-1), _memory_order(t, 1, 3))
