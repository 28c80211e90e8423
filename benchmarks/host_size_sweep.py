"""The host tier's size against the loop it serves: host-hit tokens and time to first
token from half to four times the loop's working set, at two device cache sizes, for
vLLM's own `lru` and `arc`, the plugin's `prefix_aware` as vLLM's `CachePolicy` (its
admission asked through the series' [3/8] `CachePolicy.admit`), and the plugin.

The loop is PR 11532's: `--docs` documents of 1,000 tokens read once in order, then
re-read in a random order, one request at a time. Its working set is the documents'
full blocks (31 of 32 tokens each). Two parts:
- replay, no engine (benchmarks/admission_replay.py, through vLLM 0.33.0's own
  `CPUOffloadingManager` with the series applied and the plugin's pool): host-hit tokens
  on a dense grid of host sizes (`--replay-ratios`);
- engines (benchmarks/side_by_side_engine.py, a fresh process per arm and size, the
  re-read only): host-hit tokens and the re-read's time to first token at
  `--engine-ratios`, beside prefix caching with the same device cache (`none`) and with
  the tier's bytes added to it (`none+tier_bytes`, what a CPU user would pick). Arms run
  in rounds, in order in odd rounds and reversed in even ones; `--pairs` rounds, the
  median and range of the rounds.

Run it with the vLLM 0.33.0 environment's Python, as benchmarks/side_by_side.py:

    .venv-vllm033/bin/python benchmarks/host_size_sweep.py
    # -> benchmarks/results/host_size_sweep.json, a table on stdout,
    #    host_size_sweep.png beside the JSON
    .venv-vllm033/bin/python benchmarks/host_size_sweep.py --replay-into RUN.json
    # the replay of that run's grid again, its engine cells kept (a changed replay)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # as in benchmarks/side_by_side.py

from benchmarks.engine_runs import spread  # noqa: E402
from benchmarks.long_document_qa import (  # noqa: E402
    BLOCK_SIZE,
    DTYPE_BYTES,
    block_bytes,
    resolve_sizing,
    shape_of,
)
from benchmarks.long_document_tables import fmt  # noqa: E402
from benchmarks.side_by_side import (  # noqa: E402
    blocks,
    build_overlay,
    engine_env,
    machine,
    run_logged,
    uptime,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# Engine arm -> its policy's name in the replay (benchmarks/admission_replay.py).
TIER_ARMS = {
    "vllm": "lru",
    "vllm+arc": "arc",
    "vllm+prefix_aware": "prefix_aware",
    "plugin": "plugin",
}
BASELINES = ("none", "none+tier_bytes")
# The replayed rules the plot draws (benchmarks/admission_replay.py's arms).
REPLAY_LINES = {
    "vLLM lru": "lru",
    "vLLM arc": "arc",
    "vLLM doorkeeper_lru ([3/8])": "doorkeeper_lru",
    "vLLM + prefix_aware (admit, [3/8])": "prefix_aware",
    "plugin (prefix_aware)": "plugin",
}
HOST_HITS = "vllm:external_prefix_cache_hits"


def working_set_blocks(docs: int, doc_tokens: int) -> int:
    return docs * (doc_tokens // BLOCK_SIZE)


def host_blocks(ratio: float, working_set: int) -> int:
    return round(ratio * working_set)


def replay(args: argparse.Namespace, env: dict[str, str], logs: Path) -> list[dict]:
    ws = working_set_blocks(args.docs, args.doc_tokens)
    argv = [
        "--docs", str(args.docs), "--host-blocks",
        "--device-blocks", *(str(d * args.doc_blocks) for d in args.device_docs),
        "--loop-host-blocks", *(str(host_blocks(r, ws)) for r in args.replay_ratios),
    ]  # fmt: skip
    result = run_logged("benchmarks.admission_replay", argv, env, logs / "replay.log")
    return list(result["loop"]["rows"])


def engine_argv(args: argparse.Namespace, device_docs: int, ratio: float) -> list[str]:
    shape = shape_of(args.layers)
    host = host_blocks(ratio, working_set_blocks(args.docs, args.doc_tokens))
    host_gib = host * block_bytes(shape, args.dtype) / (1 << 30)
    return [
        "--engine-run", "--dtype", args.dtype, "--layers", str(args.layers),
        "--device-blocks", str(device_docs * args.doc_blocks),
        "--host-gib", repr(host_gib),
        "--docs", str(args.docs), "--doc-tokens", str(args.doc_tokens),
        "--max-tokens", str(args.max_tokens), "--no-reuse", "0", "--convoy-rounds", "0",
    ]  # fmt: skip


def cells(args: argparse.Namespace) -> list[tuple[int, float | None, str]]:
    """(device docs, host ratio, arm) of one round; `none` has no host tier."""
    out: list[tuple[int, float | None, str]] = []
    for device in args.device_docs:
        out.append((device, None, "none"))
        for ratio in args.engine_ratios:
            out += [(device, ratio, arm) for arm in ("none+tier_bytes", *args.arms)]
    return out


def run_engines(
    args: argparse.Namespace, env: dict[str, str], logs: Path
) -> list[dict[str, Any]]:
    rows = []
    plan = cells(args)
    for i in range(args.pairs):
        for device, ratio, arm in plan if i % 2 == 0 else plan[::-1]:
            t0 = time.perf_counter()
            name = f"round{i + 1}_d{device}_r{ratio}_{arm.replace('+', '_')}"
            argv = [*engine_argv(args, device, ratio or 0.0), "--arm", arm]
            result = run_logged(
                "benchmarks.side_by_side_engine", argv, env, logs / f"{name}.log"
            )
            [entry] = result["reread"]
            again = entry["reread"]
            rows.append({
                "round": i + 1, "device_docs": device, "ratio": ratio, "arm": arm,
                "host_hit_tokens": again["counters"][HOST_HITS],
                "ttft_sum_s": sum(r["ttft_s"] for r in again["requests"]),
                "ttft_median_s": statistics.median(
                    r["ttft_s"] for r in again["requests"]),
                "tokens": [r["tokens"] for r in again["requests"]],
                "log": result["log"],
            })  # fmt: skip
            took, hits = time.perf_counter() - t0, rows[-1]["host_hit_tokens"]
            print(f"round {i + 1}: {name} {took:.0f} s, {hits:.0f} host-hit tokens",
                  flush=True)  # fmt: skip
    return rows


def summarize(
    args: argparse.Namespace, replayed: list[dict], engines: list[dict]
) -> dict[str, Any]:
    """Per device size, ratio and arm: replayed and measured hits, the re-read's
    summed TTFT over the rounds, and how many times faster it is than each baseline
    in the same round."""
    ws = working_set_blocks(args.docs, args.doc_tokens)
    hits = {
        (r["device_blocks"], r["host_blocks"], r["arm"]): r["host_hit_tokens"]
        for r in replayed
    }
    by = {(r["round"], r["device_docs"], r["ratio"], r["arm"]): r for r in engines}
    rounds = sorted({r["round"] for r in engines})
    table = []
    for device in args.device_docs:
        for ratio in args.engine_ratios:
            for arm in (*BASELINES, *args.arms):
                mine = [by[k, device, ratio if arm != "none" else None, arm]
                        for k in rounds]  # fmt: skip
                row: dict[str, Any] = {
                    "device_docs": device, "ratio": ratio, "arm": arm,
                    "host_hit_tokens": sorted({m["host_hit_tokens"] for m in mine}),
                    "ttft_sum_s": spread([m["ttft_sum_s"] for m in mine]),
                    # greedy outputs equal to `none`'s, same round and device cache
                    "outputs_equal": sum(
                        a == b
                        for k, m in zip(rounds, mine, strict=True)
                        for a, b in zip(
                            m["tokens"], by[k, device, None, "none"]["tokens"],
                            strict=True,
                        )  # fmt: skip
                    ),
                    "requests": sum(len(m["tokens"]) for m in mine),
                }  # fmt: skip
                if arm in TIER_ARMS:
                    key = (device * args.doc_blocks, host_blocks(ratio, ws))
                    row["replayed_hit_tokens"] = hits[(*key, TIER_ARMS[arm])]
                    for base in BASELINES:
                        b = None if base == "none" else ratio
                        row[f"over_{base}"] = spread([
                            by[k, device, b, base]["ttft_sum_s"] / m["ttft_sum_s"]
                            for k, m in zip(rounds, mine, strict=True)
                        ])  # fmt: skip
                table.append(row)
    return {"working_set_blocks": ws, "engine": table, "replay": replayed}


def print_table(summary: dict[str, Any]) -> None:
    print(f"\nworking set {summary['working_set_blocks']} blocks")
    print(f"{'device':>6} {'host':>5} {'arm':<18} {'hit tokens':>11} {'replayed':>9} "
          f"{'re-read TTFT sum':>20} {'over none':>18} {'over equal RAM':>18} "
          "outputs")  # fmt: skip
    for r in summary["engine"]:
        measured = "/".join(f"{h:,.0f}" for h in r["host_hit_tokens"])
        over = [fmt(r[f"over_{b}"]) if f"over_{b}" in r else "" for b in BASELINES]
        print(f"{r['device_docs']:>6} {r['ratio']:>4}x {r['arm']:<18} {measured:>11} "
              f"{r.get('replayed_hit_tokens', ''):>9} "
              f"{fmt(r['ttft_sum_s'], ' s'):>20} {over[0]:>18} {over[1]:>18} "
              f"{r['outputs_equal']}/{r['requests']}")  # fmt: skip


def plot(args: argparse.Namespace, summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    ws = summary["working_set_blocks"]
    n = len(args.device_docs)
    fig, axes = plt.subplots(2, n, figsize=(5.5 * n, 7.5), squeeze=False)
    for col, device in enumerate(args.device_docs):
        top, bottom = axes[0][col], axes[1][col]
        for label, policy in REPLAY_LINES.items():
            pts = sorted(
                (r["host_blocks"] / ws, r["host_hit_tokens"])
                for r in summary["replay"]
                if r["arm"] == policy and r["device_blocks"] == device * args.doc_blocks
            )
            top.plot([x for x, _ in pts], [y for _, y in pts], marker=".", label=label)
        blocks = device * args.doc_blocks
        top.set_title(f"device cache {device} documents ({blocks} blocks)")
        top.set_xlabel("host tier / working set")
        top.set_ylabel("host-hit tokens of the re-read")
        top.legend(fontsize=8)
        for arm in (*BASELINES, *args.arms):
            pts = [
                (r["ratio"], r["ttft_sum_s"]["median"])
                for r in summary["engine"]
                if r["arm"] == arm and r["device_docs"] == device
            ]
            bottom.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=arm)
        bottom.set_xscale("log", base=2)
        bottom.set_xlabel("host tier / working set (equal RAM: those bytes on device)")
        bottom.set_ylabel("re-read, summed TTFT (s), median of rounds")
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=Path, default=REPO / "upstream")
    parser.add_argument(
        "--overlay-dir", type=Path, default=REPO / ".cache" / "patched-vllm033"
    )
    parser.add_argument("--docs", type=int, default=32, help="the loop's documents")
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--device-docs", type=int, nargs="+", default=[8, 16])
    parser.add_argument(
        "--engine-ratios", type=float, nargs="+", default=[0.5, 1, 2, 4]
    )
    parser.add_argument(
        "--replay-ratios", type=float, nargs="+",
        default=[0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1, 1.25, 1.5, 2, 3, 4],
    )  # fmt: skip
    parser.add_argument("--arms", nargs="+", choices=TIER_ARMS, default=list(TIER_ARMS))
    parser.add_argument("--pairs", type=int, default=2, help="rounds of every cell")
    parser.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_BYTES))
    parser.add_argument("--layers", type=int, default=0, help="0: probe this CPU")
    parser.add_argument("--out", type=Path, default=RESULTS / "host_size_sweep.json")
    parser.add_argument(
        "--plot-from", type=Path, default=None,
        help="plot a run's JSON (any environment with matplotlib), run nothing",
    )  # fmt: skip
    parser.add_argument(
        "--replay-into", type=Path, default=None,
        help="replay a run's grid again and write it into the run's JSON beside its "
        "engine cells, which are kept (no engine runs)",
    )  # fmt: skip
    return parser


def replay_into(args: argparse.Namespace, env: dict[str, str]) -> None:
    """A changed replay against the engines an earlier run measured: the run's
    sizes, its engine rows as they were, the replay and the summary new."""
    path = args.replay_into
    run = json.loads(path.read_text())
    keep = ("out", "plot_from", "replay_into", "patches", "overlay_dir")
    vars(args).update({k: v for k, v in run["args"].items() if k not in keep})
    replayed = replay(args, env, RESULTS / "host_size_sweep_logs")
    run["summary"] = summarize(args, replayed, run["engines"])
    run["replay_again"] = {"date": time.strftime("%Y-%m-%d"), "machine": machine()}
    path.write_text(json.dumps(run, indent=1))
    print_table(run["summary"])
    print(f"json: {path} (plot it with --plot-from)")


def main() -> None:
    args = _parser().parse_args()
    if args.plot_from is not None:
        run = json.loads(args.plot_from.read_text())
        vars(args).update(
            {k: v for k, v in run["args"].items() if k not in ("out", "plot_from")}
        )
        plot(args, run["summary"], args.plot_from.with_suffix(".png"))
        return
    if importlib.metadata.version("vllm") != "0.33.0":
        raise SystemExit(
            "run this with the vLLM 0.33.0 environment's Python "
            "(VLLM033_CPU_KERNELS=1 bash scripts/setup_vllm033_env.sh)"
        )
    missing = set(args.engine_ratios) - set(args.replay_ratios)
    if missing:
        raise SystemExit(f"add {sorted(missing)} to --replay-ratios: every engine "
                         "ratio is replayed too")  # fmt: skip
    args.doc_blocks = blocks(args.doc_tokens)
    overlay = build_overlay(args.patches.resolve(), args.overlay_dir.resolve())
    env = engine_env(overlay)
    if args.replay_into is not None:
        replay_into(args, env)
        return
    args.quick = False
    args.dtype, args.layers, rates = resolve_sizing(args)
    info = {"machine": machine(), "uptime_start": uptime(),
            "series": (overlay.parent / "series.txt").read_text().splitlines(),
            "dtype": args.dtype, "layers": args.layers,
            "rates": None if rates is None else rates.gflops}  # fmt: skip
    print(json.dumps(info, indent=1))
    logs = args.out.parent / "host_size_sweep_logs"
    start = time.perf_counter()
    replayed = replay(args, env, logs)
    engines = run_engines(args, env, logs)
    summary = summarize(args, replayed, engines)
    print_table(summary)
    info |= {"uptime_end": uptime(), "wall_s": time.perf_counter() - start}
    shown = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": shown, **info, "summary": summary,
                                    "engines": engines}, indent=1))  # fmt: skip
    plot(args, summary, args.out.with_suffix(".png"))
    print(f"json: {args.out}")


if __name__ == "__main__":
    main()
