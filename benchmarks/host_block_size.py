"""Host blocks of k device blocks (offload_block_size): hit rate on the Mooncake trace.

The trace replay of trace_replay.py (a GPU prefix cache of G blocks in front of the host
tier, one request at a time, write-through stores), with the host tier in units of k
trace blocks, as the connector runs it with `offload_block_size = k x block size`:
  - a host block is keyed by its last block's hash and holds k blocks; the tier holds C
    // k of them, the same bytes for every k;
  - a host hit starts in the host block that holds the first block past the GPU hit and
    ends at a host block's end, so up to k - 1 blocks of a reusable prefix are lost at
    the end of each hit;
  - stores cover whole host blocks only: the last (full) blocks of a request that do not
    fill a host block are never stored.
Prints blocks saved from prefill (GPU hits + host hits) per k and host size, and the
time the pool took (lookups, pins, touches, stores) per request.

Usage: python benchmarks/host_block_size.py [--k 1 2 4 8] [--host-blocks 2000 4000 8000]
           [--gpu-blocks 1000] [--policy prefix_aware] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from trace_replay import RESULTS, GpuPrefixCache, load_trace  # noqa: E402

from vllm_cpu_offload.scheduler.block_pool import HostBlockPool  # noqa: E402
from vllm_cpu_offload.scheduler.policies.registry import make_policy  # noqa: E402


class UnitTier:
    """The host tier in host blocks of k trace blocks."""

    def __init__(self, policy: str, capacity_blocks: int, k: int) -> None:
        units = capacity_blocks // k
        self.k = k
        self.pool = HostBlockPool(
            units, make_policy(policy, units), record_events=False
        )
        self.seconds = 0.0

    def serve(self, keys: Sequence[int], gpu_hits: int) -> int:
        start = time.perf_counter()
        k, pool = self.k, self.pool
        units = [keys[u * k + k - 1] for u in range(len(keys) // k)]
        first_unit = gpu_hits // k
        n = pool.count_hits(units[first_unit:])
        hit = (first_unit + n) * k - gpu_hits if n else 0
        if n:
            loaded = units[first_unit : first_unit + n]
            pool.pin(loaded)
            pool.unpin(loaded)
        pool.touch(units[: gpu_hits // k], by_device=True)
        allocated = pool.allocate_for_store(units, None)
        pool.complete_store([key for key, _ in allocated], True)
        self.seconds += time.perf_counter() - start
        return hit


def replay(trace: list[list[int]], gpu_blocks: int, tier: UnitTier) -> dict[str, float]:
    gpu = GpuPrefixCache(gpu_blocks)
    gpu_hits = host_hits = 0
    for keys in trace:
        g = gpu.hit(keys)
        host_hits += tier.serve(keys, g)
        gpu.finish(keys)
        gpu_hits += g
    return {"gpu_hits": gpu_hits, "host_hits": host_hits, "saved": gpu_hits + host_hits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--host-blocks", type=int, nargs="+", default=[2000, 4000, 8000, 16000]
    )
    parser.add_argument("--gpu-blocks", type=int, default=1000)
    parser.add_argument("--policy", default="prefix_aware")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()

    trace = load_trace(args.limit)
    total = sum(map(len, trace))
    print(
        f"{len(trace)} requests, {total} blocks; GPU {args.gpu_blocks} blocks; "
        f"{args.policy}"
    )
    print(
        f"{'host C':>7} {'k':>3} {'host hits':>9} {'saved':>7} {'saved %':>8} "
        f"{'vs k=1':>7} {'us/request':>10}"
    )
    rows = []
    for capacity in args.host_blocks:
        base = None
        for k in args.k:
            tier = UnitTier(args.policy, capacity, k)
            result = replay(trace, args.gpu_blocks, tier)
            base = base if base is not None else result["saved"]
            us = 1e6 * tier.seconds / len(trace)
            rows.append(
                {"host_blocks": capacity, "k": k, "pool_us_per_request": us, **result}
            )
            print(
                f"{capacity:>7} {k:>3} {result['host_hits']:>9} {result['saved']:>7} "
                f"{100 * result['saved'] / total:>7.2f}% "
                f"{result['saved'] / base:>7.3f} {us:>10.1f}",
                flush=True,
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "host_block_size.json"
    meta = {"requests": len(trace), "blocks": total, "gpu_blocks": args.gpu_blocks,
            "policy": args.policy, "machine": platform.platform()}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
