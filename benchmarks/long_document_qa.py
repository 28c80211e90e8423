"""Long-document QA, the workload of PR 11532: prefix caching alone vs --enable-cpu-offload.

N documents of L tokens are each read once (warm-up), then re-read in a repeat order; the
device KV cache holds about 8 documents and the host tier about 30. Requests are sent one at
a time with one output token, so a request's latency is its time to first token. Both modes
run in this process, one after the other, on the same prompts. A last run with no reuse at
all (every prompt unique) measures the overhead of the tier.

    python benchmarks/long_document_qa.py                   # N = 16, 32, 64 (about 10 min)
    python benchmarks/long_document_qa.py --docs 16 --quick # one N, fewer layers (CI smoke)

Prints one table per N and the ratios, writes JSON and a plot to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read the connector's counters directly
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from vllm_cpu_offload.testing.tiny_model import TinyLlamaShape, ensure_tiny_llama, random_token_ids

BLOCK_SIZE = 32
RESULTS = Path(__file__).parent / "results"

# Wide enough that a document's prefill dominates the fixed cost of a request on a CPU,
# small enough that a full run fits in minutes on 2 cores.
BENCH_SHAPE = TinyLlamaShape(
    num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1536
)
QUICK_SHAPE = TinyLlamaShape(
    num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1536
)


@dataclass
class PhaseResult:
    mode: str
    docs: int
    wall_s: float
    ttft_mean_ms: float
    ttft_p90_ms: float
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int


def _repeat_order(n: int, mode: str, rng: random.Random) -> list[int]:
    if mode == "random":
        order = list(range(n))
        rng.shuffle(order)
        return order
    if mode == "tile":
        return list(range(n))
    if mode == "interleave":  # each document twice in a row
        return [i for i in range(n) for _ in range(2)]
    raise ValueError(f"unknown repeat mode {mode!r}; choose random, tile or interleave")


def _make_llm(
    model: str,
    offload: bool,
    doc_tokens: int,
    device_docs: int,
    host_docs: int,
    shape: TinyLlamaShape,
) -> Any:
    from vllm import LLM

    doc_blocks = -(-doc_tokens // BLOCK_SIZE)
    kwargs: dict[str, Any] = dict(
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=device_docs * doc_blocks,
        max_model_len=doc_blocks * BLOCK_SIZE + BLOCK_SIZE,
        max_num_seqs=4,
        max_num_batched_tokens=4096,
        dtype="bfloat16",
        seed=0,
        disable_log_stats=True,
    )
    if offload:
        head_dim = shape.hidden_size // shape.num_heads
        block_bytes = 2 * shape.num_layers * BLOCK_SIZE * shape.num_kv_heads * head_dim * 2
        kwargs |= dict(
            enable_cpu_offload=True,
            swap_space=host_docs * doc_blocks * block_bytes / (1 << 30),
        )
    return LLM(model, **kwargs)


def _host_hits(llm: Any) -> int:
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return 0 if connector is None else int(connector.scheduler.stats.hit_tokens)


def _phase(llm: Any, mode: str, prompts: list[list[int]], order: list[int]) -> PhaseResult:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)
    host_before = _host_hits(llm)
    latencies, cached, prompt_tokens = [], 0, 0
    start = time.perf_counter()
    for i in order:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompts[i])], params, use_tqdm=False)[0]
        latencies.append(time.perf_counter() - t0)
        cached += out.num_cached_tokens or 0
        prompt_tokens += len(out.prompt_token_ids)
    wall = time.perf_counter() - start
    host = _host_hits(llm) - host_before
    latencies.sort()
    return PhaseResult(
        mode=mode,
        docs=len(prompts),
        wall_s=wall,
        ttft_mean_ms=1000 * statistics.fmean(latencies),
        ttft_p90_ms=1000 * latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
        prompt_tokens=prompt_tokens,
        device_hit_tokens=cached - host,
        host_hit_tokens=host,
    )


def run_mode(
    model: str, offload: bool, args: argparse.Namespace, shape: TinyLlamaShape, docs: list[int]
) -> list[dict[str, Any]]:
    """One engine per mode; every N and the no-reuse run on it, after a reset between N."""
    llm = _make_llm(model, offload, args.doc_tokens, args.device_docs, args.host_docs, shape)
    mode = "cpu-offload" if offload else "prefix-caching"
    results = []
    try:
        for n in docs:
            llm.reset_prefix_cache(reset_connector=True)
            rng = random.Random(n)
            prompts = [random_token_ids(rng, args.doc_tokens) for _ in range(n)]
            warm = _phase(llm, mode, prompts, list(range(n)))
            again = _phase(llm, mode, prompts, _repeat_order(n, args.repeat_mode, rng))
            results.append({"docs": n, "warmup": asdict(warm), "reread": asdict(again)})
        llm.reset_prefix_cache(reset_connector=True)
        rng = random.Random(12345)
        unique = [random_token_ids(rng, args.doc_tokens) for _ in range(args.no_reuse_docs)]
        once = _phase(llm, mode, unique, list(range(len(unique))))
        results.append({"docs": 0, "no_reuse": asdict(once)})
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return results


def _print(base: list[dict[str, Any]], off: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    head = (
        f"{'docs':>5} {'mode':>15} {'reread s':>9} {'TTFT mean':>10} {'TTFT p90':>9} "
        f"{'device hit':>11} {'host hit':>9}"
    )
    print(head)
    print("-" * len(head))
    for b, o in zip(base, off, strict=True):
        if "reread" not in b:
            continue
        for r in (b["reread"], o["reread"]):
            print(
                f"{r['docs']:>5} {r['mode']:>15} {r['wall_s']:>9.2f} {r['ttft_mean_ms']:>8.1f}ms "
                f"{r['ttft_p90_ms']:>7.1f}ms {r['device_hit_tokens']:>11} {r['host_hit_tokens']:>9}"
            )
        speedup = b["reread"]["wall_s"] / o["reread"]["wall_s"]
        ttft = b["reread"]["ttft_mean_ms"] / o["reread"]["ttft_mean_ms"]
        print(f"{'':>5} {'ratio':>15} re-read {speedup:.2f}x faster, mean TTFT {ttft:.2f}x lower")
        rows.append({"docs": b["docs"], "reread_speedup": speedup, "ttft_ratio": ttft})
    nb, no = base[-1]["no_reuse"], off[-1]["no_reuse"]
    throughput = (no["prompt_tokens"] / no["wall_s"]) / (nb["prompt_tokens"] / nb["wall_s"])
    print(
        f"no reuse ({nb['docs']} unique prompts): prefix-caching {nb['wall_s']:.2f}s, "
        f"cpu-offload {no['wall_s']:.2f}s -> throughput {throughput:.3f}x of the baseline"
    )
    rows.append({"docs": 0, "no_reuse_throughput_ratio": throughput})
    return rows


def _plot(base: list[dict[str, Any]], off: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    docs = [b["docs"] for b in base if "reread" in b]
    width = 0.38
    xs = range(len(docs))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(
        [x - width / 2 for x in xs],
        [b["reread"]["wall_s"] for b in base if "reread" in b],
        width,
        label="prefix caching",
    )
    ax.bar(
        [x + width / 2 for x in xs],
        [o["reread"]["wall_s"] for o in off if "reread" in o],
        width,
        label="--enable-cpu-offload",
    )
    ax.set_xticks(list(xs), [str(d) for d in docs])
    ax.set_xlabel("documents")
    ax.set_ylabel("re-read phase, seconds")
    ax.set_title("Long-document QA re-read (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--device-docs", type=int, default=8)
    parser.add_argument("--host-docs", type=int, default=30)
    parser.add_argument("--repeat-mode", default="random", choices=["random", "tile", "interleave"])
    parser.add_argument("--no-reuse-docs", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="a smaller model, for a smoke run")
    args = parser.parse_args()

    shape = QUICK_SHAPE if args.quick else BENCH_SHAPE
    model = str(ensure_tiny_llama(shape))
    print(
        f"model {shape.name}: {shape.num_layers} layers, hidden {shape.hidden_size}; "
        f"documents of {args.doc_tokens} tokens; device cache {args.device_docs} documents, "
        f"host tier {args.host_docs}; repeat order {args.repeat_mode}"
    )
    base = run_mode(model, False, args, shape, args.docs)
    off = run_mode(model, True, args, shape, args.docs)
    ratios = _print(base, off)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "long_document_qa.json"
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "model": asdict(shape),
                "prefix_caching": base,
                "cpu_offload": off,
                "ratios": ratios,
            },
            indent=1,
        )
    )
    print(f"json: {out}")
    _plot(base, off, RESULTS / "long_document_qa.png")


if __name__ == "__main__":
    main()
