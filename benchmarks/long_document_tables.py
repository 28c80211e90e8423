"""The tables and the plot of benchmarks/long_document_qa.py: medians of the pairs of
fresh engines and their range, the tier against both baselines, and the answers.

The baselines: prefix caching with the same device cache (the comparison of PR 11532,
where device memory is scarce), and prefix caching with the tier's bytes added to the
device cache (on vLLM's CPU platform the device cache is host RAM too: what a CPU user
would pick instead of the tier).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

ARMS = ("prefix-caching", "cpu-offload", "equal-ram")
LABELS = {
    "prefix-caching": "prefix caching",
    "cpu-offload": "--enable-cpu-offload",
    "equal-ram": "prefix caching, tier's bytes in the device cache",
}
PHASE_FIELDS = ("wall_s", "ttft_mean_ms", "ttft_p90_ms", "miss_ms_median", "steal_s")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict[str, float], unit: str = "x", digits: int = 2) -> str:
    return (
        f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
    )


def _ratios(pairs: list[dict[str, Any]], i: int, base: str) -> dict[str, float]:
    """How many times faster the tier's re-read is than `base`'s, per pair."""
    return spread(
        [
            p[base][i]["reread"]["wall_s"] / p["cpu-offload"][i]["reread"]["wall_s"]
            for p in pairs
        ]
    )


def _equal_outputs(pairs: list[dict[str, Any]], i: int, arms: tuple[str, ...]) -> bool:
    ref = arms[0]
    return all(
        p[arm][i][phase]["tokens"] == p[ref][i][phase]["tokens"]
        for p in pairs
        for arm in arms[1:]
        for phase in ("warmup", "reread")
    )


def summarize(pairs: list[dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Median and range over the pairs; prints the tables."""
    arms = tuple(a for a in ARMS if a in pairs[0])
    summary: dict[str, Any] = {"docs": [], "outputs_equal": True, "arms": list(arms)}
    base0 = pairs[0][arms[0]]
    for i, entry in enumerate(base0):
        if "reread" not in entry:
            continue
        equal = _equal_outputs(pairs, i, arms)
        summary["outputs_equal"] &= equal
        row: dict[str, Any] = {
            "docs": entry["docs"],
            "reread_speedup": _ratios(pairs, i, "prefix-caching"),
        }
        if "equal-ram" in arms:
            row["reread_speedup_vs_equal_ram"] = _ratios(pairs, i, "equal-ram")
        print(
            f"\n{entry['docs']} documents, re-read phase (median of {len(pairs)} "
            "rounds, range)"
        )
        for arm in arms:
            r = [p[arm][i]["reread"] for p in pairs]
            stats = {key: spread([x[key] for x in r]) for key in PHASE_FIELDS}
            stats["host_hit_tokens"] = spread([x["host_hit_tokens"] for x in r])
            stats["cached_tokens"] = spread([x["cached_tokens"] for x in r])
            warm = spread([p[arm][i]["warmup"]["miss_ms_median"] for p in pairs])
            row[arm] = stats | {"warmup_miss_ms_median": warm}
            print(
                f"  {LABELS[arm]:>48}: {fmt(stats['wall_s'], ' s')}, TTFT mean "
                f"{fmt(stats['ttft_mean_ms'], ' ms', 0)}, cached tokens "
                f"{stats['cached_tokens']['median']:.0f} (host "
                f"{stats['host_hit_tokens']['median']:.0f}), a miss "
                f"{stats['miss_ms_median']['median']:.0f} ms"
            )
        print(f"  the tier's re-read: {fmt(row['reread_speedup'])} of prefix caching")
        if "reread_speedup_vs_equal_ram" in row:
            vs = row["reread_speedup_vs_equal_ram"]
            verdict = "the tier wins" if vs["median"] > 1 else "the tier LOSES"
            print(
                f"  the tier's re-read: {fmt(vs)} of prefix caching given the tier's "
                f"bytes ({verdict})"
            )
        print(f"  greedy outputs of every arm equal: {equal}")
        summary["docs"].append(row)
    if "no_reuse" in base0[-1]:
        # Same prompts in every arm: the throughput ratio is the inverse ratio of
        # wall times.
        ratio = summary["no_reuse_throughput_ratio"] = spread(
            [
                p["prefix-caching"][-1]["no_reuse"]["wall_s"]
                / p["cpu-offload"][-1]["no_reuse"]["wall_s"]
                for p in pairs
            ]
        )
        print(
            f"\nno reuse: the flag's throughput {fmt(ratio, 'x', 3)} of prefix caching"
        )
    _print_answers(pairs, arms, summary)
    print(
        f"greedy outputs of every arm equal in every round: {summary['outputs_equal']}"
    )
    return summary


def _print_answers(
    pairs: list[dict[str, Any]], arms: tuple[str, ...], summary: dict[str, Any]
) -> None:
    """The model's answers to the first documents' questions, read after the re-read
    phase (from host memory with the tier), in every arm."""
    # The entry of the last re-read carries them (a no-reuse entry may follow it).
    answers = [
        next((e["answers"] for e in p[arm] if e.get("answers")), None)
        for p in pairs
        for arm in arms
    ]
    if not all(answers):
        return
    first: list[dict[str, str]] = answers[0] or []
    same = all(a == first for a in answers)
    summary["answers"] = first
    summary["answers_equal"] = same
    summary["outputs_equal"] &= same
    print(f"\nanswers (greedy; equal in every arm and pair: {same})")
    for a in first:
        print(f"  Q: {a['question']}\n  A: {a['answer'].strip()}")


def plot(summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    rows, arms = summary["docs"], summary["arms"]
    width = 0.8 / len(arms)
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for k, arm in enumerate(arms):
        med = [r[arm]["wall_s"]["median"] for r in rows]
        err = [
            [m - r[arm]["wall_s"]["min"] for m, r in zip(med, rows, strict=True)],
            [r[arm]["wall_s"]["max"] - m for m, r in zip(med, rows, strict=True)],
        ]
        offset = (k - (len(arms) - 1) / 2) * width
        xs_arm = [x + offset for x in xs]
        ax.bar(xs_arm, med, width, yerr=err, capsize=3, label=LABELS[arm])
    ax.set_xticks(list(xs), [str(r["docs"]) for r in rows])
    ax.set_xlabel("documents")
    ax.set_ylabel("re-read phase, seconds")
    ax.set_title("Long-document QA re-read (median of rounds and range)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
