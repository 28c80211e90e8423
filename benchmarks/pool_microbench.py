"""Cost per block of the host block pool's scheduler-side operations, in microseconds.

For each policy, a pool of `--blocks` blocks is filled with chains of `--chain` blocks
(keys as in production: (group id, 32-byte hash)), then timed:
  lookup      count_hits over a whole held chain (every block a hit, each one touched)
  load        pin + unpin of a whole held chain
  store       allocate_for_store + complete_store of a new chain with free room
  store+evict the same into a full pool, so every block evicts one victim
  evict       (store+evict) - (store): the eviction alone
Prints a table and writes benchmarks/results/pool_microbench.json.

Usage: /work/venv/bin/python benchmarks/pool_microbench.py [--blocks N] [--chain L]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_cpu_offload.scheduler.block_pool import BlockKey, HostBlockPool  # noqa: E402
from vllm_cpu_offload.scheduler.policies.registry import POLICY_NAMES, make_policy  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def make_chains(count: int, length: int, salt: str) -> list[list[BlockKey]]:
    return [
        [
            (0, hashlib.sha256(f"{salt}/{c}/{i}".encode()).digest())
            for i in range(length)
        ]
        for c in range(count)
    ]


def per_block_us(
    run: Callable[[list[BlockKey]], None], chains: list[list[BlockKey]]
) -> float:
    blocks = sum(map(len, chains))
    start = time.perf_counter()
    for chain in chains:
        run(chain)
    return (time.perf_counter() - start) / blocks * 1e6


def bench_policy(
    name: str, num_blocks: int, length: int, rounds: int
) -> dict[str, float]:
    pool = HostBlockPool(num_blocks, make_policy(name, num_blocks), record_events=False)
    chains_held = make_chains(num_blocks // length // 2, length, f"{name}/held")

    def store(chain: list[BlockKey]) -> None:
        allocated = pool.allocate_for_store(chain, None)
        pool.complete_store([key for key, _ in allocated], True)

    def load(chain: list[BlockKey]) -> None:
        pool.pin(chain)
        pool.unpin(chain)

    result: dict[str, float] = {}
    # Half full: stores below find free room.
    result["store"] = per_block_us(store, chains_held)
    rng = random.Random(0)
    sample = [rng.choice(chains_held) for _ in range(rounds)]
    result["lookup"] = per_block_us(pool.count_hits, sample)
    result["load"] = per_block_us(load, sample)
    # Fill the pool, then every new block must evict one.
    store_all = make_chains(num_blocks // length, length, f"{name}/fill")
    for chain in store_all:
        store(chain)
    assert pool.num_free == 0
    fresh = make_chains(rounds, length, f"{name}/fresh")
    result["store+evict"] = per_block_us(store, fresh)
    result["evict"] = result["store+evict"] - result["store"]
    result["lookup+store+evict"] = result["lookup"] + result["store+evict"]
    pool.check_invariants()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=131072)
    parser.add_argument("--chain", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs")
    args = parser.parse_args()

    columns = ["lookup", "load", "store", "store+evict", "evict", "lookup+store+evict"]
    print(
        f"pool of {args.blocks} blocks, chains of {args.chain}; microseconds per block"
    )
    print(f"{'policy':<14}" + "".join(f"{c:>20}" for c in columns))
    rows = []
    for name in POLICY_NAMES:
        runs = [
            bench_policy(name, args.blocks, args.chain, args.rounds)
            for _ in range(args.repeat)
        ]
        best = {c: min(r[c] for r in runs) for c in columns}
        rows.append({"policy": name, **best})
        print(f"{name:<14}" + "".join(f"{best[c]:>20.3f}" for c in columns), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "pool_microbench.json"
    meta = {
        "blocks": args.blocks,
        "chain": args.chain,
        "machine": platform.platform(),
        "python": platform.python_version(),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
