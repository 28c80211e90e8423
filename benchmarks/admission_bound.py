"""How much of perfect admission a rule that sees only a request can reach, on the
conversation trace.

`oracle-admit` (LRU that admits only blocks used again) closes 63-92% of the LRU ->
Belady gap from 8,000 host blocks up. Reuse on this trace is nearly all or nothing per
request: a request's new blocks are used again together (its conversation goes on) or
not at all. So an online admission rule is a guess, per request, whether the
conversation goes on, from what a request shows: how many of its blocks are new, how
long a prefix it shares with earlier requests, its output length and its arrival time.

This script gives such rules every advantage. Each feature (and their product) splits
the requests into buckets, and each bucket's reuse rate is taken from the whole trace in
hindsight, a rate no online rule can know. A request's new blocks are then
  - `refuse`: admitted (in front of LRU) only if its bucket's rate is at least t;
  - `evict-first`: always admitted, but into a list evicted before the LRU list while
    not used again (insertion at low priority, as SHiP does for CPU caches).
Printed: each rule's gain over LRU as a share of `oracle-admit`'s gain, for thresholds
t. A share of 1 would be perfect admission; the hit-rate bar asks for 0.5.

Usage: python benchmarks/admission_bound.py [--capacities C ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from trace_replay import (  # noqa: E402
    NEVER,
    OracleAdmitLru,
    OracleAdmitTier,
    OurTier,
    cached_keys,
    load_requests,
    next_uses,
    replay,
)

from vllm_cpu_offload.scheduler.block_pool import HostBlockPool  # noqa: E402
from vllm_cpu_offload.scheduler.policies import LRUPolicy  # noqa: E402
from vllm_cpu_offload.scheduler.policies.base import BlockList, HostBlock  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
CAPACITIES = [8000, 12000, 16000, 32000]
THRESHOLDS = [0.2, 0.25, 0.3, 0.35, 0.4]
FEATURES = ["new", "prefix", "output", "arrival", "new x output", "all four"]
DEVICE_BLOCKS = 1000


def request_buckets(raw: list[dict], trace: list[list[int]]) -> list[dict]:
    """Each request's bucket for every feature, from what it shows when it arrives."""
    seen: set[int] = set()
    out = []
    for request, keys in zip(raw, trace, strict=True):
        shared = 0
        while shared < len(keys) and keys[shared] in seen:
            shared += 1
        seen.update(keys)
        new = min((len(keys) - shared) // 8, 10)
        output = min(request["output_length"] // 128, 10)
        prefix = min(shared, 3)
        arrival = request["timestamp"] // 600_000  # ten-minute windows
        out.append(
            {
                "new": new,
                "prefix": prefix,
                "output": output,
                "arrival": arrival,
                "new x output": (new, output),
                "all four": (new, output, prefix, arrival),
            }
        )
    return out


def hindsight_rates(
    buckets: list[dict], upcoming: list[list[int]], feature: str
) -> dict[Hashable, float]:
    """Share of the block uses in each bucket whose block is used again."""
    counts: dict[Hashable, list[int]] = defaultdict(lambda: [0, 0])
    for bucket, nxt in zip(buckets, upcoming, strict=True):
        count = counts[bucket[feature]]
        count[0] += len(nxt)
        count[1] += sum(use != NEVER for use in nxt)
    return {b: reused / total for b, (total, reused) in counts.items() if total}


class EvictFirstLru(LRUPolicy):
    """LRU with a second list, evicted first, for blocks admitted at low priority; a
    block used again joins the LRU list."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.low_priority: set[int] = set()
        self._first = BlockList()

    def on_ready(self, blocks: Sequence[HostBlock]) -> None:
        for block in blocks:
            first = block.key in self.low_priority
            (self._first if first else self._lru).append(block)

    def on_access(self, blocks: Sequence[HostBlock]) -> None:
        for block in blocks:
            if block.owner is not None:
                block.owner.remove(block)
                self._lru.append(block)

    def on_pin(self, block: HostBlock) -> None:
        if block.owner is not None:
            block.owner.remove(block)

    def on_remove(self, block: HostBlock) -> None:
        if block.owner is not None:
            block.owner.remove(block)

    def pop_victim(self) -> HostBlock | None:
        return self._first.popleft() or self._lru.popleft()


class BucketTier(OurTier):
    """A host tier whose policy learns each request's fate from its bucket's rate."""

    def __init__(self, capacity: int, rule: str, likely: list[bool]) -> None:
        self.policy: OracleAdmitLru | EvictFirstLru
        if rule == "refuse":
            self.policy = OracleAdmitLru(capacity)
        else:
            self.policy = EvictFirstLru(capacity)
        self.pool = HostBlockPool(capacity, self.policy, record_events=False)
        self.likely = likely

    def serve(self, index: int, keys: Sequence[int], gpu_hits: int) -> int:
        likely = self.likely[index]
        if isinstance(self.policy, OracleAdmitLru):
            self.policy.reused = set(keys) if likely else set()
        else:
            self.policy.low_priority = set() if likely else set(keys)
        return super().serve(index, keys, gpu_hits)


_TRACE: list[list[int]] = []
_UPCOMING: list[list[int]] = []
_BUCKETS: list[dict] = []


def _init() -> None:
    global _TRACE, _UPCOMING, _BUCKETS
    raw = load_requests()
    _TRACE = [cached_keys(r) for r in raw]
    _UPCOMING = next_uses(_TRACE)
    _BUCKETS = request_buckets(raw, _TRACE)


def _cell(job: tuple[str, str, float, int]) -> tuple[tuple, int]:
    rule, feature, threshold, capacity = job
    tier: OurTier
    if rule == "lru":
        tier = OurTier("lru", capacity)
    elif rule == "oracle-admit":
        tier = OracleAdmitTier(capacity, _UPCOMING)
    else:
        rates = hindsight_rates(_BUCKETS, _UPCOMING, feature)
        likely = [rates[b[feature]] >= threshold for b in _BUCKETS]
        tier = BucketTier(capacity, rule, likely)
    return job, replay(_TRACE, DEVICE_BLOCKS, tier)["saved"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacities", type=int, nargs="+", default=CAPACITIES)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "admission_bound.json"))
    args = parser.parse_args()
    jobs = [
        (ref, "", 0.0, c) for ref in ("lru", "oracle-admit") for c in args.capacities
    ]
    jobs += [
        (rule, feature, t, c)
        for rule in ("refuse", "evict-first")
        for feature in FEATURES
        for t in THRESHOLDS
        for c in args.capacities
    ]
    with ProcessPoolExecutor(args.jobs, initializer=_init) as pool:
        saved = dict(pool.map(_cell, jobs, chunksize=4))
    rows = []
    print("share of oracle-admit's gain over LRU; thresholds " + str(THRESHOLDS))
    for c in args.capacities:
        low, perfect = saved[("lru", "", 0.0, c)], saved[("oracle-admit", "", 0.0, c)]
        print(f"{c} host blocks: lru saves {low}, oracle-admit {perfect}")
        best = -1e9
        for rule in ("refuse", "evict-first"):
            for feature in FEATURES:
                shares = [
                    (saved[(rule, feature, t, c)] - low) / (perfect - low)
                    for t in THRESHOLDS
                ]
                best = max(best, *shares)
                rows.append(
                    {
                        "host_blocks": c,
                        "rule": rule,
                        "feature": feature,
                        "shares": shares,
                    }
                )
                cells = " ".join(f"{s:6.2f}" for s in shares)
                print(f"  {rule:<11} {feature:<12} {cells}")
        print(f"  best: {best:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"thresholds": THRESHOLDS, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
