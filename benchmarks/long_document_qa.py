"""Long-document QA, the workload of PR 11532: prefix caching alone vs
--enable-cpu-offload, and vs prefix caching given the tier's bytes.

N documents are each read once (warm-up), then re-read in a repeat order; the device KV
cache holds about 8 documents and the host tier about 30. Requests are sent one at a
time, so a request's latency is its time to first token (one output token by default).
A last phase with no reuse at all (every prompt unique) measures the overhead of the
tier. Three arms: prefix caching with the same device cache (PR 11532's comparison,
right where device memory is scarce), the tier, and prefix caching with the tier's
bytes added to the device cache (`equal-ram`: on vLLM's CPU platform the device cache
is host RAM too, so this is what a CPU user would pick instead; where the tier loses to
it, the table says so).

The documents (`--documents auto`): real ones on a trained model where this CPU runs it
fast enough (SmolLM2-135M-Instruct answering a question about each document cut from
the Python reference; the answers to the first three are printed for every arm), else
random words on the generated model, which says so.

A fair A/B: each arm is a fresh process running vLLM as users run it (the default
multiprocess engine: engine core and worker in their own processes, OpenMP threads bound
by vLLM's CPU executor, the same cores in every arm). Arms are started in turn,
`--pairs` times (the order rotating), on the same prompts; the tables give the median
and the range. Each phase also records the machine's steal time and the CPU time of
the engine's processes, so that a slow spell of the host shows up as what it is.

    python benchmarks/long_document_qa.py                   # N = 16, 32, 64, 3 rounds
    python benchmarks/long_document_qa.py --docs 16 --pairs 1  # the quick version
    python benchmarks/long_document_qa.py --docs 10 --doc-tokens 1500 \\
        --device-blocks 200 --max-tokens 16 --no-reuse-docs 0  # the exactness check

The dtype and, for the generated model, the depth come from what this CPU does fast
(`--dtype auto`, `--layers 0`): a matrix-product probe at the start
(benchmarks/matmul_rate.py, under a second) picks bf16 where the CPU multiplies it
faster than fp32 (AMX, AVX512-BF16) and fp32 elsewhere (an AVX2-only CPU runs bf16
about 100x slower), then the real model if its 1,000-token prefill fits
REAL_MISS_BUDGET_S at the probed rate, else the deepest generated model (8, 4 or 2
layers of the same width) whose prefill fits MISS_BUDGET_S. It prints the rates and
the choice; `--documents`, `--dtype` and `--layers` (or `--quick`: 4 layers) fix them.

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

from benchmarks.long_document_tables import ARMS, plot, summarize  # noqa: E402
from benchmarks.matmul_rate import Rates, choose_dtype, probe  # noqa: E402
from benchmarks.qa_documents import REAL_SHAPE, Documents  # noqa: E402
from vllm_cpu_offload.testing.tiny_model import (  # noqa: E402
    TinyLlamaShape,
    ensure_tiny_llama,
)

BLOCK_SIZE = 32
RESULTS = Path(__file__).parent / "results"

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
# The real model's miss at the probed rate, at most: on a 2-core AVX512-BF16 EPYC its
# 1,000-token bf16 prefill is about 1.2 s by the probe, and the quick version stays
# within 5 minutes; an AVX2-only CPU (fp32, about 3.7 s) gets the generated model.
REAL_MISS_BUDGET_S = 1.5
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


def resolve_documents(args: argparse.Namespace, dtype: str, rates: Rates | None) -> str:
    """ "real" or "random": as given, or the real model where its miss fits
    REAL_MISS_BUDGET_S at the probed rate."""
    if args.documents != "auto":
        return str(args.documents)
    rates = rates or probe()
    miss = prefill_gflop(REAL_SHAPE, max(args.doc_tokens, 1000)) / rates.gflops[dtype]
    return "real" if miss <= REAL_MISS_BUDGET_S else "random"


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


def block_bytes(shape: TinyLlamaShape, dtype: str) -> int:
    head_dim = shape.hidden_size // shape.num_heads
    per_token = 2 * shape.num_layers * shape.num_kv_heads * head_dim
    return per_token * BLOCK_SIZE * DTYPE_BYTES[dtype]


def device_blocks(args: argparse.Namespace, arm: str) -> int:
    """The device cache of `arm`; equal-ram's holds the tier's blocks too."""
    doc_blocks = -(-args.doc_tokens // BLOCK_SIZE)
    blocks = args.device_blocks or args.device_docs * doc_blocks
    return blocks + (args.host_docs * doc_blocks if arm == "equal-ram" else 0)


def _make_llm(args: argparse.Namespace, shape: TinyLlamaShape, arm: str) -> Any:
    from vllm import LLM

    doc_blocks = -(-args.doc_tokens // BLOCK_SIZE)
    kwargs: dict[str, Any] = dict(
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=device_blocks(args, arm),
        max_model_len=doc_blocks * BLOCK_SIZE + BLOCK_SIZE + args.max_tokens,
        max_num_seqs=4,
        max_num_batched_tokens=4096,
        dtype=args.dtype,
        seed=0,
        # Both arms: the host-hit counter comes from the metrics.
        disable_log_stats=False,
    )
    if arm == "cpu-offload":
        kwargs |= dict(
            enable_cpu_offload=True,
            swap_space=args.host_docs
            * doc_blocks
            * block_bytes(shape, args.dtype)
            / (1 << 30),
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
    """One engine: every N (after a reset of both tiers), the answers after the
    last N's re-read, and the no-reuse phase."""
    shape = REAL_SHAPE if args.documents == "real" else shape_of(args.layers)
    arm = args.run_arm
    docs = Documents(args.documents, args.model, args.doc_tokens)
    llm = _make_llm(args, shape, arm)
    results: list[dict[str, Any]] = []
    try:
        for n in args.docs:
            assert llm.reset_prefix_cache(reset_connector=True), "a block is still held"
            # The repeat order has a generator of its own (the prompts draw from
            # another of the same seed), so real and random documents are re-read in
            # the same order. Runs before 2026-12-03 drew the order after the prompts
            # from one generator: their orders differ from these.
            rng = random.Random(n)
            prompts = docs.prompts(n, seed=n)
            warm = _phase(llm, arm, prompts, list(range(n)), args.max_tokens)
            order = _repeat_order(n, args.repeat_mode, rng)
            again = _phase(llm, arm, prompts, order, args.max_tokens)
            results.append({"docs": n, "warmup": warm, "reread": again})
        if results:
            results[-1]["answers"] = docs.answers(llm)
        if args.no_reuse_docs:
            assert llm.reset_prefix_cache(reset_connector=True), "a block is still held"
            # Unique prompts: random ones for either model (the reference's documents
            # were all read above).
            unique = Documents("random", args.model, args.doc_tokens).prompts(
                args.no_reuse_docs, seed=12345
            )
            once = _phase(llm, arm, unique, list(range(len(unique))), args.max_tokens)
            results.append({"docs": 0, "no_reuse": once})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return results


def _spawn_arm(arm: str, argv: list[str], kv_gib: int) -> list[dict[str, Any]]:
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
        # Room for the largest device cache of the arms (equal-ram's), in every arm.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the {arm} arm failed:\n{proc.stderr[-4000:]}")
        return list(json.loads(out.read_text()))


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
    parser.add_argument(
        "--documents",
        default="auto",
        choices=("auto", "real", "random"),
        help="real: the trained model on the Python reference; random: random words "
        "on the generated model; auto: real where this CPU runs it fast enough",
    )
    parser.add_argument(
        "--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run"
    )
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
    source = resolve_documents(args, dtype, rates)
    shape = REAL_SHAPE if source == "real" else shape_of(layers)
    miss = prefill_gflop(shape, args.doc_tokens)
    if rates is not None:
        print(f"CPU {rates.describe()}")
    how = {True: "probed", False: "given"}
    rate = f", {miss / rates.gflops[dtype]:.2f} s at the probed rate" if rates else ""
    print(
        f"chose {dtype} ({how[args.dtype == 'auto']}) and {source} documents "
        f"({how[args.documents == 'auto']}): a {args.doc_tokens}-token prefill of the "
        f"model is {miss:.0f} GFLOP{rate}"
    )
    if source == "real":
        from vllm_cpu_offload.testing.real_model import ensure_smollm2

        model = str(ensure_smollm2(dtype))
        print(
            "model SmolLM2-135M-Instruct (trained; 30 layers, hidden 576) answering a "
            "question about each document cut from the Python reference"
        )
    else:
        model = str(ensure_tiny_llama(shape))
        print(
            f"model {shape.name} (generated, random weights: outputs carry no meaning; "
            f"{shape.num_layers} layers, hidden {shape.hidden_size}) reading random "
            "words"
            + (
                ""
                if args.documents == "random"
                else ": the real model's miss "
                f"is over {REAL_MISS_BUDGET_S} s on this CPU"
            )
        )
    largest = max(device_blocks(args, arm) for arm in args.arms)
    kv_gib = max(2, -(-largest * block_bytes(shape, dtype) * 5 // 4 // (1 << 30)))
    print(
        f"documents of up to {args.doc_tokens} tokens; device cache "
        f"{device_blocks(args, 'prefix-caching')} blocks (equal-ram: "
        f"{device_blocks(args, 'equal-ram')}), host tier {args.host_docs} documents; "
        f"repeat order {args.repeat_mode}; {args.pairs} rounds of fresh engines, the "
        "order rotating"
    )
    argv = [
        "--model", model, "--docs", *map(str, args.docs),
        "--doc-tokens", str(args.doc_tokens), "--device-docs", str(args.device_docs),
        "--device-blocks", str(args.device_blocks),
        "--host-docs", str(args.host_docs), "--max-tokens", str(args.max_tokens),
        "--repeat-mode", args.repeat_mode, "--no-reuse-docs", str(args.no_reuse_docs),
        "--dtype", dtype, "--layers", str(layers), "--documents", source,
    ]  # fmt: skip
    pairs = []
    arms = [a for a in ARMS if a in args.arms]
    for i in range(args.pairs):
        k = i % len(arms)
        order = arms[k:] + arms[:k]  # each arm first in turn
        pair = {}
        for arm in order:
            t0 = time.perf_counter()
            pair[arm] = _spawn_arm(arm, argv, kv_gib)
            print(
                f"round {i + 1}: {arm} done in {time.perf_counter() - t0:.0f} s",
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
                "documents": source,
                "rates": None if rates is None else rates.gflops,
                "model": asdict(shape),
                "summary": summary,
                "pairs": pairs,
            }
        )
    )
    print(f"json: {out}")
    plot(summary, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
