"""How much per-request client hints give the host tier: the conversation trace and the
generated agent workload replayed with the hints a client would know.

What a client knows, taken from each stream in hindsight per request: whether a later
request extends this request's full prefix (its conversation goes on), and when.
  - it goes on: `retain` for the time until that request, plus 10% and one second (a
    turn can come in the same second; `retain` must be > 0);
  - it does not: `max_offload_tokens: 0`. Storing the last turn of a conversation is
    the waste `oracle-admit` avoids; not storing it keeps it from evicting anything.
    `done` is not the main hint: it acts only on blocks the tier already holds (the
    earlier turns, just read by this one; it leaves the prefix other sessions share).
    It is replayed as a variant (`right+done`: both hints).
Hints go through the product's own parsing (`hints_of`, capped at `max_retain_s`) and
act as the scheduler makes them act (`tier_scheduler.py`, `load_planning.py`): before a
request, `Retention.expire()` with a clock driven by the stream's timestamps; a device
hit touches the host copies and `Retention.read`s them, a host hit is pinned, read and
unpinned; stores are cut to `max_offload_tokens`; at the request's end `done` forgets
and demotes its blocks, `retain` retains them (in prefix order; blocks still STORING
then are pinned as their stores complete). The pool is the real `HostBlockPool`, with
`prefix_aware` (the default) and `lru`; the device cache (1,000 blocks), stores, hits
and the gain are trace_replay.py's, counted as admission_bound.py counts them: the
share is (blocks saved - LRU's) / (oracle-admit's - LRU's), with LRU and oracle-admit
built as admission_bound.py builds them. Pool and retention invariants are checked
every 2,000 requests and at the end of each run.

Variants: no hints; every hint right; right, but only the no-store hints, or only the
retains; right with `done` beside no-store; a fifth of the requests' hints wrong
(seeded: a wrong hint swaps retain and no-store, and a wrong retain's time is drawn
from the stream's true retain times); hints from half the conversations only, to
measure what retains cost the requests without hints (their hit rate beside the same
requests' with no hints at all).

The generated stream is workloads.py's `agent` (sessions whose turns extend their
history), one request a second; it has no admission_bound.py bound.
admission_bound.py's bound (its best share over every rule, feature and threshold) is
recomputed by running its own grid (`--bound compute`, ~240 replays per capacity, most
of the ~10 minutes on 2 cores), read from its JSON (`--bound file`), or quoted from
its printed run (`--bound quote`: 0.37 / 0.29 / 0.31 / 0.17 at 8k / 12k / 16k / 32k).

Usage: .venv/bin/python benchmarks/hint_replay.py [--capacities C ...]
           [--retain-share 0.25] [--jobs 2] [--bound compute|file|quote] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import types
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import admission_bound  # noqa: E402
from trace_replay import (  # noqa: E402
    BLOCK_TOKENS,
    OracleAdmitTier,
    OurTier,
    cached_keys,
    load_requests,
    next_uses,
    replay,
)
from workloads import agent_loops  # noqa: E402

from vllm_cpu_offload.config import (  # noqa: E402
    DEFAULT_MAX_RETAIN_S,
    DEFAULT_RETAIN_SHARE,
)
from vllm_cpu_offload.scheduler.block_pool import HostBlockPool  # noqa: E402
from vllm_cpu_offload.scheduler.policies.registry import make_policy  # noqa: E402
from vllm_cpu_offload.scheduler.request_hints import (  # noqa: E402
    RequestHints,
    hints_of,
)
from vllm_cpu_offload.scheduler.retention import Retention  # noqa: E402
from vllm_cpu_offload.scheduler.tier_stats import TierStats  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
CAPACITIES = [1000, 2000, 4000, 8000, 16000, 32000]
QUOTED_BOUND = {8000: 0.37, 12000: 0.29, 16000: 0.31, 32000: 0.17}
SLACK, SLACK_S = 0.1, 1.0
WRONG_SHARE = 0.2
SEED = 2205
POLICIES = ["prefix_aware", "lru"]
HINT_SETS = [
    "none",
    "right",
    "no-store only",
    "retain only",
    "right+done",
    "fifth wrong",
    "half",
]
VARIANTS = HINT_SETS
CHECK_EVERY = 2000  # requests between invariant checks


# ---- the streams ----


@dataclass(frozen=True)
class Stream:
    name: str
    trace: list[list[int]]
    times: list[float]  # seconds
    device_blocks: int


def conversation_stream() -> Stream:
    raw = load_requests()
    trace = [cached_keys(r) for r in raw]
    return Stream("conversation", trace, [r["timestamp"] / 1000 for r in raw], 1000)


def agent_stream() -> Stream:
    """workloads.py's agent loops, one request a second (it has no times)."""
    work = agent_loops()
    times = [float(i) for i in range(len(work.requests))]
    return Stream(work.name, work.requests, times, work.device_blocks)


STREAMS = {"conversation": conversation_stream, "agent": agent_stream}


# ---- what a client knows ----


def continuations(trace: list[list[int]]) -> list[int | None]:
    """The first later request that extends each request's full prefix (keys stand
    for their whole prefix, so: that holds its last key), or None."""
    seen_at: dict[int, int] = {}
    out: list[int | None] = [None] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        keys = trace[i]
        if keys:
            out[i] = seen_at.get(keys[-1])
        for key in keys:
            seen_at[key] = i
    return out


def conversations(trace: list[list[int]], nxt: list[int | None]) -> list[int]:
    """A conversation id per request: a request joins the one it continues when its
    last block is its own (first seen in it), not a prefix every session shares."""
    seen: set[int] = set()
    conv = list(range(len(trace)))
    joined = [False] * len(trace)
    for i, keys in enumerate(trace):
        own = bool(keys) and keys[-1] not in seen
        seen.update(keys)
        j = nxt[i]
        if own and j is not None and not joined[j]:
            conv[j], joined[j] = conv[i], True
    return conv


def retain_seconds(stream: Stream, i: int, j: int) -> float:
    return (stream.times[j] - stream.times[i]) * (1 + SLACK) + SLACK_S


def true_params(stream: Stream, nxt: list[int | None], done: bool) -> list[dict]:
    end = {"max_offload_tokens": 0, "done": True} if done else {"max_offload_tokens": 0}
    return [
        end if j is None else {"retain": retain_seconds(stream, i, j)}
        for i, j in enumerate(nxt)
    ]


def wrong_params(params: list[dict], rng: random.Random) -> list[dict]:
    """A fifth of the requests' hints swapped: retain <-> no-store, a wrong retain's
    time drawn from the true ones."""
    times = [p["retain"] for p in params if "retain" in p] or [60.0]
    out = list(params)
    for i in rng.sample(range(len(params)), round(WRONG_SHARE * len(params))):
        if "retain" in params[i]:
            out[i] = {"max_offload_tokens": 0}
        else:
            out[i] = {"retain": rng.choice(times)}
    return out


def hinted_half(conv: list[int], rng: random.Random) -> list[bool]:
    """Whether each request's conversation is in the hinted half (seeded)."""
    ids = sorted(set(conv))
    chosen = set(rng.sample(ids, len(ids) // 2))
    return [c in chosen for c in conv]


def variant_params(stream: Stream, variant: str) -> list[dict | None]:
    """Each request's `kv_transfer_params` in a variant."""
    nxt = continuations(stream.trace)
    right = true_params(stream, nxt, done=variant == "right+done")
    if variant == "none":
        return [None] * len(right)
    if variant == "no-store only":
        return [None if "retain" in p else p for p in right]
    if variant == "retain only":
        return [p if "retain" in p else None for p in right]
    if variant == "fifth wrong":
        return list(wrong_params(right, random.Random(SEED)))
    if variant == "half":
        mask = half_mask(stream, nxt)
        return [p if hinted else None for p, hinted in zip(right, mask, strict=True)]
    return list(right)


def half_mask(stream: Stream, nxt: list[int | None]) -> list[bool]:
    return hinted_half(conversations(stream.trace, nxt), random.Random(SEED + 1))


def parsed(params: list[dict | None]) -> list[RequestHints]:
    """The hints as the connector parses them from `kv_transfer_params`."""
    return [
        hints_of(
            types.SimpleNamespace(request_id=str(i), kv_transfer_params=p),
            max_retain_s=DEFAULT_MAX_RETAIN_S,
        )
        for i, p in enumerate(params)
    ]


# ---- the tier ----


class HintedTier:
    """The real pool and `Retention`, driven per request as the scheduler drives
    them; records each request's blocks saved (device hit + host hit)."""

    def __init__(
        self,
        policy: str,
        capacity: int,
        stream: Stream,
        hints: list[RequestHints],
        retain_share: float,
        retention: type[Retention] = Retention,
    ) -> None:
        self.pool = HostBlockPool(
            capacity, make_policy(policy, capacity), record_events=False
        )
        self.stats = TierStats(block_bytes=0)
        self.now = 0.0
        budget = int(retain_share * capacity)
        self.retention = retention(self.pool, budget, self.stats, clock=self._clock)
        self.times, self.hints = stream.times, hints
        self.saved = [0] * len(hints)
        self.retains = 0

    def _clock(self) -> float:
        return self.now

    def serve(self, index: int, keys: Sequence[int], gpu_hits: int) -> int:
        self.now = self.times[index]
        self.retention.expire()
        h = self._load(keys, gpu_hits)
        stored = self._store(keys, self.hints[index])
        self._finish(keys, self.hints[index])
        self.pool.complete_store(stored, True)
        self.retention.stored(stored, True)
        self.saved[index] = gpu_hits + h
        if index % CHECK_EVERY == 0:
            self.check()
        return h

    def _load(self, keys: Sequence[int], gpu_hits: int) -> int:
        pool, retention = self.pool, self.retention
        after = keys[gpu_hits:]
        h = pool.count_hits(after)
        if h:
            loaded = after[:h]
            pool.pin(loaded)
            retention.read(loaded)
            pool.unpin(loaded)
        device = keys[:gpu_hits]
        pool.touch(device, by_device=True)
        retention.read(device)
        return h

    def _store(self, keys: Sequence[int], hints: RequestHints) -> list[int]:
        limit = hints.max_offload_tokens
        wanted = keys if limit is None else keys[: limit // BLOCK_TOKENS]
        return [key for key, _ in self.pool.allocate_for_store(wanted, None)]

    def _finish(self, keys: Sequence[int], hints: RequestHints) -> None:
        if hints.done:
            self.retention.forget(keys)
            self.pool.demote(keys)
        elif hints.retain_s is not None and self.retention.budget:
            self.retention.retain(keys, None, hints.retain_s)
            self.retains += 1

    def check(self) -> None:
        self.pool.check_invariants()
        self.retention.check_invariants()


# ---- jobs ----

_STREAMS: dict[str, Stream] = {}
_RETAIN_SHARE = [0.5]


def _init(retain_share: float) -> None:
    _RETAIN_SHARE[0] = retain_share
    for name, make in STREAMS.items():
        _STREAMS[name] = make()
    admission_bound._init()


def _reference(job: tuple) -> dict:
    _, name, ref, capacity = job
    stream = _STREAMS[name]
    if ref == "lru":
        tier = OurTier("lru", capacity)
    else:
        tier = OracleAdmitTier(capacity, next_uses(stream.trace))
    return {"saved": replay(stream.trace, stream.device_blocks, tier)["saved"]}


def _hinted(job: tuple) -> dict:
    _, name, variant, policy, capacity = job
    stream = _STREAMS[name]
    hints = parsed(variant_params(stream, variant))
    tier = HintedTier(policy, capacity, stream, hints, _RETAIN_SHARE[0], Retention)
    saved = replay(stream.trace, stream.device_blocks, tier)["saved"]
    tier.check()
    mask = half_mask(stream, continuations(stream.trace))
    return {
        "saved": saved,
        "hinted_half_rate": _rate(stream, tier.saved, mask, True),
        "unhinted_half_rate": _rate(stream, tier.saved, mask, False),
        "retains": tier.retains,
        "retained_hit_blocks": tier.stats.retained_hit_blocks,
        "retains_expired_unread": tier.stats.retains_expired_unread,
    }


def _rate(stream: Stream, saved: list[int], mask: list[bool], want: bool) -> float:
    """Blocks saved / blocks, over the requests whose mask is `want`."""
    pairs = [
        (s, len(keys))
        for s, keys, m in zip(saved, stream.trace, mask, strict=True)
        if m == want
    ]
    return sum(s for s, _ in pairs) / max(1, sum(n for _, n in pairs))


def _run(job: tuple) -> tuple[tuple, dict]:
    start = time.perf_counter()
    if job[0] == "bound":
        out = {"saved": admission_bound._cell(job[1])[1]}
    elif job[0] == "ref":
        out = _reference(job)
    else:
        out = _hinted(job)
    out["seconds"] = time.perf_counter() - start
    return job, out


def jobs_for(capacities: list[int], bound: str) -> list[tuple]:
    jobs = [
        ("ref", name, ref, c)
        for name in STREAMS
        for ref in ("lru", "oracle-admit")
        for c in capacities
    ]
    jobs += [
        ("hint", name, variant, policy, c)
        for name in STREAMS
        for variant in VARIANTS
        for policy in POLICIES
        for c in capacities
    ]
    if bound == "compute":
        jobs += [("bound", cell) for cell in bound_cells(capacities)]
    return jobs


def bound_cells(capacities: list[int]) -> list[tuple]:
    """admission_bound.py's grid: every rule, feature and threshold."""
    return [
        (rule, feature, t, c)
        for rule in ("refuse", "evict-first")
        for feature in admission_bound.FEATURES
        for t in admission_bound.THRESHOLDS
        for c in capacities
    ]


# ---- the bound ----


def bound_shares(
    capacities: list[int], bound: str, results: dict[tuple, dict]
) -> dict[int, float | None]:
    """admission_bound.py's best share per capacity."""
    if bound == "quote":
        return {c: QUOTED_BOUND.get(c) for c in capacities}
    if bound == "file":
        return _bound_from_file(capacities)
    out: dict[int, float | None] = {}
    for c in capacities:
        low, high = _refs(results, "conversation", c)
        out[c] = max(
            (results[("bound", cell)]["saved"] - low) / (high - low)
            for cell in bound_cells([c])
        )
    return out


def _bound_from_file(capacities: list[int]) -> dict[int, float | None]:
    path = RESULTS / "admission_bound.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    best: dict[int, float] = {}
    for row in rows:
        c = row["host_blocks"]
        best[c] = max(best.get(c, -1e9), *row["shares"])
    return {c: best.get(c) for c in capacities}


def _refs(results: dict[tuple, dict], name: str, c: int) -> tuple[int, int]:
    low = results[("ref", name, "lru", c)]["saved"]
    return low, results[("ref", name, "oracle-admit", c)]["saved"]


# ---- the report ----


def stream_rows(
    name: str, capacities: list[int], results: dict[tuple, dict]
) -> list[dict]:
    """Per capacity: LRU's and oracle-admit's blocks saved, and per variant and
    policy its result with its share of oracle-admit's gain."""
    rows = []
    for c in capacities:
        low, high = _refs(results, name, c)
        row: dict = {"host_blocks": c, "lru_saved": low, "oracle_admit_saved": high}
        for variant in VARIANTS:
            for policy in POLICIES:
                res = results.get(("hint", name, variant, policy, c))
                if res is not None:
                    share = (res["saved"] - low) / (high - low) if high != low else None
                    row[f"{variant} | {policy}"] = {**res, "share": share}
        rows.append(row)
    return rows


def _line(label: str, values: list[float | None], fmt: str = "{:>8.2f}") -> str:
    cells = "".join(fmt.format(v) if v is not None else f"{'-':>8}" for v in values)
    return f"{label:<36}{cells}"


def print_shares(name: str, rows: list[dict], bounds: dict | None) -> None:
    caps = [row["host_blocks"] for row in rows]
    print(f"\n{name}: share of oracle-admit's gain over LRU (blocks saved)")
    print(f"{'variant | policy':<36}" + "".join(f"{c:>8}" for c in caps))
    for column in [k for k in rows[0] if " | " in k]:
        print(_line(column, [row[column]["share"] for row in rows]))
    if bounds is not None:
        print(_line("admission_bound.py best", [bounds.get(c) for c in caps]))
        twice = [None if bounds.get(c) is None else 2 * bounds[c] for c in caps]
        print(_line("2 x admission_bound.py best", twice))


def print_unhinted(rows: list[dict]) -> None:
    caps = [row["host_blocks"] for row in rows]
    print("hit rate (blocks saved / blocks) of each half of the conversations")
    print(f"{'half | run':<36}" + "".join(f"{c:>8}" for c in caps))
    for policy in POLICIES:
        for half, who in (
            ("unhinted", "unhinted_half_rate"),
            ("hinted", "hinted_half_rate"),
        ):
            for variant in ("none", "half"):
                column = f"{variant} | {policy}"
                if column in rows[0]:
                    values = [row[column][who] for row in rows]
                    label = f"{half} | {variant} {policy}"
                    print(_line(label, values, "{:>8.4f}"))


def bar(rows: list[dict], bounds: dict) -> dict:
    """The issue's bar at 8k and 16k host blocks, for the default policy."""
    out = {}
    for row in rows:
        c, b = row["host_blocks"], bounds.get(row["host_blocks"])
        if c not in (8000, 16000) or b is None:
            continue
        right = row["right | prefix_aware"]["share"]
        wrong = row["fifth wrong | prefix_aware"]["share"]
        out[c] = {
            "bound": b,
            "right": right,
            "fifth_wrong": wrong,
            "right_at_least_2x_bound": right >= 2 * b,
            "fifth_wrong_beats_bound": wrong > b,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacities", type=int, nargs="+", default=CAPACITIES)
    parser.add_argument("--retain-share", type=float, default=DEFAULT_RETAIN_SHARE)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--bound", choices=["compute", "file", "quote"], default="compute"
    )
    parser.add_argument("--out", default=str(RESULTS / "hint_replay.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    jobs = jobs_for(args.capacities, args.bound)
    with ProcessPoolExecutor(
        args.jobs, initializer=_init, initargs=(args.retain_share,)
    ) as pool:
        results = dict(pool.map(_run, jobs, chunksize=2))
    bounds = bound_shares(args.capacities, args.bound, results)
    report: dict = {"bound": {"source": args.bound, "best_share": bounds}}
    for name in STREAMS:
        rows = stream_rows(name, args.capacities, results)
        print_shares(name, rows, bounds if name == "conversation" else None)
        print_unhinted(rows)
        report[name] = rows
    report["bar"] = bar(report["conversation"], bounds)
    print(f"\nbar (prefix_aware): {json.dumps(report['bar'])}")
    report["meta"] = {
        "retain_share": args.retain_share,
        "slack": [SLACK, SLACK_S],
        "wrong_share": WRONG_SHARE,
        "seed": SEED,
        "seconds": time.perf_counter() - start,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} in {report['meta']['seconds']:.0f} s")


if __name__ == "__main__":
    main()
