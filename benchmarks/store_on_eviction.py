"""Replays the conversation trace with an exclusive host tier: blocks stored when the
device cache evicts them (write-back), not when computed (write-through,
`trace_replay.py`).

A write-through host tier holds copies of the blocks the device cache still holds, so
about `--gpu-blocks` of its capacity serve nothing. Storing on device eviction makes the
two tiers exclusive. This measures what that is worth for our pool's policies, and
checks the replay's Belady limit against one that counts only the uses the device cache
misses.

Model: as in `trace_replay.py`, except that the host tier is offered, after each
request, the blocks the device cache evicted while taking that request's blocks,
ancestors first, grouped into runs of one chain. Host hits are loaded and kept.
`--chain-links` passes each run's parent key, so that `prefix_aware` sees the chains
(descendants reach the host before their ancestors: the device cache evicts chain tails
first).

Usage: python benchmarks/store_on_eviction.py [--host-blocks C ...] [--chain-links]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace_replay import BeladyTier, GpuPrefixCache, load_trace, next_uses  # noqa: E402

from vllm_cpu_offload.scheduler.block_pool import HostBlockPool  # noqa: E402
from vllm_cpu_offload.scheduler.policies.registry import make_policy  # noqa: E402


def device_cache(
    trace: list[list[int]], capacity: int
) -> tuple[list[int], list[list[int]]]:
    """Per request: the device hit, and the keys the LRU device cache evicted for it."""
    gpu = GpuPrefixCache(capacity)
    hits, evicted = [], []
    for keys in trace:
        hits.append(gpu.hit(keys))
        evicted.append(gpu.finish(keys))
    return hits, evicted


def chain_parents(trace: list[list[int]]) -> dict[int, int | None]:
    """Each key's predecessor in the first request that holds it (None at a chain
    root)."""
    parents: dict[int, int | None] = {}
    for keys in trace:
        for prev, key in zip([None, *keys], keys, strict=False):
            parents.setdefault(key, prev)
    return parents


def replay_on_eviction(
    trace: list[list[int]],
    hits: list[int],
    evicted: list[list[int]],
    parents: dict[int, int | None],
    policy: str,
    capacity: int,
    chain_links: bool,
) -> int:
    pool = HostBlockPool(capacity, make_policy(policy, capacity), record_events=False)
    host_hits = 0
    for i, keys in enumerate(trace):
        after = keys[hits[i] :]
        h = pool.count_hits(after)
        if h:
            pool.pin(after[:h])
            pool.unpin(after[:h])
        host_hits += h
        runs: list[list[int]] = []
        for key in reversed(evicted[i]):  # ancestors first
            if runs and parents[key] == runs[-1][-1]:
                runs[-1].append(key)
            else:
                runs.append([key])
        for run in runs:
            held = [key for key in run if key in pool]
            if held:
                pool.touch(held)
            allocated = pool.allocate_for_store(
                run, parents[run[0]] if chain_links else None
            )
            pool.complete_store([key for key, _ in allocated], True)
    return host_hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-blocks", type=int, default=1000)
    parser.add_argument(
        "--host-blocks", type=int, nargs="+", default=[1000, 2000, 3000, 4000]
    )
    parser.add_argument("--chain-links", action="store_true")
    args = parser.parse_args()
    trace = load_trace(None)
    hits, evicted = device_cache(trace, args.gpu_blocks)
    parents = chain_parents(trace)
    misses = next_uses(trace, hits)
    print(f"device hits {sum(hits)}; host hits of each host tier:")
    print(
        f"{'host C':>7} {'lru':>7} {'prefix_aware':>13} "
        f"{'belady, device misses only':>27}"
    )
    for capacity in args.host_blocks:
        row = [
            replay_on_eviction(
                trace, hits, evicted, parents, p, capacity, args.chain_links
            )
            for p in ("lru", "prefix_aware")
        ]
        belady = BeladyTier(capacity, misses)
        row.append(sum(belady.serve(i, keys, hits[i]) for i, keys in enumerate(trace)))
        print(f"{capacity:>7} {row[0]:>7} {row[1]:>13} {row[2]:>27}", flush=True)


if __name__ == "__main__":
    main()
