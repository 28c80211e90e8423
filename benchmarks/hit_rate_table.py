"""Every eviction policy on every workload at every host capacity: the hit-rate table.

Replays each workload of benchmarks/workloads.py with trace_replay.py's semantics: an
LRU prefix cache on the device in front (the workload's own size), the host tier behind
it, write-through stores, GPU-hit blocks touched on the host, host hits the READY run
right after the device hit. Tiers: our pool with each built-in policy, and the offline
references `oracle-admit` (LRU that admits only blocks used again) and `belady` (the
host tier's optimum). Counts blocks saved from prefill (device hits + host hits) and
the share of the LRU -> Belady gap each policy closes:
(saved - LRU saved) / (Belady saved - LRU saved). Where that gap is under 0.2% of the
workload's block uses, every policy is as good as the optimum and the share is not
shown.

Then PR 11532's long-document loop at its own scale (31-block documents, device 256
blocks, host 930), as the re-read's speed-up over the device alone with a host hit
costing 5% of a computed block. Prints the tables, writes
benchmarks/results/hit_rate_table.json (and a copy in docs/figures/) and the plot
docs/figures/hit_rate_table.png. Deterministic: fixed seeds, int keys.

Usage: python benchmarks/hit_rate_table.py [--workloads W ...] [--capacities C ...]
           [--policies P ...]        # all of them: about 15 minutes on one core
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from trace_replay import (  # noqa: E402
    BeladyTier,
    GpuPrefixCache,
    HostTier,
    OracleAdmitTier,
    OurTier,
    next_uses,
    replay,
)
from workloads import WORKLOADS, Workload, describe, long_document  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
FIGURES = REPO / "docs" / "figures"
CAPACITIES = [1000, 2000, 3000, 4000, 6000, 8000, 12000, 16000, 24000, 32000]
POLICIES = ["lru", "arc", "lirs", "s3fifo", "prefix_aware", "oracle-admit", "belady"]
# The published policies a default is measured against, cell by cell.
ANCHORS = ("lru", "arc", "lirs", "s3fifo")
NO_GAP = 0.002  # a gap under this share of the block uses leaves nothing to close


def tier_factory(name: str, upcoming: list[list[int]]) -> Callable[[int], HostTier]:
    if name == "oracle-admit":
        return lambda c: OracleAdmitTier(c, upcoming)
    if name == "belady":
        return lambda c: BeladyTier(c, upcoming)
    return lambda c: OurTier(name, c)


def run_workload(
    workload: Workload, capacities: list[int], policies: list[str]
) -> list[dict]:
    requests = workload.requests
    uses = sum(map(len, requests))
    upcoming = next_uses(requests)
    rows = []
    for capacity in capacities:
        batch = {}
        for name in policies:
            make = tier_factory(name, upcoming)
            batch[name] = replay(requests, workload.device_blocks, make(capacity))
        low = batch["lru"]["saved"] if "lru" in batch else None
        high = batch["belady"]["saved"] if "belady" in batch else None
        for name, result in batch.items():
            gap = None
            if low is not None and high is not None and high - low >= NO_GAP * uses:
                gap = (result["saved"] - low) / (high - low)
            rows.append(
                {
                    "workload": workload.name,
                    "host_blocks": capacity,
                    "policy": name,
                    "block_uses": uses,
                    "gap_closed": gap,
                    **result,
                }
            )
        shown = " ".join(
            f"{name}={_pct(row['gap_closed'])}" for name, row in _last(rows, batch)
        )
        print(f"  {workload.name} {capacity:>6}: {shown}", flush=True)
    return rows


def _last(rows: list[dict], batch: dict) -> list[tuple[str, dict]]:
    return [(row["policy"], row) for row in rows[-len(batch) :]]


def _pct(gap: float | None) -> str:
    return "-" if gap is None else f"{100 * gap:.1f}"


def print_table(rows: list[dict], capacities: list[int], policies: list[str]) -> None:
    print("\nshare of the LRU -> Belady gap closed, % ('-': no gap to close)")
    print(f"{'workload':<13} {'policy':<13}" + "".join(f"{c:>8}" for c in capacities))
    cell = {(r["workload"], r["policy"], r["host_blocks"]): r for r in rows}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for name in policies:
            line = f"{workload:<13} {name:<13}"
            for capacity in capacities:
                row = cell.get((workload, name, capacity))
                line += f"{_pct(row['gap_closed']) if row else '':>8}"
            print(line)
    print("\nblocks saved, % of block uses (device + host hits)")
    print(f"{'workload':<13} {'policy':<13}" + "".join(f"{c:>8}" for c in capacities))
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for name in policies:
            line = f"{workload:<13} {name:<13}"
            for capacity in capacities:
                row = cell.get((workload, name, capacity))
                saved = 100 * row["saved"] / row["block_uses"] if row else None
                line += f"{'' if saved is None else f'{saved:.2f}':>8}"
            print(line)


def plot(
    rows: list[dict], capacities: list[int], policies: list[str], tag: str
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in rows))
    cols = 4
    fig, axes = plt.subplots(
        (len(names) + cols - 1) // cols, cols, figsize=(16, 7), squeeze=False
    )
    cell = {(r["workload"], r["policy"], r["host_blocks"]): r for r in rows}
    for ax, workload in zip(axes.flat, names, strict=False):
        for name in policies:
            points = [
                (c, 100 * cell[(workload, name, c)]["saved"] / r["block_uses"])
                for c in capacities
                if (r := cell.get((workload, name, c)))
            ]
            style = "--" if name in ("oracle-admit", "belady") else "-"
            ax.plot(*zip(*points, strict=True), style, marker=".", label=name)
        ax.set_xscale("log", base=2)
        # Powers of two only: the labels of 3k, 6k, 12k and 24k would overlap.
        ticks = [c for c in capacities if (c // 1000) & (c // 1000 - 1) == 0]
        ax.set_xticks(
            ticks or capacities, [f"{c // 1000}k" for c in ticks or capacities]
        )
        ax.set_title(workload)
        ax.set_xlabel("host blocks")
        ax.set_ylabel("blocks saved, %")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    out = FIGURES / f"hit_rate_table{tag}.png"
    fig.savefig(out, dpi=110)
    return out


def _reread_cost(requests: list[list[int]], warmup: int, tier: HostTier) -> float:
    """Cost of the requests after the first `warmup`: computed blocks count 1, host
    hits 0.05, device hits nothing (trace_replay.replay's model, measured late)."""
    device = GpuPrefixCache(256)
    cost = 0.0
    for index, keys in enumerate(requests):
        g = device.hit(keys)
        h = tier.serve(index, keys, g)
        device.finish(keys)
        if index >= warmup:
            cost += len(keys) - g - h + 0.05 * h
    return cost


class LongDocumentLoop:
    """PR 11532's loop at its own scale, as a block-level model: `num_docs` documents
    of 31 blocks (1,000 tokens in blocks of 32), device 256 blocks, host 930 (30
    documents), warm-up in order, then one re-read in random order. The speed-up is
    the re-read's cost on the device alone over its cost with the host tier."""

    DOCS = (16, 32, 64)
    HOST_BLOCKS = 930

    def __init__(self, num_docs: int) -> None:
        self.num_docs = num_docs
        self.requests = long_document(num_docs, doc_blocks=31, rounds=1).requests
        self._upcoming = next_uses(self.requests)
        self._alone = _reread_cost(self.requests, num_docs, OurTier("lru", 0))

    def speedup(self, policy: str) -> float:
        tier = tier_factory(policy, self._upcoming)(self.HOST_BLOCKS)
        return self._alone / _reread_cost(self.requests, self.num_docs, tier)


def longdoc_speedups(policies: list[str]) -> list[dict]:
    """`LongDocumentLoop` at 16, 32 and 64 documents for every policy; printed."""
    print("\nlong-document re-read speed-up over the device alone (31-block documents,")
    print("device 256 blocks, host 930, a host hit costs 5% of a computed block)")
    print(f"{'docs':>5} " + "".join(f"{name:>14}" for name in policies))
    rows = []
    for num_docs in LongDocumentLoop.DOCS:
        loop = LongDocumentLoop(num_docs)
        line = f"{num_docs:>5} "
        for name in policies:
            speedup = loop.speedup(name)
            rows.append({"docs": num_docs, "policy": name, "speedup": speedup})
            line += f"{speedup:>13.2f}x"
        print(line)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--capacities", type=int, nargs="+", default=CAPACITIES)
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--tag", default="", help="suffix of the output files")
    args = parser.parse_args()
    policies = args.policies
    for needed in ("lru", "belady"):
        if needed not in policies:
            policies = [needed, *policies]

    start = time.perf_counter()
    rows: list[dict] = []
    shapes = []
    for name in args.workloads:
        workload = WORKLOADS[name]()
        shapes.append(describe(workload))
        print(shapes[-1], flush=True)
        rows += run_workload(workload, args.capacities, policies)
    print_table(rows, args.capacities, policies)
    speedups = longdoc_speedups(policies)
    meta = {
        "workloads": shapes,
        "capacities": args.capacities,
        "machine": platform.platform(),
        "python": platform.python_version(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"hit_rate_table{args.tag}.json"
    out.write_text(
        json.dumps({"meta": meta, "rows": rows, "longdoc_speedups": speedups}, indent=1)
    )
    FIGURES.mkdir(parents=True, exist_ok=True)
    shutil.copy(out, FIGURES / out.name)
    print(f"wrote {out} and {plot(rows, args.capacities, policies, args.tag)}")


if __name__ == "__main__":
    main()
