"""Host memory and hit rate of an MLA model's host tier at TP=1 and TP=2.

The generated DeepSeek-V2-shaped model (testing/tiny_mla.py), documents read twice
one request at a time on a device cache too small to keep any between reads
(tests/e2e/long_document_run.py, vLLM's CPU platform, one core per rank). For each TP
size and `--swap-space`, prints the host tier's memory per engine (the proportional
set size of its mapping, summed over the ranks: shared pages count once) and the share
of the re-reads' prompt tokens served from host memory. `--backend` is vLLM's MLA
backend: AMX_MLA (bf16, 32-token blocks; the default where the CPU has AMX tiles) or
CPU_MLA (fp32, 16-token blocks; the default elsewhere), with which vLLM turns prefix
caching off and the tier serves nothing (a hit rate of 0). `--package DIR` runs in the
checkout DIR instead of this one (an older commit's worktree, with this checkout's
tests/e2e/long_document_run.py and testing/tiny_*.py copied in).

Usage: python benchmarks/mla_host_tier.py [--swap-space 0.006 0.012] [--tp 1 2]
           [--docs 12] [--doc-tokens 150] [--backend AMX_MLA|CPU_MLA] [--package DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(args: argparse.Namespace, tp: int, swap_space: float) -> dict[str, float]:
    from vllm_cpu_offload.testing import tiny_mla

    amx = args.backend == "AMX_MLA"
    block = tiny_mla.AMX_BLOCK_SIZE if amx else tiny_mla.BLOCK_SIZE
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % 2) for i in range(tp))
    command = [
        sys.executable, "-m", "tests.e2e.long_document_run",
        str(tiny_mla.ensure_tiny_mla()), "--mla", args.backend,
        "--dtype", "bfloat16" if amx else "float32",
        "--offload", "--swap-space", str(swap_space),
        "--docs", str(args.docs), "--doc-tokens", str(args.doc_tokens),
        "--device-blocks", str(args.doc_tokens // block + 4),
        "--tensor-parallel-size", str(tp),
    ]  # fmt: skip
    proc = subprocess.run(
        command,
        cwd=args.package or REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    rereads = result["requests"][args.docs :]
    mappings = [tier["mapping"] or {} for tier in result["host_tier"]]
    return {
        "host_mib": sum(m.get("pss_kib", 0) for m in mappings) / 1024,
        "tier_mib_per_rank": result["host_tier"][0]["nbytes"] / (1 << 20),
        "shared": all(tier["shared"] for tier in result["host_tier"]),
        "reread_hit": sum(r["cached"] for r in rereads)
        / (len(rereads) * args.doc_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--swap-space", type=float, nargs="+", default=[0.006, 0.012])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--docs", type=int, default=12)
    parser.add_argument("--doc-tokens", type=int, default=150)
    parser.add_argument("--backend", choices=("AMX_MLA", "CPU_MLA"))
    parser.add_argument("--package", help="a directory holding vllm_cpu_offload")
    args = parser.parse_args()
    if args.backend is None:
        from vllm_cpu_offload.testing.tiny_mla import amx_mla_runs_here

        args.backend = "AMX_MLA" if amx_mla_runs_here() else "CPU_MLA"
    where = args.package or REPO
    print(
        f"# {platform.processor() or platform.machine()}, checkout {where}, "
        f"{args.backend}"
    )
    print("tp  swap_GiB  host_MiB_per_engine  tier_MiB_per_rank  shared  reread_hit")
    for tp in args.tp:
        for swap in args.swap_space:
            r = run(args, tp, swap)
            print(
                f"{tp:<3} {swap:<9g} {r['host_mib']:<20.1f} "
                f"{r['tier_mib_per_rank']:<18.1f} {r['shared']!s:<7} "
                f"{r['reread_hit']:.3f}"
            )


if __name__ == "__main__":
    main()
