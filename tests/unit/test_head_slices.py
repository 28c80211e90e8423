"""Host blocks cut into one value per KV head and joined back, on the per-layer views
vLLM 0.32 itself builds for every KV cache layout: a head's value holds exactly that
head's bytes of every layer, whatever the layout and the TP size that wrote it."""

from __future__ import annotations

import pytest
import torch

from vllm_cpu_offload.worker.head_slices import HeadSliceError, HeadSlices
from vllm_cpu_offload.worker.host_buffer import HostBuffer

vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")
KVCacheLayout = pytest.importorskip("vllm.v1.kv_cache_layout").KVCacheLayout

NUM_BLOCKS = 5
LAYERS = 3
HEADS = 4


def _caches(
    layout_name: str, heads: int, kernel_block_size: int | None = None
) -> dict[str, torch.Tensor]:
    """The views vLLM builds of `LAYERS` layers of `heads` KV heads in `layout_name`."""
    spec = vllm_kv.FullAttentionSpec(
        block_size=16, num_kv_heads=heads, head_size=8, dtype=torch.bfloat16
    )
    layout = KVCacheLayout[layout_name]
    layer_stride, block_stride, *_ = vllm_kv.compute_layout_strides(
        spec, NUM_BLOCKS, LAYERS, layout
    )
    size = LAYERS * NUM_BLOCKS * spec.page_size_bytes
    names = [f"l{i}" for i in range(LAYERS)]
    tensor = vllm_kv.KVCacheTensor(
        size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(size, dtype=torch.int8)
    views = vllm_kv.create_kv_cache_views(
        raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=kernel_block_size
    )
    return dict(zip(names, views, strict=True))


def _fill(caches: dict[str, torch.Tensor], content: torch.Tensor, first: int) -> None:
    """Writes heads `first...` of `content` (`[layers, B, all heads, N, C]`) into
    `caches` (its kernel blocks, if split, side by side)."""
    for i, t in enumerate(caches.values()):
        heads = t.shape[1]
        mine = content[i, :, first : first + heads]  # [B, h, N, C]
        r = t.shape[0] // NUM_BLOCKS
        # [B, h, r*n, C] -> [B*r, h, n, C]
        split = mine.unflatten(2, (r, -1)).permute(0, 2, 1, 3, 4).flatten(0, 1)
        t.copy_(split)


def _stored(caches: dict[str, torch.Tensor], slots: int = 8) -> HostBuffer:
    """A host buffer holding device block b in slot 7 - b, copied run by run."""
    host = HostBuffer.for_kv_caches(caches, slots, num_blocks=NUM_BLOCKS, pin=False)
    for name, layout in host.layouts.items():
        for b in range(NUM_BLOCKS):
            run = layout.block_view(caches[name], b).reshape(-1)
            host.layer_view(name)[slots - 1 - b].copy_(run)
    return host


def _content() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(LAYERS, NUM_BLOCKS, HEADS, 16, 16, generator=g).to(
        torch.bfloat16
    )


def _values(host: HostBuffer, caches: dict[str, torch.Tensor], heads: int, k: int = 1):
    slices = HeadSlices.for_kv_caches(
        host, caches, num_heads=heads, num_blocks=NUM_BLOCKS, blocks_per_host_block=k
    )
    blocks = [(7 - b) // k for b in range(0, NUM_BLOCKS, k)]
    out = torch.empty(len(blocks), heads, slices.value_bytes, dtype=torch.uint8)
    slices.cut(blocks, out)
    return slices, blocks, out


@pytest.mark.parametrize("layout_name", [m.name for m in KVCacheLayout])
def test_a_value_is_one_heads_bytes_of_every_layer(layout_name: str) -> None:
    content = _content()
    caches = _caches(layout_name, HEADS)
    _fill(caches, content, 0)
    _, _, out = _values(_stored(caches), caches, HEADS)
    for b in range(NUM_BLOCKS):
        for h in range(HEADS):
            expected = torch.cat(
                [content[i, b, h].reshape(-1) for i in range(LAYERS)]
            ).view(torch.uint8)
            assert torch.equal(out[b, h], expected), (b, h)


@pytest.mark.parametrize(
    ("writer", "reader"), [("LBNHC", "LBHNC"), ("BLHNC", "LHBNC"), ("BHLNC", "BLNHC")]
)
def test_tp1_values_join_into_each_tp2_rank(writer: str, reader: str) -> None:
    # A TP=1 engine writes 4 heads per block; each rank of a TP=2 engine, even in
    # another layout, reads its 2 and holds what it would have computed itself.
    content = _content()
    whole = _caches(writer, HEADS)
    _fill(whole, content, 0)
    _, _, written = _values(_stored(whole), whole, HEADS)
    for rank in range(2):
        own = _caches(reader, HEADS // 2)
        _fill(own, content, rank * 2)
        expected = _stored(own)
        target = HostBuffer.for_kv_caches(own, 8, num_blocks=NUM_BLOCKS, pin=False)
        slices = HeadSlices.for_kv_caches(
            target, own, num_heads=2, num_blocks=NUM_BLOCKS, blocks_per_host_block=1
        )
        blocks = [7 - b for b in range(NUM_BLOCKS)]
        slices.join(written[:, rank * 2 : rank * 2 + 2].contiguous(), blocks)
        for name in target.layouts:
            for b in blocks:
                assert torch.equal(
                    target.layer_view(name)[b], expected.layer_view(name)[b]
                ), (rank, name, b)
        # And cutting the rank's own copy gives the same values back.
        _, _, again = _values(expected, own, 2)
        assert torch.equal(again, written[:, rank * 2 : rank * 2 + 2])


def test_kernel_blocks_and_host_blocks_of_several_slots() -> None:
    # Blocks served as two kernel blocks each, two slots per host block: a value is
    # the head of slot 0's layers, then slot 1's.
    content = _content()
    caches = _caches("LBNHC", HEADS, kernel_block_size=8)
    assert next(iter(caches.values())).shape[0] == 2 * NUM_BLOCKS
    _fill(caches, content, 0)
    host = HostBuffer.for_kv_caches(caches, 8, num_blocks=NUM_BLOCKS, pin=False)
    for name, layout in host.layouts.items():
        for b in range(4):
            run = layout.block_view(caches[name], b).reshape(-1)
            host.layer_view(name)[b].copy_(run)
    slices = HeadSlices.for_kv_caches(
        host, caches, num_heads=HEADS, num_blocks=NUM_BLOCKS, blocks_per_host_block=2
    )
    out = torch.empty(2, HEADS, slices.value_bytes, dtype=torch.uint8)
    slices.cut([1, 0], out)
    for i, host_block in enumerate([1, 0]):
        for h in range(HEADS):
            expected = torch.cat(
                [
                    content[layer, 2 * host_block + j, h].reshape(-1)
                    for j in range(2)
                    for layer in range(LAYERS)
                ]
            ).view(torch.uint8)
            assert torch.equal(out[i, h], expected), (host_block, h)
    # Joined into empty slots, the values give back the blocks' bytes.
    before = host.tensor[:4].clone()
    host.tensor[:4].zero_()
    slices.join(out, [1, 0])
    assert torch.equal(host.tensor[:4], before)


def test_a_cache_of_other_heads_is_refused_by_name() -> None:
    caches = _caches("LBNHC", HEADS)
    host = HostBuffer.for_kv_caches(caches, 2, num_blocks=NUM_BLOCKS, pin=False)
    with pytest.raises(HeadSliceError, match="layer l0: .* 2 KV heads"):
        HeadSlices.for_kv_caches(
            host, caches, num_heads=2, num_blocks=NUM_BLOCKS, blocks_per_host_block=1
        )
