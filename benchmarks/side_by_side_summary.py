"""The tables of benchmarks/side_by_side.py: medians and ranges over the rounds, ratios
to the `none` arm of the same round, and the greedy outputs compared across arms."""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from statistics import median
from typing import Any

from benchmarks.engine_runs import spread
from benchmarks.side_by_side_engine import EQUAL_RAM_ARM

HOST_HITS = "vllm:external_prefix_cache_hits"  # the connector's hits, every arm
DEVICE_HITS = "vllm:prefix_cache_hits"


def p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def ttfts(phase: dict[str, Any]) -> list[float]:
    return [r["ttft_s"] for r in phase["requests"]]


def median_ms(phase: dict[str, Any]) -> float:
    return 1e3 * statistics.median(ttfts(phase))


def p90_ms(phase: dict[str, Any]) -> float:
    return 1e3 * p90(ttfts(phase))


def fmt(
    s: dict[str, float], scale: float = 1.0, digits: int = 0, unit: str = ""
) -> str:
    return (
        f"{s['median'] * scale:.{digits}f}{unit} "
        f"({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"
    )


def _per_round(rounds: list[dict[str, Any]], arm: str, get: Any) -> dict[str, float]:
    return spread([get(r[arm]) for r in rounds])


def reread_table(rounds: list[dict[str, Any]], arms: Sequence[str]) -> list[dict]:
    """(a): per N and arm, the re-read's TTFT, hits and speed-up over `none` (the
    ratio of the re-read's summed TTFT in the same round)."""
    table = []
    for i, entry in enumerate(rounds[0][arms[0]]["reread"]):
        row: dict[str, Any] = {"docs": entry["docs"]}
        print(f"\n(a) {entry['docs']} documents, re-read (median of {len(rounds)} "
              "rounds, range)")  # fmt: skip
        for arm in arms:
            again = [r[arm]["reread"][i]["reread"] for r in rounds]
            warm = [r[arm]["reread"][i]["warmup"] for r in rounds]
            cells = {
                "reread_ttft_sum_s": spread([sum(ttfts(p)) for p in again]),
                "ttft_median_ms": spread([median_ms(p) for p in again]),
                "ttft_p90_ms": spread([p90_ms(p) for p in again]),
                "warmup_ttft_median_ms": spread([median_ms(p) for p in warm]),
                "host_hit_tokens": spread([p["counters"][HOST_HITS] for p in again]),
                "device_hit_tokens": spread(
                    [p["counters"][DEVICE_HITS] for p in again]
                ),
            }
            if "none" in arms:
                cells["speedup_vs_none"] = spread([
                    sum(ttfts(r["none"]["reread"][i]["reread"]))
                    / sum(ttfts(r[arm]["reread"][i]["reread"]))
                    for r in rounds
                ])  # fmt: skip
            if EQUAL_RAM_ARM in arms:
                cells["speedup_vs_equal_ram"] = spread([
                    sum(ttfts(r[EQUAL_RAM_ARM]["reread"][i]["reread"]))
                    / sum(ttfts(r[arm]["reread"][i]["reread"]))
                    for r in rounds
                ])  # fmt: skip
            row[arm] = cells
            print(
                f"  {arm:>21}: re-read {fmt(cells['reread_ttft_sum_s'], 1, 2, ' s')}, "
                f"TTFT median {fmt(cells['ttft_median_ms'], unit=' ms')}, p90 "
                f"{fmt(cells['ttft_p90_ms'], unit=' ms')}, host hits "
                f"{fmt(cells['host_hit_tokens'])}, device hits "
                f"{fmt(cells['device_hit_tokens'])}"
                + (
                    f", {fmt(cells['speedup_vs_none'], 1, 2, 'x')} over none"
                    if "speedup_vs_none" in cells
                    else ""
                )
                + (
                    f", {fmt(cells['speedup_vs_equal_ram'], 1, 2, 'x')} over "
                    f"{EQUAL_RAM_ARM}"
                    if "speedup_vs_equal_ram" in cells
                    else ""
                )  # fmt: skip
            )
        table.append(row)
    return table


def no_reuse_table(rounds: list[dict[str, Any]], arms: Sequence[str]) -> dict:
    """(b): each arm's throughput over unique prompts relative to `none`'s in the
    same round (the inverse ratio of the phase's wall times)."""
    table: dict[str, Any] = {}
    print("\n(b) no reuse")
    for arm in arms:
        cells = {
            "wall_s": _per_round(rounds, arm, lambda a: a["no_reuse"]["wall_s"]),
            "ttft_median_ms": _per_round(
                rounds, arm, lambda a: 1e3 * statistics.median(ttfts(a["no_reuse"]))
            ),
        }
        if "none" in arms:
            cells["throughput_vs_none"] = spread([
                r["none"]["no_reuse"]["wall_s"] / r[arm]["no_reuse"]["wall_s"]
                for r in rounds
            ])  # fmt: skip
        table[arm] = cells
        print(f"  {arm:>21}: {fmt(cells['wall_s'], 1, 2, ' s')}, TTFT median "
              f"{fmt(cells['ttft_median_ms'], unit=' ms')}"
              + (f", throughput {fmt(cells['throughput_vs_none'], 1, 3, 'x')} of none"
                 if "throughput_vs_none" in cells else ""))  # fmt: skip
    return table


def convoy_table(rounds: list[dict[str, Any]], arms: Sequence[str]) -> dict:
    """(c): the convoys' time to first token, counted from the end of the step that
    prefilled the document ahead of them (`after_ahead_s`: when the engine turns to
    them), all convoys of an engine pooled; the raw TTFT (from arrival, with that
    prefill's wait) beside it; the connector's and the device's hits per convoy."""
    table: dict[str, Any] = {}
    print(
        "\n(c) shared prefix in host memory only, requests sent at once: first "
        "token after the document ahead"
    )

    def pooled(key: str) -> Any:
        def values(a: dict[str, Any]) -> list[float]:
            return [r[key] for p in a["convoy"] for r in p["requests"]]

        return values

    def per_convoy(key: str) -> Any:
        return lambda a: statistics.median(p["counters"][key] for p in a["convoy"])

    after, raw = pooled("after_ahead_s"), pooled("ttft_s")
    for arm in arms:
        cells = {
            "median_ms": _per_round(rounds, arm, lambda a: 1e3 * median(after(a))),
            "p90_ms": _per_round(rounds, arm, lambda a: 1e3 * p90(after(a))),
            "max_ms": _per_round(rounds, arm, lambda a: 1e3 * max(after(a))),
            "raw_ttft_median_ms": _per_round(
                rounds, arm, lambda a: 1e3 * median(raw(a))
            ),
            "host_hit_tokens": _per_round(rounds, arm, per_convoy(HOST_HITS)),
            "device_hit_tokens": _per_round(rounds, arm, per_convoy(DEVICE_HITS)),
            # convoys whose requests were all queued before the first was scheduled
            "together": sum(p["together"] for r in rounds for p in r[arm]["convoy"]),
            "convoys": sum(len(r[arm]["convoy"]) for r in rounds),
        }
        table[arm] = cells
        print(f"  {arm:>21}: median {fmt(cells['median_ms'], unit=' ms')}, "
              f"p90 {fmt(cells['p90_ms'], unit=' ms')}, max "
              f"{fmt(cells['max_ms'], unit=' ms')} (TTFT from arrival "
              f"{fmt(cells['raw_ttft_median_ms'], unit=' ms')}); per convoy host "
              f"hits {fmt(cells['host_hit_tokens'])}, device hits "
              f"{fmt(cells['device_hit_tokens'])}; arrived together in "
              f"{cells['together']} of {cells['convoys']}")  # fmt: skip
    return table


def trace_table(trace: dict[str, Any] | None) -> list[dict]:
    """(d): host hits per tier and capacity, and each tier's against vLLM's lru."""
    if trace is None:
        return []
    print(
        f"\n(d) conversation trace, {trace['requests']} requests, device "
        f"{trace['gpu_blocks']} blocks: host hits (blocks of 512 tokens)"
    )
    rows = []
    for capacity in sorted({r["host_blocks"] for r in trace["rows"]}):
        hits = {
            r["tier"]: r["host_hits"]
            for r in trace["rows"]
            if r["host_blocks"] == capacity
        }
        base = hits.get("vllm") or 0
        ratios = {t: h / base for t, h in hits.items()} if base else {}
        rows.append({"host_blocks": capacity, "host_hits": hits, "vs_vllm": ratios})
        shown = [
            f"{t} {h}" + (f" ({ratios[t]:.2f}x)" if ratios else "")
            for t, h in hits.items()
        ]
        print(f"  {capacity:>6} blocks: " + ", ".join(shown))
    return rows


def _outputs(arm_result: dict[str, Any]) -> Iterator[tuple[str, list[int]]]:
    """(where, greedy tokens) of every request an engine served, in order."""
    for entry in arm_result["reread"]:
        for phase in ("warmup", "reread"):
            for j, r in enumerate(entry[phase]["requests"]):
                yield f"reread N={entry['docs']} {phase} #{j}", r["tokens"]
    if arm_result.get("no_reuse"):
        for j, r in enumerate(arm_result["no_reuse"]["requests"]):
            yield f"no_reuse #{j}", r["tokens"]
    for k, phase in enumerate(arm_result.get("convoy") or []):
        for j, r in enumerate(phase["requests"]):
            yield f"convoy {k} #{j}", r["tokens"]


def compare_outputs(rounds: list[dict[str, Any]], arms: Sequence[str]) -> dict:
    """Every request's greedy tokens against the first arm's in the first round."""
    reference = dict(_outputs(rounds[0][arms[0]]))
    differ = []
    for i, r in enumerate(rounds):
        for arm in arms:
            for where, tokens in _outputs(r[arm]):
                if tokens != reference[where]:
                    differ.append({"round": i + 1, "arm": arm, "request": where})
    compared = len(reference) * len(rounds) * len(arms)
    print(f"\ngreedy outputs: {compared - len(differ)} of {compared} requests equal "
          f"to {arms[0]}'s of round 1")  # fmt: skip
    for d in differ[:20]:
        print(f"  differs: round {d['round']} {d['arm']} {d['request']}")
    return {"reference": arms[0], "compared": compared, "differ": differ}


def summarize(
    rounds: list[dict[str, Any]], trace: dict[str, Any] | None, arms: Sequence[str]
) -> dict[str, Any]:
    first = rounds[0][arms[0]]
    return {
        "reread": reread_table(rounds, arms),
        "no_reuse": no_reuse_table(rounds, arms) if first["no_reuse"] else None,
        "convoy": convoy_table(rounds, arms) if first["convoy"] else None,
        "trace": trace_table(trace),
        "outputs": compare_outputs(rounds, arms),
        "logs": {arm: [r[arm]["log"] for r in rounds] for arm in arms},
    }
