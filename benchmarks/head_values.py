"""What one value per KV head costs the shared tier's traffic, against one value per
host block: the same blocks written through and fetched back by a worker's store thread
(`RemoteIO`), on a real store on loopback.

Arms, on identical host blocks of a Llama-3-8B-shaped shard (32 layers, 8 KV heads of
128, 16-token blocks, bf16: 2 MiB a block; vLLM's `LBNHC` view, the layout where a
head's bytes are most scattered: one 512-byte run per token):
- `block`: one value per host block, written from host memory as it lies (what a
  context-parallel engine still does);
- `heads`: one value per KV head, cut into a staging buffer for the write and joined
  from the fetch's staging buffer (every other engine, so that any TP size reads it).

Per repetition each arm writes `--blocks` blocks under fresh keys and fetches them into
other host blocks; the arms alternate, their order flipping between repetitions. Medians
of the repetitions with their range, in GiB/s of KV moved.

    python benchmarks/head_values.py [--store mooncake|redis] [--blocks 48] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from typing import Any

import torch

from vllm_cpu_offload.block_transfer import RemoteBlocks
from vllm_cpu_offload.remote.registry import open_store
from vllm_cpu_offload.remote.store import wait_until_answering
from vllm_cpu_offload.testing.store_servers import MooncakeServers, RedisServer
from vllm_cpu_offload.worker.block_values import BlockValues
from vllm_cpu_offload.worker.head_slices import HeadSlices
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.remote_io import RemoteIO

LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
ARMS = ["block", "heads"]


def caches(num_blocks: int) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views of a `LBNHC` cache, random bf16."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.bfloat16,
    )
    layout = KVCacheLayout.LBNHC
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, LAYERS, layout
    )
    size = LAYERS * num_blocks * spec.page_size_bytes
    names = [f"l{i}" for i in range(LAYERS)]
    tensor = KVCacheTensor(
        size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return dict(zip(names, views, strict=True))


def make_io(
    url: str, arm: str, kv: dict[str, torch.Tensor], blocks: int
) -> tuple[RemoteIO, HostBuffer]:
    host = HostBuffer.for_kv_caches(kv, 2 * blocks, num_blocks=blocks, pin=False)
    host.tensor.copy_(torch.randint(0, 256, host.tensor.shape, dtype=torch.uint8))
    if arm == "heads":
        slices = HeadSlices.for_kv_caches(
            host, kv, num_heads=HEADS, num_blocks=blocks, blocks_per_host_block=1
        )
        names = [f"pp0-h{h}" for h in range(HEADS)]
        values = BlockValues(host, names, blocks_per_host_block=1, slices=slices)
    else:
        values = BlockValues(host, ["tp0-pp0"], blocks_per_host_block=1)
    store = open_store(url, role="worker")
    assert wait_until_answering(store, 30.0), "the store never answered"
    io = RemoteIO(
        store, host, values, namespace="vco-bench", timeout_s=30.0,
        max_queued_writes=2 * blocks,
    )  # fmt: skip
    return io, host


def wait_for(io: RemoteIO, job: int, fetched: bool) -> list[bool]:
    while True:
        got = io.poll()
        done = got.fetched if fetched else got.written
        if job in done:
            return done[job]
        time.sleep(0.0005)


def one_round(
    io: RemoteIO, host: HostBuffer, blocks: int, job: int
) -> tuple[float, float]:
    """Seconds to write `blocks` host blocks, and to fetch them into the others (then
    checked equal)."""
    host.tensor[blocks:].zero_()
    keys = [f"vco-bench/0/{uuid.uuid4().hex}" for _ in range(blocks)]
    start = time.perf_counter()
    io.write(RemoteBlocks(job, keys, list(range(blocks))))
    assert all(wait_for(io, job, fetched=False)), "a write failed"
    wrote = time.perf_counter() - start
    start = time.perf_counter()
    io.fetch(RemoteBlocks(job + 1, keys, list(range(blocks, 2 * blocks))))
    assert all(wait_for(io, job + 1, fetched=True)), "a fetch missed"
    fetched = time.perf_counter() - start
    assert torch.equal(host.tensor[:blocks], host.tensor[blocks:]), "wrong bytes"
    return wrote, fetched


def summary(seconds: list[float], nbytes: int) -> dict[str, float]:
    rates = [nbytes / s / (1 << 30) for s in seconds]
    return {
        "median_gib_s": round(statistics.median(rates), 3),
        "min": round(min(rates), 3),
        "max": round(max(rates), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=["mooncake", "redis"], default="mooncake")
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    servers: Any = (
        MooncakeServers("4GB") if args.store == "mooncake" else RedisServer()
    ).start()
    try:
        kv = caches(args.blocks)
        ios = {arm: make_io(servers.url, arm, kv, args.blocks) for arm in ARMS}
        for io, host in ios.values():  # warm: connections, first registrations
            one_round(io, host, args.blocks, 1_000_000)
        times: dict[str, dict[str, list[float]]] = {
            arm: {"write": [], "fetch": []} for arm in ios
        }
        job = 0
        for rep in range(args.reps):
            order = ARMS if rep % 2 == 0 else ARMS[::-1]
            for arm in order:
                job += 2
                wrote, fetched = one_round(*ios[arm], args.blocks, job)
                times[arm]["write"].append(wrote)
                times[arm]["fetch"].append(fetched)
        block_bytes = ios["block"][0].values.block_bytes
        nbytes = args.blocks * block_bytes
        result = {
            "store": args.store,
            "blocks": args.blocks,
            "block_mib": block_bytes / (1 << 20),
            "reps": args.reps,
            **{
                f"{arm}_{what}": summary(times[arm][what], nbytes)
                for arm in times
                for what in ("write", "fetch")
            },
        }
        print(json.dumps(result, indent=1))
        for io, _ in ios.values():
            io.close()
    finally:
        servers.stop()


if __name__ == "__main__":
    main()
