"""`--swap-space-remote`: a fresh engine's first read of documents that another engine
computed, against a cold read.

Per pair, on one Mooncake Store (a master and a storage node on loopback): engine A
reads the documents and exits (its blocks written through to the store); then, in an
order that alternates between pairs, engine B (empty device cache and host tier, the
same store) and a cold engine (same flags, an empty store of its own) read them. Fresh
engine processes, the same documents and flags in every arm; median of the pairs with
their range; greedy outputs of all arms compared.

    python benchmarks/shared_tier.py [--pairs 3] [--docs 4] [--doc-tokens 4000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

BLOCK_SIZE = 32
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "figures"


def engine_run(args: argparse.Namespace) -> None:
    """One engine process: reads every document once; prints its TTFTs."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from benchmarks.long_document_qa import BENCH_SHAPE
    from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama, random_token_ids

    llm = LLM(
        str(ensure_tiny_llama(BENCH_SHAPE)),
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=2 * (args.doc_tokens // BLOCK_SIZE + 2),
        max_model_len=args.doc_tokens + 2 * BLOCK_SIZE,
        dtype="bfloat16",
        seed=0,
        enable_cpu_offload=True,
        swap_space=1,
        swap_space_remote=args.store,
    )
    rng = random.Random(11)
    docs = [random_token_ids(rng, args.doc_tokens) for _ in range(args.docs)]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
    )
    reads = []
    for doc in docs:
        start = time.perf_counter()
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=doc)], params, use_tqdm=False
        )[0]
        reads.append(
            {
                "seconds": time.perf_counter() - start,
                "cached": out.num_cached_tokens or 0,
                "tokens": list(out.outputs[0].token_ids),
            }
        )
    print("RESULT " + json.dumps({"reads": reads}))
    # Shutting down lets the queued writes land (bounded) before the process ends.
    llm.llm_engine.engine_core.shutdown()


def run_engine(store: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "benchmarks.shared_tier", "--engine-run",
        "--store", store,
        "--docs", str(args.docs), "--doc-tokens", str(args.doc_tokens),
        "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT ")))


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args()
    if args.engine_run:
        engine_run(args)
        return
    from vllm_cpu_offload.testing.store_servers import MooncakeServers

    arms: dict[str, list[dict[str, Any]]] = {"shared": [], "cold": []}
    for pair in range(args.pairs):
        with MooncakeServers() as shared, MooncakeServers() as empty:
            run_engine(shared.url, args)  # engine A: computes, writes through, exits
            order = ("shared", "cold") if pair % 2 == 0 else ("cold", "shared")
            for arm in order:
                arms[arm].append(
                    run_engine(shared.url if arm == "shared" else empty.url, args)
                )
    outputs = [
        [r["tokens"] for r in run["reads"]] for runs in arms.values() for run in runs
    ]
    exact = all(out == outputs[0] for out in outputs)
    summary: dict[str, Any] = {"args": vars(args), "outputs_equal": exact}
    for arm, runs in arms.items():
        ttft = [statistics.median(r["seconds"] for r in run["reads"]) for run in runs]
        cached = [statistics.median(r["cached"] for r in run["reads"]) for run in runs]
        summary[arm] = {"ttft_s": spread(ttft), "cached_tokens": spread(cached)}
        print(
            f"{arm:7s} first read TTFT {statistics.median(ttft) * 1e3:.0f} ms "
            f"({min(ttft) * 1e3:.0f}-{max(ttft) * 1e3:.0f}), cached tokens "
            f"{statistics.median(cached):.0f}"
        )
    ratios = [
        statistics.median(c["seconds"] for c in cold["reads"])
        / statistics.median(s["seconds"] for s in shared["reads"])
        for cold, shared in zip(arms["cold"], arms["shared"], strict=True)
    ]
    summary["ttft_speedup"] = spread(ratios)
    print(
        f"first read of another engine's documents {statistics.median(ratios):.2f}x "
        f"faster than cold ({min(ratios):.2f}-{max(ratios):.2f}); greedy outputs "
        f"equal: {exact}"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "shared_tier_cpu.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
