"""How often greedy bf16 answers agree when an engine reads KV another TP size computed,
beside how often two engines of different TP sizes agree with each other at all.

KV computed at TP=2 is not bitwise what TP=1 computes: the ranks' partial sums of each
row-parallel layer are added in another order, and bf16 rounds the difference into the
residual stream. So a TP=1 engine that reads a TP=2 engine's blocks from the shared
store cannot be held to its own tokens bit for bit; what it can be held to is agreeing
with itself as often as engines of the two sizes agree with each other. Runs (the
generated tiny Llama, bf16, documents of random tokens read one request at a time,
tests/e2e/long_document_run.py, one core per rank):
- `off1`, `off2`: vLLM without the flags at TP=1 and TP=2;
- `same`: a TP=1 engine with the flags reads what another TP=1 engine wrote to a
  redis-server (the control: the same bytes, so the same tokens);
- `2->1`: a TP=1 engine reads what a TP=2 engine wrote; `1->2` the reverse.
A reader's documents are all first reads served from the store. Reported: how many
documents' answers equal the reader's own TP size without the flags, and how many
`off1` and `off2` share.

    python benchmarks/mixed_tp_agreement.py [--docs 12] [--doc-tokens 300]
        [--max-tokens 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(args: argparse.Namespace, tp: int, store: str | None) -> list[list[int]]:
    """The greedy tokens of each document's first read."""
    from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama

    env = dict(os.environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % 2) for i in range(tp))
    cmd = [
        sys.executable, "-m", "tests.e2e.long_document_run", str(ensure_tiny_llama()),
        "--dtype", args.dtype, "--docs", str(args.docs),
        "--doc-tokens", str(args.doc_tokens), "--max-tokens", str(args.max_tokens),
        "--reads", "1", "--tensor-parallel-size", str(tp),
    ]  # fmt: skip
    if store is not None:
        cmd += ["--offload", "--swap-space-remote", store]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-4000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return [r["tokens"] for r in result["requests"]]


def read_through(args: argparse.Namespace, writer_tp: int, reader_tp: int) -> Any:
    """The reader's tokens, every document first written by a writer of another
    engine through a fresh redis-server."""
    from vllm_cpu_offload.testing.store_servers import RedisServer

    with RedisServer() as server:
        run(args, writer_tp, server.url)
        return run(args, reader_tp, server.url)


def agree(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=12)
    parser.add_argument("--doc-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    off = {tp: run(args, tp, None) for tp in (1, 2)}
    same = read_through(args, 1, 1)
    from_tp2 = read_through(args, 2, 1)
    from_tp1 = read_through(args, 1, 2)
    print(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "dtype": args.dtype,
                "docs": args.docs,
                "max_tokens": args.max_tokens,
                "off1 == off2": agree(off[1], off[2]),
                "same (1->1) == off1": agree(same, off[1]),
                "2->1 == off1": agree(from_tp2, off[1]),
                "1->2 == off2": agree(from_tp1, off[2]),
                "2->1 == off2": agree(from_tp2, off[2]),
                "1->2 == off1": agree(from_tp1, off[1]),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
