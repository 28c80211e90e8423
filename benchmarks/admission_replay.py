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
        [--host-blocks 2000 4000 8000] [--limit N]
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


def run(docs: list[int], host_blocks: list[int], limit: int | None) -> dict[str, Any]:
    loop_rows = []
    for n in docs:
        requests = document_loop(n)
        for arm, make in ARMS.items():
            tier = make(HOST_BLOCKS_LOOP)
            blocks = replay_hits(requests, DEVICE_BLOCKS_LOOP, tier, n)
            loop_rows.append(
                {"docs": n, "arm": arm, "host_hit_tokens": blocks * BLOCK_TOKENS_LOOP}
            )
            print(f"loop {n:>3} {arm:<22} {blocks * 32:>7}", file=sys.stderr)
    trace = load_trace(limit)
    trace_rows = []
    for capacity in host_blocks:
        for arm, make in ARMS.items():
            blocks = replay_hits(trace, 1000, make(capacity), 0)
            row = {"host_blocks": capacity, "arm": arm, "host_hits": blocks}
            trace_rows.append(row)
            print(f"trace {capacity:>5} {arm:<22} {blocks:>7}", file=sys.stderr)
    return {
        "loop": {"device_blocks": DEVICE_BLOCKS_LOOP, "host_blocks": HOST_BLOCKS_LOOP,
                 "doc_blocks": DOC_BLOCKS, "rows": loop_rows},
        "trace": {"requests": len(trace), "gpu_blocks": 1000, "rows": trace_rows},
    }  # fmt: skip


def print_tables(result: dict[str, Any]) -> None:
    arms = list(ARMS)
    print("host-hit tokens, long-document re-read (device 256 blocks, host 960)")
    print(f"{'docs':>5} " + "".join(f"{a:>23}" for a in arms))
    by = {(r["docs"], r["arm"]): r["host_hit_tokens"] for r in result["loop"]["rows"]}
    for n in sorted({r["docs"] for r in result["loop"]["rows"]}):
        print(f"{n:>5} " + "".join(f"{by[n, a]:>23,}" for a in arms))
    print("host-hit blocks, conversation trace (device 1,000 blocks)")
    print(f"{'host':>5} " + "".join(f"{a:>23}" for a in arms))
    rows = result["trace"]["rows"]
    by = {(r["host_blocks"], r["arm"]): r["host_hits"] for r in rows}
    for c in sorted({r["host_blocks"] for r in rows}):
        print(f"{c:>5} " + "".join(f"{by[c, a]:>23,}" for a in arms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument(
        "--host-blocks", type=int, nargs="+", default=[2000, 4000, 8000]
    )
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--trace", type=Path, default=trace_replay.TRACE)
    args = parser.parse_args()
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}; pass --trace PATH")
    trace_replay.TRACE = args.trace
    result = run(args.docs, args.host_blocks, args.limit)
    print_tables(result)
    print_result(result)


if __name__ == "__main__":
    main()
