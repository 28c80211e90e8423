"""Two engines behind a round-robin router over one document set, with and without the
shared tier (`--swap-space-remote` on one Mooncake Store).

Both engines run at once, each in its own process with its model on its own core
(`VLLM_CPU_OMP_THREADS_BIND`). The router sends one request at a time, alternating
engines: in the first round document i goes to engine i % 2, in the second round
(the re-reads) to the other engine, as a router that knows nothing of the engines'
caches would. Arms:
- `shared`: `--enable-cpu-offload --swap-space 1 --swap-space-remote mooncake://...`;
- `alone`: `--enable-cpu-offload --swap-space 1`, each engine with its own host tier.

Per arm and repetition: fresh engines and a fresh store; the arm order alternates
between repetitions. Reported: the prompt tokens the fleet computed (prompt tokens less
cached ones) and the re-read round's time, medians of the repetitions with their range;
the re-reads' greedy tokens are compared across arms.

    python benchmarks/fleet.py [--reps 3] [--docs 4] [--doc-tokens 4000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import IO, Any

from benchmarks.engine_runs import (
    FIGURES,
    REPO,
    add_document_arguments,
    document_argv,
    document_engine,
    documents,
    ms,
    print_result,
    read_documents,
    spread,
)

ARMS = ("shared", "alone")


def engine_serve(args: argparse.Namespace) -> None:
    """One engine of the fleet: reads the document named on each stdin line."""
    remote = {"swap_space_remote": args.store} if args.arm == "shared" else {}
    llm = document_engine(
        args.doc_tokens, enable_cpu_offload=True, swap_space=1, **remote
    )
    docs = documents(args)
    print_result({"ready": True})
    for line in sys.stdin:
        (read,) = read_documents(llm, [docs[int(line)]], args.max_tokens)
        print_result(read)
    llm.llm_engine.engine_core.shutdown()


class EngineProcess:
    """A fleet engine in its own process, its model on `core`."""

    def __init__(self, argv: list[str], core: int) -> None:
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "MC_TCP_BIND_ADDRESS": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fleet", "--engine-serve", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
            env=env,
        )

    def _result(self) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        for line in out:
            if line.startswith("RESULT "):
                return dict(json.loads(line.removeprefix("RESULT ")))
        raise RuntimeError(f"a fleet engine exited ({self.proc.wait()})")

    def wait_ready(self) -> None:
        self._result()

    def read(self, doc: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{doc}\n")
        self.proc.stdin.flush()
        return self._result()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    from vllm_cpu_offload.testing.store_servers import MooncakeServers

    with MooncakeServers() as servers:
        argv = document_argv(args, arm, servers.url)
        engines = [EngineProcess(argv, core) for core in (0, 1)]
        try:
            for engine in engines:
                engine.wait_ready()
            first = [engines[i % 2].read(i) for i in range(args.docs)]
            again = [engines[(i + 1) % 2].read(i) for i in range(args.docs)]
        finally:
            for engine in engines:
                engine.close()
    computed = sum(args.doc_tokens - r["cached"] for r in first + again)
    return {
        "computed_tokens": computed,
        "reread_s": sum(r["seconds"] for r in again),
        "reread_cached": [r["cached"] for r in again],
        "reread_tokens": [r["tokens"] for r in again],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    add_document_arguments(parser)
    args = parser.parse_args()
    if args.engine_serve:
        engine_serve(args)
        return
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for rep in range(args.reps):
        order = ARMS if rep % 2 == 0 else ARMS[::-1]
        for arm in order:
            runs[arm].append(run_arm(arm, args))
    summary: dict[str, Any] = {"args": vars(args), "arms": {}}
    expected = runs["alone"][0]["reread_tokens"]
    for arm, arm_runs in runs.items():
        computed = spread([r["computed_tokens"] for r in arm_runs])
        reread = spread([r["reread_s"] for r in arm_runs])
        equal = all(r["reread_tokens"] == expected for r in arm_runs)
        summary["arms"][arm] = {
            "computed_tokens": computed,
            "reread_s": reread,
            "reread_cached": [r["reread_cached"] for r in arm_runs],
            "outputs_equal": equal,
        }
        print(
            f"{arm:6s}: prompt tokens computed {computed['median']:.0f} of "
            f"{2 * args.docs * args.doc_tokens}, re-read round {ms(reread)}, "
            f"outputs equal: {equal}"
        )
    ratios = [
        a["reread_s"] / s["reread_s"]
        for a, s in zip(runs["alone"], runs["shared"], strict=True)
    ]
    summary["reread_speedup"] = spread(ratios)
    print(
        f"shared re-read round {statistics.median(ratios):.2f}x faster than alone "
        f"({min(ratios):.2f}-{max(ratios):.2f}), per repetition"
    )
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / "fleet_cpu.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
