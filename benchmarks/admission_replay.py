"""Per-key admission through vLLM's own `CPUOffloadingManager`: host-hit tokens of each
store rule on the long-document loop and on the Mooncake conversation trace, with no
engine (the tiers replay the requests, trace_replay.py's semantics: an LRU device
prefix cache in front, write-through stores, host hits the READY run right after the
device hit).

Arms, each at the same host capacity:
- `lru`, `arc`: vLLM's built-in policies;
- `lru+threshold2`: `lru` with `store_threshold=2` (vLLM's manager-level admission);
- `doorkeeper_lru`: the series' [3/8] in-tree user of `CachePolicy.admit` (while the
  cache is full, a new key gets in only if it was refused before);
- `prefix_aware-no-admit`: the plugin's `PrefixAwareCachePolicy` as vLLM's
  `CachePolicy` is today, victims only (`admit` left to `CachePolicy`'s default, so the
  manager never asks it);
- `prefix_aware`: the same policy with its admission, asked through `admit`;
- `plugin`: the plugin's own pool with `prefix_aware`.

The loop is PR 11532's at the scale of docs/side_by_side.md (a): N documents of 31
blocks of 32 tokens, read once in order, then re-read in the order
benchmarks/side_by_side_engine.py draws; a device cache of 256 blocks, a host tier of
960 (the chunks vLLM's engine log reports there). Host-hit tokens count the re-read.
Needs vLLM 0.33.0 with the series' [3/8] (scripts/patched_vllm033.sh) first on the path:

    PYTHONPATH="$OVERLAY:$PWD" .venv-vllm033/bin/python \\
        -m benchmarks.admission_replay [--trace PATH] [--docs 16 32 64] \\
        [--device-blocks 256] [--loop-host-blocks 960] \\
        [--host-blocks 2000 4000 8000 | --host-blocks] [--limit N]
    # prints two tables and one `RESULT {json}` line
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trace_replay  # noqa: E402
from trace_replay import (  # noqa: E402
    GpuPrefixCache,
    HostTier,
    OurTier,
    VllmTier,
    load_trace,
)
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy  # noqa: E402

from benchmarks.engine_runs import print_result  # noqa: E402
from vllm_cpu_offload.native_policies import PrefixAwareCachePolicy  # noqa: E402
from vllm_cpu_offload.testing.tiny_model import random_token_ids  # noqa: E402

NATIVE_POLICIES = "vllm_cpu_offload.native_policies"
DOC_BLOCKS = 31  # 1,000 tokens in blocks of 32: 31 full blocks
BLOCK_TOKENS_LOOP = 32
DEVICE_BLOCKS_LOOP = 256
HOST_BLOCKS_LOOP = 960


class PrefixAwareNoAdmitCachePolicy(PrefixAwareCachePolicy):
    """`prefix_aware` as vLLM's `CachePolicy` is without [3/8]: never asked to admit."""

    # vLLM without [3/8] (the type checker's 0.32) has no CachePolicy.admit.
    admit = CachePolicy.admit  # type: ignore[assignment,attr-defined]


ARMS: dict[str, Callable[[int], HostTier]] = {
    "lru": lambda c: VllmTier("lru", c),
    "arc": lambda c: VllmTier("arc", c),
    "lru+threshold2": lambda c: VllmTier("lru", c, store_threshold=2),
    "doorkeeper_lru": lambda c: VllmTier("doorkeeper_lru", c),
    "prefix_aware-no-admit": lambda c: VllmTier(
        "PrefixAwareNoAdmitCachePolicy", c, module_path="benchmarks.admission_replay"
    ),
    "prefix_aware": lambda c: VllmTier(
        "PrefixAwareCachePolicy", c, module_path=NATIVE_POLICIES
    ),
    "plugin": lambda c: OurTier("prefix_aware", c),
}


def document_loop(num_docs: int) -> list[list[int]]:
    """The warm-up and the re-read, as lists of block keys; the re-read's order is the
    one side_by_side_engine.run_reread draws for `num_docs`."""
    rng = random.Random(num_docs)
    for _ in range(num_docs):
        random_token_ids(rng, 1000)  # the engine's documents: same draws, same order
    order = list(range(num_docs))
    rng.shuffle(order)
    docs = [list(range(d * DOC_BLOCKS, (d + 1) * DOC_BLOCKS)) for d in range(num_docs)]
    return docs + [docs[i] for i in order]


def replay_hits(
    requests: Sequence[Sequence[int]], device_blocks: int, tier: HostTier, skip: int
) -> int:
    """Host-hit blocks of the requests after the first `skip`."""
    device = GpuPrefixCache(device_blocks)
    hits = 0
    for index, keys in enumerate(requests):
        g = device.hit(keys)
        h = tier.serve(index, keys, g)
        device.finish(keys)
        if index >= skip:
            hits += h
    return hits


def loop_rows(
    docs: Sequence[int], device_blocks: Sequence[int], host_blocks: Sequence[int]
) -> list[dict[str, Any]]:
    """Host-hit tokens of the re-read for every arm at each size."""
    rows = []
    for n in docs:
        requests = document_loop(n)
        for device in device_blocks:
            for capacity in host_blocks:
                for arm, make in ARMS.items():
                    tokens = BLOCK_TOKENS_LOOP * replay_hits(
                        requests, device, make(capacity), n
                    )
                    rows.append({"docs": n, "device_blocks": device,
                                 "host_blocks": capacity, "arm": arm,
                                 "host_hit_tokens": tokens})  # fmt: skip
                    print(f"loop {n:>3} {device:>5} {capacity:>5} {arm:<22} "
                          f"{tokens:>7}", file=sys.stderr)  # fmt: skip
    return rows


def run(
    docs: list[int],
    device_blocks: list[int],
    loop_host_blocks: list[int],
    host_blocks: list[int],
    limit: int | None,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "loop": {"device_blocks": device_blocks, "host_blocks": loop_host_blocks,
                 "doc_blocks": DOC_BLOCKS,
                 "rows": loop_rows(docs, device_blocks, loop_host_blocks)},
        "trace": None,
    }  # fmt: skip
    if not host_blocks:
        return result
    trace = load_trace(limit)
    trace_rows = []
    for capacity in host_blocks:
        for arm, make in ARMS.items():
            blocks = replay_hits(trace, 1000, make(capacity), 0)
            row = {"host_blocks": capacity, "arm": arm, "host_hits": blocks}
            trace_rows.append(row)
            print(f"trace {capacity:>5} {arm:<22} {blocks:>7}", file=sys.stderr)
    result["trace"] = {"requests": len(trace), "gpu_blocks": 1000, "rows": trace_rows}
    return result


def print_tables(result: dict[str, Any]) -> None:
    arms = list(ARMS)
    rows = result["loop"]["rows"]
    by = {
        (r["docs"], r["device_blocks"], r["host_blocks"], r["arm"]): r[
            "host_hit_tokens"
        ]
        for r in rows
    }
    for device in result["loop"]["device_blocks"]:
        for capacity in result["loop"]["host_blocks"]:
            print(f"host-hit tokens, long-document re-read (device {device} blocks, "
                  f"host {capacity})")  # fmt: skip
            print(f"{'docs':>5} " + "".join(f"{a:>23}" for a in arms))
            for n in sorted({r["docs"] for r in rows}):
                cells = "".join(f"{by[n, device, capacity, a]:>23,}" for a in arms)
                print(f"{n:>5} {cells}")
    if result["trace"] is None:
        return
    print("host-hit blocks, conversation trace (device 1,000 blocks)")
    print(f"{'host':>5} " + "".join(f"{a:>23}" for a in arms))
    rows = result["trace"]["rows"]
    hits = {(r["host_blocks"], r["arm"]): r["host_hits"] for r in rows}
    for c in sorted({r["host_blocks"] for r in rows}):
        print(f"{c:>5} " + "".join(f"{hits[c, a]:>23,}" for a in arms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument(
        "--device-blocks", type=int, nargs="+", default=[DEVICE_BLOCKS_LOOP],
        help="the loop's device prefix cache, blocks",
    )  # fmt: skip
    parser.add_argument(
        "--loop-host-blocks", type=int, nargs="+", default=[HOST_BLOCKS_LOOP],
        help="the loop's host tier, blocks",
    )  # fmt: skip
    parser.add_argument(
        "--host-blocks", type=int, nargs="*", default=[2000, 4000, 8000],
        help="the trace's host tier, blocks; none: no trace",
    )  # fmt: skip
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--trace", type=Path, default=trace_replay.TRACE)
    args = parser.parse_args()
    if args.host_blocks and not args.trace.is_file():
        parser.error(f"no trace at {args.trace}; pass --trace PATH")
    trace_replay.TRACE = args.trace
    result = run(
        args.docs, args.device_blocks, args.loop_host_blocks, args.host_blocks,
        args.limit,
    )  # fmt: skip
    print_tables(result)
    print_result(result)


if __name__ == "__main__":
    main()
