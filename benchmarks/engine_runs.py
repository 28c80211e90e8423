"""What the engine-process benchmarks share: one engine per process, a document read
loop that records each read's time, cached tokens and greedy tokens, and the median
with its range.

A benchmark's `--engine-run` mode builds its engine, calls `read_documents`, and
prints one `RESULT {json}` line; its driver starts those processes through
`run_engine_process`, so every arm runs in a fresh process with the same layout.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIGURES = REPO / "docs" / "figures"  # where the document benchmarks write their JSON
BLOCK_SIZE = 32


def add_document_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a document benchmark's driver and engine processes."""
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=1)


def document_argv(args: argparse.Namespace, arm: str, store: str) -> list[str]:
    """An engine process's flags: its arm and store, and the driver's documents."""
    return [
        "--arm", arm, "--store", store,
        "--docs", str(args.docs), "--doc-tokens", str(args.doc_tokens),
        "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip


def documents(
    args: argparse.Namespace, rng: random.Random | None = None
) -> list[list[int]]:
    """`args.docs` documents of `args.doc_tokens` random token ids, drawn from `rng`
    (default: seed 11), so that every process of a run reads the same ones."""
    from vllm_cpu_offload.testing.tiny_model import random_token_ids

    rng = rng if rng is not None else random.Random(11)
    return [random_token_ids(rng, args.doc_tokens) for _ in range(args.docs)]


def document_engine(doc_tokens: int, **engine_args: Any) -> Any:
    """The engine these benchmarks read documents with: the benchmark model in bf16,
    blocks of 32 tokens, a device cache of two documents of `doc_tokens`."""
    from vllm import LLM

    from benchmarks.long_document_qa import BENCH_SHAPE
    from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama

    return LLM(
        str(ensure_tiny_llama(BENCH_SHAPE)),
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=2 * (doc_tokens // BLOCK_SIZE + 2),
        max_model_len=doc_tokens + 2 * BLOCK_SIZE,
        dtype="bfloat16",
        seed=0,
        **engine_args,
    )


def read_documents(
    llm: Any, docs: Sequence[list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    """Reads each document once, one request at a time (time to first token when
    `max_tokens` is 1)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reads = []
    for doc in docs:
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=doc)], params, use_tqdm=False)
        reads.append(
            {
                "seconds": time.perf_counter() - start,
                "cached": out[0].num_cached_tokens or 0,
                "tokens": list(out[0].outputs[0].token_ids),
            }
        )
    return reads


def print_result(result: Mapping[str, Any]) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def run_engine_process(
    module: str, argv: Sequence[str], env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Runs `python -m module --engine-run argv...` and returns its RESULT."""
    cmd = [sys.executable, "-m", module, "--engine-run", *argv]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT ")))


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ms(summary: Mapping[str, float]) -> str:
    """'median ms (min-max)' of a spread of seconds."""
    return (
        f"{summary['median'] * 1e3:.0f} ms "
        f"({summary['min'] * 1e3:.0f}-{summary['max'] * 1e3:.0f})"
    )
