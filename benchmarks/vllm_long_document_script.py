"""vLLM's own benchmark_long_document_qa_throughput.py, with and without the two flags.

The script comes from vLLM 0.32.0's source distribution (`scripts/fetch_vllm_sdist.sh`)
and runs by plain python, as its users run it; the flags are appended to its command
line. Arms alternate (A B, B A, ...) for `--pairs` pairs, each a fresh process with
vLLM's default multiprocess engine (the same cores with and without the flag). The
figure is the script's own "Time to execute all requests" of its measured phase (after
its warm-up phase).

    python benchmarks/vllm_long_document_script.py            # 32 documents, 3 pairs

Defaults: 32 documents of 1,000 tokens read twice in random order, a device cache of 8
documents and a host tier of 30, the package's 8-layer generated model in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from vllm_cpu_offload.testing.tiny_model import TinyLlamaShape, ensure_tiny_llama

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
BLOCK_SIZE = 32
SHAPE = TinyLlamaShape(
    num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1536
)
TIME_LINE = re.compile(r"Time to execute all requests: ([0-9.]+) secs")


def _script() -> Path:
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch_vllm_sdist.sh")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return Path(out) / "benchmarks" / "benchmark_long_document_qa_throughput.py"


def _run(cmd: list[str]) -> float:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-6:])} failed:\n{proc.stderr[-3000:]}")
    times = [float(t) for t in TIME_LINE.findall(proc.stdout)]
    assert len(times) == 2, proc.stdout[-2000:]
    return times[1]  # the measured phase; the first is the script's warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--device-docs", type=int, default=8)
    parser.add_argument("--host-docs", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()

    model = str(ensure_tiny_llama(SHAPE))
    doc_blocks = -(-(args.doc_tokens + 1) // BLOCK_SIZE)
    head_dim = SHAPE.hidden_size // SHAPE.num_heads
    block_bytes = 2 * SHAPE.num_layers * BLOCK_SIZE * SHAPE.num_kv_heads * head_dim * 2
    swap_gib = args.host_docs * doc_blocks * block_bytes / (1 << 30)
    base = [
        sys.executable, str(_script()), "--model", model,
        "--num-documents", str(args.docs), "--document-length", str(args.doc_tokens),
        "--output-len", "1", "--repeat-count", "2", "--repeat-mode", "random",
        "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--dtype", "bfloat16",
        "--num-gpu-blocks-override", str(args.device_docs * doc_blocks),
        "--max-model-len", str((doc_blocks + 2) * BLOCK_SIZE),
    ]  # fmt: skip
    arms = {
        "prefix-caching": base,
        "cpu-offload": [
            *base,
            "--enable-cpu-offload",
            "--swap-space",
            f"{swap_gib:.6f}",
        ],
    }
    print(
        f"vLLM's script, {args.docs} documents of {args.doc_tokens} tokens, device "
        f"cache {args.device_docs} documents, host tier {args.host_docs}; {args.pairs} "
        "pairs"
    )
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for i in range(args.pairs):
        order = list(arms) if i % 2 == 0 else list(arms)[::-1]
        for arm in order:
            times[arm].append(_run(arms[arm]))
            print(
                f"pair {i + 1}: {arm} measured phase {times[arm][-1]:.2f} s", flush=True
            )
    speedups = [
        b / o
        for b, o in zip(times["prefix-caching"], times["cpu-offload"], strict=True)
    ]
    for arm, values in times.items():
        print(
            f"{arm:>15}: median {statistics.median(values):.2f} s "
            f"({min(values):.2f}-{max(values):.2f})"
        )
    print(
        f"speed-up with the flags: median {statistics.median(speedups):.2f}x "
        f"({min(speedups):.2f}-{max(speedups):.2f})"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "vllm_long_document_script.json"
    out.write_text(
        json.dumps({"args": vars(args), "seconds": times, "speedups": speedups})
    )
    print(f"json: {out}")


if __name__ == "__main__":
    main()
