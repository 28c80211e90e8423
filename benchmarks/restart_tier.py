"""Restarts with `--swap-space-path`: start-up time and time to first token after a
restart.

Two figures, both on the CPU platform:

1. Start-up cost of a full tier of N GiB, without the engine: mapping the worker's data
   file and reading the index into the host pool, for a tier written by an earlier
   process (every record valid), against a new tier (file created, space reserved and
   backed).
2. Time to first token of each document's first read after a restart (the tier was
   filled by an earlier engine, then the engine exited), against a cold start (the same
   flags and an empty tier directory). Fresh engine processes, arms alternated in each
   pair, median of the pairs with their range; greedy outputs of both arms compared.

    python benchmarks/restart_tier.py [--pairs 3] [--docs 8] [--doc-tokens 1500]
        [--sizes-gib 1 4] [--dir /dev/shm/restart-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.engine_runs import (
    FIGURES,
    document_engine,
    documents,
    print_result,
    read_documents,
    run_engine_process,
    spread,
)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def startup_components(path: Path, gib: float, block_bytes: int) -> dict[str, float]:
    """Seconds to open a new tier of `gib` GiB and to reopen it full, without an
    engine."""
    from vllm_cpu_offload.persist.block_index import BlockIndex
    from vllm_cpu_offload.persist.data_file import TierDataFile
    from vllm_cpu_offload.scheduler.block_pool import HostBlockPool
    from vllm_cpu_offload.scheduler.policies.registry import make_policy

    blocks = int(gib * (1 << 30)) // block_bytes
    fingerprint = {"bench": "restart", "num_host_blocks": blocks}
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True)

    def open_tier(fill: bool) -> tuple[float, float, int]:
        start = time.perf_counter()
        data = TierDataFile(str(path), "tp0-pp0", fingerprint)
        tensor = data.map(blocks, block_bytes, {"layers": "bench"})
        mapped = time.perf_counter() - start
        start = time.perf_counter()
        index = BlockIndex(str(path), fingerprint, blocks, ["tp0-pp0"])
        restored = index.open()
        pool = HostBlockPool(
            blocks, make_policy("prefix_aware", blocks), persistence=index
        )
        adopted = pool.restore((b.host_id, b.key, b.parent) for b in restored)
        indexed = time.perf_counter() - start
        if fill:  # every block written and recorded, chains of 32 blocks
            tensor.fill_(1)
            index.record(
                [
                    (h, (0, h.to_bytes(32, "little")),
                     None if h % 32 == 0 else (0, (h - 1).to_bytes(32, "little")))
                    for h in range(blocks)
                ]
            )  # fmt: skip
        data.close()
        index.close()
        return mapped, indexed, adopted

    new_map, new_index, _ = open_tier(fill=True)
    full_map, full_index, adopted = open_tier(fill=False)
    assert adopted == blocks, (adopted, blocks)
    shutil.rmtree(path, ignore_errors=True)
    return {
        "gib": gib,
        "blocks": blocks,
        "new_map_s": new_map,
        "new_index_s": new_index,
        "full_map_s": full_map,
        "full_index_and_restore_s": full_index,
    }


def engine_run(args: argparse.Namespace) -> None:
    """One engine process: reads every document once; prints init time and TTFTs."""
    start = time.perf_counter()
    llm = document_engine(
        args.doc_tokens,
        enable_cpu_offload=True,
        swap_space=1,
        swap_space_path=args.tier,
    )
    init_s = time.perf_counter() - start
    docs = documents(args, random.Random(7))
    reads = read_documents(llm, docs, args.max_tokens)
    print_result({"init_s": init_s, "reads": reads})
    llm.llm_engine.engine_core.shutdown()


def run_engine(tier: Path, args: argparse.Namespace) -> dict[str, Any]:
    argv = [
        "--tier", str(tier),
        "--docs", str(args.docs), "--doc-tokens", str(args.doc_tokens),
        "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    return run_engine_process("benchmarks.restart_tier", argv)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tier", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--sizes-gib", type=float, nargs="*", default=[1.0, 4.0])
    parser.add_argument(
        "--block-bytes", type=int, default=2 << 20, help="Llama-3-8B's 16 tokens"
    )
    parser.add_argument(
        "--dir", default=None, help="where tiers go (default: /dev/shm)"
    )
    args = parser.parse_args()
    if args.engine_run:
        engine_run(args)
        return
    root = Path(args.dir or tempfile.mkdtemp(prefix="restart-bench-", dir="/dev/shm"))
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    startup = [
        startup_components(root / "synthetic", g, args.block_bytes)
        for g in args.sizes_gib
    ]
    for row in startup:
        print(
            f"tier {row['gib']:g} GiB ({row['blocks']} blocks): new: map "
            f"{row['new_map_s']:.3f} s, index {row['new_index_s']:.3f} s; full: map "
            f"{row['full_map_s']:.3f} s, index and restore "
            f"{row['full_index_and_restore_s']:.3f} s"
        )
    arms: dict[str, list[dict[str, Any]]] = {"restart": [], "cold": []}
    for pair in range(args.pairs):
        warm = root / f"warm-{pair}"
        run_engine(warm, args)  # fills the tier, then exits
        order = ("restart", "cold") if pair % 2 == 0 else ("cold", "restart")
        for arm in order:
            tier = warm if arm == "restart" else root / f"cold-{pair}"
            arms[arm].append(run_engine(tier, args))
            shutil.rmtree(tier, ignore_errors=True)
    outputs = [
        [r["tokens"] for r in run["reads"]] for runs in arms.values() for run in runs
    ]
    exact = all(out == outputs[0] for out in outputs)
    summary: dict[str, Any] = {"startup_components": startup, "outputs_equal": exact}
    for arm, runs in arms.items():
        ttft = [statistics.median(r["seconds"] for r in run["reads"]) for run in runs]
        cached = [statistics.median(r["cached"] for r in run["reads"]) for run in runs]
        summary[arm] = {
            "ttft_s": spread(ttft),
            "init_s": spread([run["init_s"] for run in runs]),
            "cached_tokens": spread(cached),
        }
        init = summary[arm]["init_s"]["median"]
        print(
            f"{arm:8s} first read TTFT {statistics.median(ttft) * 1e3:.0f} ms "
            f"({min(ttft) * 1e3:.0f}-{max(ttft) * 1e3:.0f}), engine start {init:.1f} "
            f"s, cached tokens {statistics.median(cached):.0f}"
        )
    ratios = [
        statistics.median(c["seconds"] for c in cold["reads"])
        / statistics.median(r["seconds"] for r in warm["reads"])
        for cold, warm in zip(arms["cold"], arms["restart"], strict=True)
    ]
    summary["ttft_speedup"] = spread(ratios)
    print(
        f"first read after a restart {statistics.median(ratios):.2f}x faster "
        f"({min(ratios):.2f}-{max(ratios):.2f}); greedy outputs equal: {exact}"
    )
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / "restart_tier_cpu.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
