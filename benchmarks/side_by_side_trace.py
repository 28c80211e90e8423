"""Host-tier hit rate on the Mooncake conversation trace (benchmarks/side_by_side.py).

An engine cannot replay the trace's 12,000 requests on a CPU here, so the trace is
replayed through the host tiers themselves, with trace_replay.py's semantics (an LRU
device prefix cache of `--gpu-blocks` in front, write-through stores, host hits the
READY run right after the device hit): vLLM's own `CPUOffloadingManager` with its
default `lru` (the `vllm` arm), the same manager with the plugin's `prefix_aware` as
its `CachePolicy` loaded through `cache_policy_module_path` (`vllm+prefix_aware`), and
the plugin's pool with `prefix_aware` (`plugin`), at equal capacities; Belady's optimum
for the host tier as the limit. Run in the environment the engines run in (the patched
vLLM 0.33.0 overlay first on the path). Prints one `RESULT {json}` line.

    python -m benchmarks.side_by_side_trace --host-blocks 2000 4000 8000 \\
        [--trace .../mooncake_conversation_trace.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trace_replay  # noqa: E402
from trace_replay import (  # noqa: E402
    BeladyTier,
    HostTier,
    OurTier,
    VllmTier,
    load_trace,
    next_uses,
    replay,
)

from benchmarks.engine_runs import print_result  # noqa: E402

NATIVE_POLICIES = "vllm_cpu_offload.native_policies"


def tiers(upcoming: list[list[int]]) -> dict[str, Callable[[int], HostTier]]:
    return {
        "vllm": lambda c: VllmTier("lru", c),
        "vllm+prefix_aware": lambda c: VllmTier(
            "PrefixAwareCachePolicy", c, module_path=NATIVE_POLICIES
        ),
        "plugin": lambda c: OurTier("prefix_aware", c),
        "belady": lambda c: BeladyTier(c, upcoming),
    }


def run(host_blocks: list[int], gpu_blocks: int, limit: int | None) -> dict[str, Any]:
    trace = load_trace(limit)
    upcoming = next_uses(trace)
    rows = []
    for capacity in host_blocks:
        for name, make in tiers(upcoming).items():
            result = replay(trace, gpu_blocks, make(capacity))
            rows.append({"host_blocks": capacity, "tier": name, **result})
            print(
                f"{capacity:>6} {name:<18} host hits {result['host_hits']:>7} "
                f"saved {result['saved']:>7} ({result['seconds']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return {
        "requests": len(trace),
        "blocks": sum(map(len, trace)),
        "gpu_blocks": gpu_blocks,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--host-blocks", type=int, nargs="+", default=[2000, 4000, 8000]
    )
    parser.add_argument("--gpu-blocks", type=int, default=1000)
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--trace", type=Path, default=trace_replay.TRACE)
    args = parser.parse_args()
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}; pass --trace PATH")
    trace_replay.TRACE = args.trace
    print_result(run(args.host_blocks, args.gpu_blocks, args.limit))


if __name__ == "__main__":
    main()
