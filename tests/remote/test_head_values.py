"""Values per KV head through a real store: a TP=1 engine's blocks read by each rank
of a TP=2 engine and the reverse, over every store backend; a block short of one of
its heads is a miss."""

from __future__ import annotations

import time

import pytest
import torch

from vllm_cpu_offload.block_transfer import RemoteBlocks
from vllm_cpu_offload.remote.registry import open_store
from vllm_cpu_offload.testing.store_servers import UNBOUNDED_CALL_S
from vllm_cpu_offload.worker.block_values import BlockValues
from vllm_cpu_offload.worker.head_slices import HeadSlices
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.remote_io import RemoteIO, RemoteResults

from .conftest import HANG_S, wait_until_up

NAMESPACE = "vco-heads"
BLOCKS = 6
HEADS = 4
LAYERS = ("l0", "l1")


def _content() -> torch.Tensor:
    """Every layer's KV of every block, all heads: `[layers, B, H, N, C]`."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(len(LAYERS), BLOCKS, HEADS, 16, 8, generator=g)


def _rank(content: torch.Tensor, heads: range) -> tuple[dict, HostBuffer, HeadSlices]:
    """A rank holding `heads`: its device caches ([B, h, N, C], as vLLM's LBHNC
    views), its host buffer with block b in slot b, and its cuts."""
    caches = {
        name: content[i, :, heads.start : heads.stop].clone()
        for i, name in enumerate(LAYERS)
    }
    host = HostBuffer.for_kv_caches(caches, BLOCKS, num_blocks=BLOCKS, pin=False)
    slices = HeadSlices.for_kv_caches(
        host,
        caches,
        num_heads=len(heads),
        num_blocks=BLOCKS,
        blocks_per_host_block=1,
    )
    return caches, host, slices


def _io(url: str, host: HostBuffer, slices: HeadSlices, heads: range) -> RemoteIO:
    store = open_store(url, role="worker")
    wait_until_up(store)
    names = [f"pp0-h{h}" for h in heads]
    values = BlockValues(host, names, blocks_per_host_block=1, slices=slices)
    return RemoteIO(
        store,
        host,
        values,
        namespace=NAMESPACE,
        # Unbounded: a call that a loaded machine makes slow is no miss here.
        timeout_s=UNBOUNDED_CALL_S,
        max_queued_writes=BLOCKS,
    )


def _until(io: RemoteIO, job: int, fetched: bool) -> list[bool]:
    deadline = time.monotonic() + HANG_S
    while True:
        got: RemoteResults = io.poll()
        done = got.fetched if fetched else got.written
        if job in done:
            return done[job]
        assert time.monotonic() < deadline, "the store job never ended"
        time.sleep(0.01)


def _fill(host: HostBuffer, caches: dict) -> None:
    for name, layout in host.layouts.items():
        for b in range(BLOCKS):
            run = layout.block_view(caches[name], b).reshape(-1)
            host.layer_view(name)[b].copy_(run)


@pytest.fixture(params=["redis", "mooncake"])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "mooncake":
        return str(request.getfixturevalue("mooncake").url)
    return str(request.getfixturevalue("redis_url"))


def test_tp1_and_tp2_read_each_others_blocks(store_url: str) -> None:
    content = _content()
    keys = [f"{NAMESPACE}/0/{store_url[:5]}{i}" for i in range(BLOCKS)]
    # TP=1 writes blocks 0-2; the TP=2 ranks write blocks 3-5, each its heads.
    whole_caches, whole, whole_slices = _rank(content, range(HEADS))
    _fill(whole, whole_caches)
    tp1 = _io(store_url, whole, whole_slices, range(HEADS))
    tp1.write(RemoteBlocks(1, keys[:3], [0, 1, 2]))
    assert _until(tp1, 1, fetched=False) == [True] * 3
    ranks = []
    for r in range(2):
        heads = range(2 * r, 2 * r + 2)
        caches, host, slices = _rank(content, heads)
        _fill(host, caches)
        expected = host.tensor.clone()
        host.tensor.zero_()
        io = _io(store_url, host, slices, heads)
        ranks.append((io, host, expected))
        host.tensor[3:].copy_(expected[3:])
        io.write(RemoteBlocks(2, keys[3:], [3, 4, 5]))
        assert _until(io, 2, fetched=False) == [True] * 3
    # Each TP=2 rank reads TP=1's blocks: its own heads, as it would have stored them.
    for io, host, expected in ranks:
        io.fetch(RemoteBlocks(3, keys[:3], [0, 1, 2]))
        assert _until(io, 3, fetched=True) == [True] * 3
        assert torch.equal(host.tensor, expected)
    # TP=1 reads the blocks both TP=2 ranks wrote: every head joined.
    expected = whole.tensor.clone()
    whole.tensor[3:].zero_()
    tp1.fetch(RemoteBlocks(4, keys[3:], [3, 4, 5]))
    assert _until(tp1, 4, fetched=True) == [True] * 3
    assert torch.equal(whole.tensor, expected)
    for io in [tp1, *(io for io, _, _ in ranks)]:
        io.close()


def test_a_block_short_of_one_head_is_a_miss(redis_url: str) -> None:
    content = _content()
    keys = [f"{NAMESPACE}/0/short{i}" for i in range(2)]
    # Only the first TP=2 rank writes: heads 2 and 3 of the blocks are missing.
    caches, host, slices = _rank(content, range(2))
    _fill(host, caches)
    half = _io(redis_url, host, slices, range(2))
    half.write(RemoteBlocks(1, keys, [0, 1]))
    assert _until(half, 1, fetched=False) == [True, True]
    whole_caches, whole, whole_slices = _rank(content, range(HEADS))
    whole.tensor.fill_(7)
    tp1 = _io(redis_url, whole, whole_slices, range(HEADS))
    tp1.fetch(RemoteBlocks(2, keys, [0, 1]))
    assert _until(tp1, 2, fetched=True) == [False, False]
    # Nothing of a block that missed reaches its host block.
    assert bool((whole.tensor == 7).all())
    for io in (half, tp1):
        io.close()


def test_an_id_out_of_range_is_refused_before_the_store_is_called(
    redis_url: str,
) -> None:
    caches, host, slices = _rank(_content(), range(HEADS))
    io = _io(redis_url, host, slices, range(HEADS))
    with pytest.raises(ValueError, match="out of range"):
        io.values.write_spans([BLOCKS], 0)
    io.close()
