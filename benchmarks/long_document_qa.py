"""Long-document QA, the workload of PR 11532: prefix caching alone vs
--enable-cpu-offload.

N documents of L tokens are each read once (warm-up), then re-read in a repeat order;
the device KV cache holds about 8 documents and the host tier about 30. Requests are
sent one at a time, so a request's latency is its time to first token (one output token
by default). A last phase with no reuse at all (every prompt unique) measures the
overhead of the tier.

A fair A/B: each arm is a fresh process running vLLM as users run it (the default
multiprocess engine: engine core and worker in their own processes, OpenMP threads bound
by vLLM's CPU executor, the same cores with and without the flag). Arms are started
alternately, `--pairs` times (A B, B A, A B, ...), on the same prompts; the tables give
the median of the pairs and their range. Each phase also records the machine's steal
time and the CPU time of the engine's processes, so that a slow spell of the host shows
up as what it is.

    python benchmarks/long_document_qa.py                   # N = 16, 32, 64, 3 pairs
    python benchmarks/long_document_qa.py --docs 16 --pairs 1  # the quick version
    python benchmarks/long_document_qa.py --docs 10 --doc-tokens 1500 \\
        --device-blocks 200 --max-tokens 16 --no-reuse-docs 0  # the exactness check

The dtype and the model's depth come from what this CPU does fast (`--dtype auto`,
`--layers 0`): a matrix-product probe at the start (benchmarks/matmul_rate.py, under a
second) picks bf16 where the CPU multiplies it faster than fp32 (AMX, AVX512-BF16) and
fp32 elsewhere (an AVX2-only CPU runs bf16 about 100x slower), then the deepest model
(8, 4 or 2 layers of the same width) whose 1,000-token prefill fits MISS_BUDGET_S at the
probed rate. It prints the rates and the choice; `--dtype` and `--layers` (or
`--quick`: 4 layers) fix them instead.

Prints one table per N and the ratios, writes JSON and a plot to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Run as a script (scripts/demo.sh): the repository root makes `benchmarks` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.matmul_rate import Rates, choose_dtype, probe  # noqa: E402
from vllm_cpu_offload.testing.tiny_model import (  # noqa: E402
    TinyLlamaShape,
    ensure_tiny_llama,
    random_token_ids,
)

BLOCK_SIZE = 32
RESULTS = Path(__file__).parent / "results"
ARMS = ("prefix-caching", "cpu-offload")

# Wide enough that a document's prefill dominates the fixed cost of a request on a CPU,
# small enough that a full run fits in minutes on 2 cores.
BENCH_SHAPE = TinyLlamaShape(
    num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1536
)
QUICK_SHAPE = replace(BENCH_SHAPE, num_layers=4)
# The depths --layers 0 chooses from, deepest first.
LAYER_CHOICES = (BENCH_SHAPE.num_layers, QUICK_SHAPE.num_layers, 2)
# The longest a 1,000-token prefill of the chosen model may take at the probed one-core
# matmul rate. The quick version (--docs 16 --pairs 1) pays about 93 misses and two
# engine start-ups (about 65 s). Measured on a 2-core AVX-512 EPYC (one core: bf16 215
# GFLOP/s, fp32 98): a miss of the 8-layer model (58 GFLOP) takes 0.40 s in bf16 and
# 0.64 s in fp32, about 0.7 and 0.9 of the probe's rate, and the run 102 and 129 s. At
# 0.7 s by the probe a miss stays near a second: 3 minutes at most. An AVX2-only CPU
# (one core: fp32 67 GFLOP/s, bf16 0.5) gets fp32 and 4 layers.
MISS_BUDGET_S = 0.7
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def prefill_gflop(shape: TinyLlamaShape, tokens: int) -> float:
    """The matmul work of one prefill of `tokens` tokens: the layers' projections and
    causal attention (the logits of the last token are left out)."""
    h, inter = shape.hidden_size, shape.intermediate_size
    kv = shape.num_kv_heads * (h // shape.num_heads)
    projections = 2 * (2 * h * h + 2 * kv * h + 3 * h * inter)  # q o, k v, MLP
    attention = 2 * h * tokens  # QK^T and PV over half the context on average
    return shape.num_layers * tokens * (projections + attention) / 1e9


def shape_of(layers: int) -> TinyLlamaShape:
    return replace(BENCH_SHAPE, num_layers=layers)


def choose_layers(rate_gflops: float, doc_tokens: int) -> int:
    """The deepest of LAYER_CHOICES whose prefill of a 1,000-token document (or of
    `doc_tokens`, if longer) fits MISS_BUDGET_S at `rate_gflops`."""
    tokens = max(doc_tokens, 1000)
    for layers in LAYER_CHOICES:
        if prefill_gflop(shape_of(layers), tokens) / rate_gflops <= MISS_BUDGET_S:
            return layers
    return LAYER_CHOICES[-1]


def resolve_sizing(args: argparse.Namespace) -> tuple[str, int, Rates | None]:
    """The dtype and depth to run: as given, or from a probe of this CPU."""
    layers = QUICK_SHAPE.num_layers if args.quick else args.layers
    if args.dtype != "auto" and layers:
        return args.dtype, layers, None
    rates = probe()
    dtype = choose_dtype(rates) if args.dtype == "auto" else args.dtype
    if not layers:
        layers = choose_layers(rates.gflops[dtype], args.doc_tokens)
    return dtype, layers, rates


@dataclass
class PhaseResult:
    arm: str
    docs: int
    wall_s: float
    ttft_mean_ms: float
    ttft_p90_ms: float
    prompt_tokens: int
    cached_tokens: int  # device and host hits, vLLM's own per-request count
    host_hit_tokens: int  # from the connector's Prometheus counter
    # Time per request that hit nothing: the cost of one document's prefill
    # in this phase.
    miss_ms_median: float
    misses: int
    steal_s: (
        float  # machine-wide, from /proc/stat: time the hypervisor ran someone else
    )
    engine_cpu_s: float  # user + system time of this process and the engine's processes
    tokens: list[list[int]]  # greedy output of each request, in order


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


def _steal_seconds() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    # cpu user nice system idle ... steal
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def _engine_cpu_seconds() -> float:
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def _host_hits(llm: Any) -> int:
    for metric in llm.get_metrics():
        if metric.name == "vllm:cpu_offload_hit_tokens":
            return int(metric.value)
    return 0


def _make_llm(args: argparse.Namespace, shape: TinyLlamaShape, offload: bool) -> Any:
    from vllm import LLM

    doc_blocks = -(-args.doc_tokens // BLOCK_SIZE)
    kwargs: dict[str, Any] = dict(
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=args.device_blocks or args.device_docs * doc_blocks,
        max_model_len=doc_blocks * BLOCK_SIZE + BLOCK_SIZE + args.max_tokens,
        max_num_seqs=4,
        max_num_batched_tokens=4096,
        dtype=args.dtype,
        seed=0,
        # Both arms: the host-hit counter comes from the metrics.
        disable_log_stats=False,
    )
    if offload:
        head_dim = shape.hidden_size // shape.num_heads
        block_bytes = (
            2
            * shape.num_layers
            * BLOCK_SIZE
            * shape.num_kv_heads
            * head_dim
            * DTYPE_BYTES[args.dtype]
        )
        kwargs |= dict(
            enable_cpu_offload=True,
            swap_space=args.host_docs * doc_blocks * block_bytes / (1 << 30),
        )
    return LLM(args.model, **kwargs)


def _phase(
    llm: Any, arm: str, prompts: list[list[int]], order: list[int], max_tokens: int
) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    host_before, steal_before, cpu_before = (
        _host_hits(llm),
        _steal_seconds(),
        _engine_cpu_seconds(),
    )
    latencies, misses, tokens, cached, prompt_tokens = [], [], [], 0, 0
    start = time.perf_counter()
    for i in order:
        t0 = time.perf_counter()
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=prompts[i])], params, use_tqdm=False
        )[0]
        latency = time.perf_counter() - t0
        latencies.append(latency)
        hit = out.num_cached_tokens or 0
        if hit < BLOCK_SIZE:
            misses.append(latency)
        cached += hit
        prompt_tokens += len(out.prompt_token_ids)
        tokens.append(list(out.outputs[0].token_ids))
    wall = time.perf_counter() - start
    latencies.sort()
    return asdict(
        PhaseResult(
            arm=arm,
            docs=len(prompts),
            wall_s=wall,
            ttft_mean_ms=1000 * statistics.fmean(latencies),
            ttft_p90_ms=1000
            * latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            host_hit_tokens=_host_hits(llm) - host_before,
            miss_ms_median=1000 * statistics.median(misses) if misses else 0.0,
            misses=len(misses),
            steal_s=_steal_seconds() - steal_before,
            engine_cpu_s=_engine_cpu_seconds() - cpu_before,
            tokens=tokens,
        )
    )


def run_arm(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One engine: every N (after a reset of both tiers) and the no-reuse phase."""
    shape = shape_of(args.layers)
    arm = args.run_arm
    llm = _make_llm(args, shape, offload=arm == "cpu-offload")
    results = []
    try:
        for n in args.docs:
            assert llm.reset_prefix_cache(reset_connector=True), "a block is still held"
            rng = random.Random(n)
            prompts = [random_token_ids(rng, args.doc_tokens) for _ in range(n)]
            warm = _phase(llm, arm, prompts, list(range(n)), args.max_tokens)
            order = _repeat_order(n, args.repeat_mode, rng)
            again = _phase(llm, arm, prompts, order, args.max_tokens)
            results.append({"docs": n, "warmup": warm, "reread": again})
        if args.no_reuse_docs:
            assert llm.reset_prefix_cache(reset_connector=True), "a block is still held"
            rng = random.Random(12345)
            unique = [
                random_token_ids(rng, args.doc_tokens)
                for _ in range(args.no_reuse_docs)
            ]
            once = _phase(llm, arm, unique, list(range(len(unique))), args.max_tokens)
            results.append({"docs": 0, "no_reuse": once})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return results


def _spawn_arm(arm: str, argv: list[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "arm.json"
        cmd = [
            sys.executable,
            __file__,
            *argv,
            "--run-arm",
            arm,
            "--arm-json",
            str(out),
        ]
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine as users run it
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the {arm} arm failed:\n{proc.stderr[-4000:]}")
        return list(json.loads(out.read_text()))


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(s: dict[str, float], unit: str = "x", digits: int = 2) -> str:
    return (
        f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
    )


def summarize(pairs: list[dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Median and range over the pairs; prints the tables."""
    summary: dict[str, Any] = {"docs": [], "outputs_equal": True}
    base0 = pairs[0]["prefix-caching"]
    for i, entry in enumerate(base0):
        if "reread" not in entry:
            continue
        rows = {arm: [p[arm][i] for p in pairs] for arm in ARMS}
        equal = all(
            p["prefix-caching"][i][ph]["tokens"] == p["cpu-offload"][i][ph]["tokens"]
            for p in pairs
            for ph in ("warmup", "reread")
        )
        summary["outputs_equal"] &= equal
        speedups = [
            b["reread"]["wall_s"] / o["reread"]["wall_s"]
            for b, o in zip(rows["prefix-caching"], rows["cpu-offload"], strict=True)
        ]
        row: dict[str, Any] = {
            "docs": entry["docs"],
            "reread_speedup": _spread(speedups),
        }
        print(
            f"\n{entry['docs']} documents, re-read phase (median of {len(pairs)} "
            "pairs, range)"
        )
        for arm in ARMS:
            r = [x["reread"] for x in rows[arm]]
            stats = {
                key: _spread([x[key] for x in r])
                for key in (
                    "wall_s",
                    "ttft_mean_ms",
                    "ttft_p90_ms",
                    "miss_ms_median",
                    "steal_s",
                )
            }
            stats["host_hit_tokens"] = _spread([x["host_hit_tokens"] for x in r])
            stats["cached_tokens"] = _spread([x["cached_tokens"] for x in r])
            warm_miss = _spread([x["warmup"]["miss_ms_median"] for x in rows[arm]])
            row[arm] = stats | {"warmup_miss_ms_median": warm_miss}
            print(
                f"  {arm:>15}: {_fmt(stats['wall_s'], ' s')}, TTFT mean "
                f"{_fmt(stats['ttft_mean_ms'], ' ms', 0)}, p90 "
                f"{_fmt(stats['ttft_p90_ms'], ' ms', 0)}, host hits "
                f"{stats['host_hit_tokens']['median']:.0f}, a miss "
                f"{stats['miss_ms_median']['median']:.0f} ms (warm-up "
                f"{warm_miss['median']:.0f})"
            )
        print(
            f"  re-read speed-up {_fmt(row['reread_speedup'])}; outputs equal: {equal}"
        )
        summary["docs"].append(row)
    if "no_reuse" in base0[-1]:
        # Same prompts in both arms: the throughput ratio is the inverse ratio
        # of wall times.
        ratios = [
            p["prefix-caching"][-1]["no_reuse"]["wall_s"]
            / p["cpu-offload"][-1]["no_reuse"]["wall_s"]
            for p in pairs
        ]
        ratio = summary["no_reuse_throughput_ratio"] = _spread(ratios)
        print(
            f"\nno reuse: throughput with the flag {_fmt(ratio, 'x', 3)} of the "
            "baseline"
        )
    print(
        f"greedy outputs of both arms equal in every pair: {summary['outputs_equal']}"
    )
    return summary


def _plot(summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    rows = summary["docs"]
    width = 0.38
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for offset, arm, label in (
        (-1, ARMS[0], "prefix caching"),
        (1, ARMS[1], "--enable-cpu-offload"),
    ):
        med = [r[arm]["wall_s"]["median"] for r in rows]
        err = [
            [m - r[arm]["wall_s"]["min"] for m, r in zip(med, rows, strict=True)],
            [r[arm]["wall_s"]["max"] - m for m, r in zip(med, rows, strict=True)],
        ]
        ax.bar(
            [x + offset * width / 2 for x in xs],
            med,
            width,
            yerr=err,
            capsize=3,
            label=label,
        )
    ax.set_xticks(list(xs), [str(r["docs"]) for r in rows])
    ax.set_xlabel("documents")
    ax.set_ylabel("re-read phase, seconds")
    ax.set_title("Long-document QA re-read (median of pairs and range)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--device-docs", type=int, default=8)
    parser.add_argument(
        "--device-blocks", type=int, default=0, help="overrides --device-docs"
    )
    parser.add_argument("--host-docs", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument(
        "--repeat-mode", default="random", choices=["random", "tile", "interleave"]
    )
    parser.add_argument("--no-reuse-docs", type=int, default=24)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPE_BYTES),
        help="auto: the one this CPU multiplies faster",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="the model's depth (0: the deepest that this CPU runs fast enough)",
    )
    parser.add_argument("--quick", action="store_true", help="4 layers (as --layers 4)")
    parser.add_argument("--out", default=str(RESULTS / "long_document_qa.json"))
    parser.add_argument("--run-arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--arm-json", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.run_arm:
        Path(args.arm_json).write_text(json.dumps(run_arm(args)))
        return
    dtype, layers, rates = resolve_sizing(args)
    shape = shape_of(layers)
    miss = prefill_gflop(shape, args.doc_tokens)
    if rates is not None:
        print(f"CPU {rates.describe()}")
        how = {True: "probed", False: "given"}
        print(
            f"chose {dtype} ({how[args.dtype == 'auto']}) and {layers} layers "
            f"({how[not args.layers and not args.quick]}): a {args.doc_tokens}-token "
            f"prefill is {miss:.0f} GFLOP, {miss / rates.gflops[dtype]:.2f} s at the "
            "probed rate"
        )
    else:
        print(f"given: {dtype}, {layers} layers")
    model = str(ensure_tiny_llama(shape))
    print(
        f"model {shape.name} in {dtype}: {shape.num_layers} layers, "
        f"hidden {shape.hidden_size}; "
        f"documents of {args.doc_tokens} tokens; device cache "
        f"{args.device_blocks or args.device_docs * -(-args.doc_tokens // BLOCK_SIZE)} "
        f"blocks, host tier {args.host_docs} documents; repeat order "
        f"{args.repeat_mode}; {args.pairs} pairs of fresh engines, started alternately"
    )
    argv = [
        "--model", model, "--docs", *map(str, args.docs),
        "--doc-tokens", str(args.doc_tokens), "--device-docs", str(args.device_docs),
        "--device-blocks", str(args.device_blocks),
        "--host-docs", str(args.host_docs), "--max-tokens", str(args.max_tokens),
        "--repeat-mode", args.repeat_mode, "--no-reuse-docs", str(args.no_reuse_docs),
        "--dtype", dtype, "--layers", str(layers),
    ]  # fmt: skip
    pairs = []
    for i in range(args.pairs):
        order = ARMS if i % 2 == 0 else ARMS[::-1]
        pair = {}
        for arm in order:
            t0 = time.perf_counter()
            pair[arm] = _spawn_arm(arm, argv)
            print(
                f"pair {i + 1}: {arm} done in {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
        pairs.append(pair)
    summary = summarize(pairs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "dtype": dtype,
                "rates": None if rates is None else rates.gflops,
                "model": asdict(shape),
                "summary": summary,
                "pairs": pairs,
            }
        )
    )
    print(f"json: {out}")
    _plot(summary, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
