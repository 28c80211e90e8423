"""vLLM's own KV offloading (the upstream series applied) beside the plugin, on one
machine, one model, the same prompts and the same process layout.

Arms, each a fresh engine process (benchmarks/side_by_side_engine.py) on vLLM 0.33.0
with the series of `--patches` applied (scripts/patched_vllm033.sh), the plugin
importable beside it:
- `none`: prefix caching alone, the baseline;
- `vllm`: `kv_offloading_size` (vLLM's OffloadingConnector, its default `lru`);
- `vllm+prefix_aware`: the same with the plugin's `prefix_aware` as its `CachePolicy`
  (`eviction_policy` + `cache_policy_module_path`);
- `vllm+sync_load`: `vllm` with `sync_load_budget_bytes` (vLLM 0.33's loads within the
  step, off by default) at the plugin's bound for the same, 4,096 tokens;
- `plugin`: `--enable-cpu-offload --swap-space` at the same host bytes.

Workloads: (a) long documents read, then re-read (more than the device cache holds);
(b) unique prompts (no reuse); (c) requests that share a long prefix held in host
memory only, sent at once (vLLM issue #44294); (d) the host tier's hit rate on the
Mooncake conversation trace, replayed through the tiers themselves
(benchmarks/side_by_side_trace.py). Arms run in rounds, in the order of ARMS in even
rounds and reversed in odd ones, `--pairs` rounds; the tables give the median of the
rounds and their range. Greedy outputs of every request are compared across arms.

The dtype and depth come from benchmarks/long_document_qa.py's probe of this CPU
(`--dtype auto`, `--layers 0`), as do its device (8 documents) and host (30) sizes.
Run it with the vLLM 0.33.0 environment's Python (scripts/setup_vllm033_env.sh):

    .venv-vllm033/bin/python benchmarks/side_by_side.py --patches upstream
    # -> benchmarks/results/side_by_side.json, side_by_side_summary.json (without the
    #    requests: the copy docs/figures keeps), engine logs in side_by_side_logs/
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The CPU platform here too, not only in the engines (engine_env): a CUDA wheel's
# Python names no platform, and vLLM's generic kernel import then loads the AVX512-BF16
# build of the CPU kernels, which stops an AVX2-only CPU with an illegal instruction.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from benchmarks.long_document_qa import (  # noqa: E402
    BLOCK_SIZE,
    DTYPE_BYTES,
    block_bytes,
    resolve_sizing,
    shape_of,
)
from benchmarks.side_by_side_engine import (  # noqa: E402
    ARMS,
    MAX_BATCHED_TOKENS,
    add_workload_arguments,
)
from benchmarks.side_by_side_summary import summarize  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# What an engine's log says about its cores and its host tier.
LOG_FACTS = {
    "omp_core_ids": r"core ids=\[([^\]]*)\]",
    "reserve_cpu_num": r"reserve_cpu_num=(\d+)",
    "vllm_host_chunks": r"CPU offloading tensors of (\d+) chunks",
    "plugin_host_blocks": r"host tier: (\d+) blocks",
}


def build_overlay(patches: Path, out: Path) -> Path:
    """The patched vLLM's overlay folder (scripts/patched_vllm033.sh)."""
    env = {**os.environ, "VENV033": os.environ.get("VENV033", sys.prefix)}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "patched_vllm033.sh"), str(patches), str(out)],
        capture_output=True, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(proc.stderr.strip() or "patched_vllm033.sh failed")
    return Path(proc.stdout.strip().splitlines()[-1])


def engine_env(overlay: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine as users run it
    env["PYTHONPATH"] = os.pathsep.join([str(overlay), str(REPO)])
    env["VLLM_TARGET_DEVICE"] = "cpu"  # a CUDA wheel's Python names no platform
    return env


def run_logged(module: str, argv: list[str], env: dict[str, str], log: Path) -> dict:
    """`python -m module argv...`, its output kept in `log`; returns its RESULT."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", module, *argv],
            stdout=f, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
            timeout=3600,
        )  # fmt: skip
    text = log.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(argv)} failed; see {log}")
    line = next(x for x in text.splitlines() if x.startswith("RESULT "))
    result = dict(json.loads(line.removeprefix("RESULT ")))
    result["log"] = {
        key: m.group(1) for key, pattern in LOG_FACTS.items()
        if (m := re.search(pattern, text))
    }  # fmt: skip
    return result


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(
        (k.strip(), v.strip())
        for k, _, v in (line.partition(":") for line in lscpu.splitlines())
    )
    flags = fields.get("Flags", "").split()
    return {
        "model_name": fields.get("Model name"),
        "cpus": os.cpu_count(),
        "simd_flags": [f for f in flags if f.startswith(("avx", "amx"))],
        "vllm": importlib.metadata.version("vllm"),
        "torch": importlib.metadata.version("torch"),
    }


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def steal_seconds() -> float:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=Path, default=REPO / "upstream")
    parser.add_argument(
        "--overlay-dir", type=Path, default=REPO / ".cache" / "patched-vllm033"
    )
    parser.add_argument("--pairs", type=int, default=3, help="rounds of every arm")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_BYTES))
    parser.add_argument("--layers", type=int, default=0, help="0: probe this CPU")
    parser.add_argument("--device-docs", type=int, default=8)
    parser.add_argument("--host-docs", type=int, default=30)
    add_workload_arguments(parser)
    parser.add_argument(
        "--trace-host-blocks", type=int, nargs="*", default=[2000, 4000, 8000]
    )
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--trace-limit", type=int, default=None, help="first N only")
    parser.add_argument("--out", type=Path, default=RESULTS / "side_by_side.json")
    return parser


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def engine_argv(args: argparse.Namespace, dtype: str, layers: int) -> list[str]:
    doc_blocks = blocks(args.doc_tokens)
    shape = shape_of(layers)
    host_gib = args.host_docs * doc_blocks * block_bytes(shape, dtype) / (1 << 30)
    device_blocks = args.device_docs * doc_blocks
    # the prefix, each request's suffix and output, the document ahead of them
    suffix_tokens = args.convoy_suffix_tokens + args.max_tokens
    convoy_blocks = (
        blocks(args.convoy_prefix_tokens)
        + args.convoy_requests * (blocks(suffix_tokens) + 1)
        + blocks(MAX_BATCHED_TOKENS + args.max_tokens)
    )
    if args.convoy_rounds and convoy_blocks > device_blocks:
        raise SystemExit(
            f"a convoy needs {convoy_blocks} device blocks, the device cache has "
            f"{device_blocks}: raise --device-docs or lower --convoy-prefix-tokens"
        )
    return [
        "--engine-run", "--dtype", dtype, "--layers", str(layers),
        "--device-blocks", str(device_blocks),
        "--host-gib", repr(host_gib),
        "--docs", *map(str, args.docs), "--doc-tokens", str(args.doc_tokens),
        "--max-tokens", str(args.max_tokens), "--no-reuse", str(args.no_reuse),
        "--convoy-requests", str(args.convoy_requests),
        "--convoy-prefix-tokens", str(args.convoy_prefix_tokens),
        "--convoy-suffix-tokens", str(args.convoy_suffix_tokens),
        "--convoy-rounds", str(args.convoy_rounds),
    ]  # fmt: skip


def main() -> None:
    args = _parser().parse_args()
    if importlib.metadata.version("vllm") != "0.33.0":
        raise SystemExit(
            "run this with the vLLM 0.33.0 environment's Python "
            "(VLLM033_CPU_KERNELS=1 bash scripts/setup_vllm033_env.sh)"
        )
    overlay = build_overlay(args.patches.resolve(), args.overlay_dir.resolve())
    series = (overlay.parent / "series.txt").read_text().splitlines()
    env = engine_env(overlay)
    args.quick = False
    dtype, layers, rates = resolve_sizing(args)
    argv = engine_argv(args, dtype, layers)
    info = {"machine": machine(), "uptime_start": uptime(), "series": series,
            "dtype": dtype, "layers": layers, "engine_argv": argv,
            "rates": None if rates is None else rates.gflops}  # fmt: skip
    print(json.dumps({k: v for k, v in info.items() if k != "engine_argv"}, indent=1))
    steal0, start = steal_seconds(), time.perf_counter()
    logs = args.out.parent / "side_by_side_logs"
    rounds: list[dict[str, Any]] = []
    for i in range(args.pairs):
        order = args.arms if i % 2 == 0 else args.arms[::-1]
        results = {}
        for arm in order:
            t0 = time.perf_counter()
            results[arm] = run_logged(
                "benchmarks.side_by_side_engine", [*argv, "--arm", arm], env,
                logs / f"round{i + 1}_{arm.replace('+', '_')}.log",
            )  # fmt: skip
            print(f"round {i + 1}: {arm} done in {time.perf_counter() - t0:.0f} s "
                  f"({uptime()})", flush=True)  # fmt: skip
        rounds.append(results)
    trace = None
    if args.trace_host_blocks:
        trace_argv = ["--host-blocks", *map(str, args.trace_host_blocks)]
        if args.trace is not None:
            trace_argv += ["--trace", str(args.trace)]
        if args.trace_limit is not None:
            trace_argv += ["--limit", str(args.trace_limit)]
        trace = run_logged(
            "benchmarks.side_by_side_trace", trace_argv, env, logs / "trace.log"
        )
    info |= {"uptime_end": uptime(), "steal_s": steal_seconds() - steal0,
             "wall_s": time.perf_counter() - start}  # fmt: skip
    summary = summarize(rounds, trace, args.arms)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shown = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    head = {"args": shown, **info, "summary": summary}
    args.out.write_text(json.dumps(head | {"trace": trace, "rounds": rounds}))
    # without the requests: what docs/figures keeps
    compact = args.out.with_name(args.out.stem + "_summary.json")
    compact.write_text(json.dumps(head, indent=1))
    print(f"json: {args.out}, {compact}")


if __name__ == "__main__":
    main()
