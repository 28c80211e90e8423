"""One policy against the saved hit-rate table, in about a minute.

Replays the policy (a built-in name or an import path) on every workload and capacity of
the hit-rate table, two cells at a time, and prints each cell's share of the LRU ->
Belady gap beside the best anchor's (LRU, ARC, LIRS, S3-FIFO), `prefix_aware`'s and
`oracle-admit`'s from docs/figures/hit_rate_table.json, then the shortfalls against
the best anchor and PR 11532's loop at its own scale. For trying a candidate before
running the whole table (benchmarks/hit_rate_table.py).

Usage: python benchmarks/policy_check.py POLICY [--workloads W ...]
           [--capacities C ...] [--out RESULT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def _cell(args: tuple[str, str, int]) -> dict:
    import hit_rate_table
    from trace_replay import replay
    from workloads import WORKLOADS

    policy, workload_name, capacity = args
    workload = WORKLOADS[workload_name]()
    tier = hit_rate_table.tier_factory(policy, [])(capacity)
    result = replay(workload.requests, workload.device_blocks, tier)
    return {
        "workload": workload_name,
        "host_blocks": capacity,
        "policy": policy,
        **result,
    }


def main() -> None:
    from hit_rate_table import ANCHORS, LongDocumentLoop

    parser = argparse.ArgumentParser()
    parser.add_argument("policy")
    parser.add_argument("--workloads", nargs="+", default=None)
    parser.add_argument("--capacities", type=int, nargs="+", default=None)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    base = json.loads((REPO / "docs/figures/hit_rate_table.json").read_text())
    cells: dict[tuple[str, int], dict[str, dict]] = {}
    for row in base["rows"]:
        cells.setdefault((row["workload"], row["host_blocks"]), {})[row["policy"]] = row
    keys = [
        k
        for k in cells
        if (args.workloads is None or k[0] in args.workloads)
        and (args.capacities is None or k[1] in args.capacities)
    ]
    policy = args.policy
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(_cell, [(policy, w, c) for w, c in keys]))
    speedups = [LongDocumentLoop(n).speedup(policy) for n in LongDocumentLoop.DOCS]
    print(f"longdoc speedups 16/32/64: {speedups}")
    falls, below = [], 0
    for (w, c), row in zip(keys, results, strict=True):
        cell = cells[(w, c)]
        low, high = cell["lru"]["saved"], cell["belady"]["saved"]
        if cell["lru"]["gap_closed"] is None:
            continue
        gap = 100 * (row["saved"] - low) / (high - low)
        best = max(100 * cell[a]["gap_closed"] for a in ANCHORS)
        pa = 100 * cell["prefix_aware"]["gap_closed"]
        oa = 100 * cell["oracle-admit"]["gap_closed"]
        falls.append(best - gap)
        below += gap < -1
        print(
            f"{w:>13} {c:>6}: {gap:6.1f}  best {best:6.1f}  pa {pa:6.1f}  "
            f"oracle {oa:6.1f}  short {best - gap:6.1f}"
        )
        row["gap_closed"] = gap / 100
    print(
        f"within 1: {sum(f <= 1 for f in falls)}/{len(falls)}  worst {max(falls):.1f}"
        f"  mean short {sum(falls) / len(falls):.1f}  below LRU {below}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": results}, indent=1))


if __name__ == "__main__":
    main()
