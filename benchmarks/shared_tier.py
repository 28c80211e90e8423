"""`--swap-space-remote` against vLLM's own `MooncakeStoreConnector`, on the same
Mooncake Store (a master and a storage node on loopback, TCP).

Arms, each configured at its best (`kv_load_failure_policy = recompute`):
- `ours`: `--enable-cpu-offload --swap-space 1 --swap-space-remote mooncake://...`;
- `vllm`: vLLM's `MooncakeStoreConnector` (`kv_both`, the store named in the JSON file
  of `MOONCAKE_CONFIG_PATH`, standalone-store mode);
- `multi`: vLLM's `MultiConnector` of our host tier and vLLM's `MooncakeStoreConnector`,
  the arrangement a user can assemble without `--swap-space-remote`;
- `cold`: `ours` on an empty store of its own;
- `host`: the host tier alone (`--enable-cpu-offload --swap-space 1`);
- `host-hit`: `host`, reading each document a second time after vLLM's prefix cache
  was reset (the host tier keeps its blocks): the time of a host hit;
- `off`: vLLM without the flags.

Scenarios:
- `first-read`: engine A reads the documents and exits; engine B (empty device cache
  and host tier, the same store) reads them. B's time to first token per document.
- `node-killed`: as `first-read`, but the store's storage node is killed (SIGKILL)
  between A and B: B's reads must be exact and no request may be held long.
- `no-reuse`: one engine per arm reads documents that no engine read before (every
  block is stored and written through, none is ever hit): the time of the whole set
  against `off`, as a throughput ratio.

Per repetition every arm gets a fresh store and fresh engine processes; the order of
the arms rotates between repetitions. Every engine process binds the model to the same
core (`VLLM_CPU_OMP_THREADS_BIND`), so the arms differ only in the connector. Medians
of the repetitions with their range; greedy outputs of every arm compared with cold.

    python benchmarks/shared_tier.py [--scenario first-read] [--reps 3] [--docs 4]
        [--doc-tokens 4000] [--arms ours vllm multi cold]
    python benchmarks/shared_tier.py --scenario no-reuse --arms off host ours \
        --docs 16 --doc-tokens 2000 --max-tokens 16
    python benchmarks/shared_tier.py --arms ours host-hit cold --docs 2 \
        --doc-tokens 16000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.engine_runs import (
    FIGURES,
    add_document_arguments,
    document_argv,
    document_engine,
    documents,
    ms,
    print_result,
    read_documents,
    run_engine_process,
    spread,
)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

ARMS = ("ours", "vllm", "multi", "cold", "host", "off", "host-hit")
# Arms whose engine B reads without an engine A before it.
WITHOUT_A = ("cold", "host-hit")
SCENARIOS = ("first-read", "node-killed", "no-reuse")
# One OpenMP thread on the same core in every arm: vLLM's CPU executor would otherwise
# reserve a core for other connectors and not for ours.
OMP_BIND = "1"


def connector_kwargs(arm: str, store_url: str) -> dict[str, Any]:
    """The engine arguments that select `arm`'s connector."""
    from vllm.config import KVTransferConfig

    if arm == "off":
        return {}
    if arm in ("host", "host-hit"):
        return {"enable_cpu_offload": True, "swap_space": 1}
    if arm in ("ours", "cold"):
        return {
            "enable_cpu_offload": True,
            "swap_space": 1,
            "swap_space_remote": store_url,
        }
    vllm_store = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    if arm == "vllm":
        config: dict[str, Any] = vllm_store
    else:
        host_tier = {
            "kv_connector": "CPUOffloadConnector",
            "kv_connector_module_path": "vllm_cpu_offload.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"swap_space_gib": 1},
        }
        config = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [host_tier, vllm_store]},
        }
    return {
        "kv_transfer_config": KVTransferConfig(
            **config, kv_load_failure_policy="recompute"
        )
    }


def engine_run(args: argparse.Namespace) -> None:
    """One engine process of one arm: reads every document once."""
    llm = document_engine(args.doc_tokens, **connector_kwargs(args.arm, args.store))
    docs = documents(args)
    if args.arm == "host-hit":
        read_documents(llm, docs, args.max_tokens)
        # vLLM's prefix cache only: the host tier keeps the blocks just stored.
        assert llm.reset_prefix_cache(), "a device block is still held"
    print_result({"reads": read_documents(llm, docs, args.max_tokens)})
    # Shutting down lets queued writes land (bounded) before the process ends.
    llm.llm_engine.engine_core.shutdown()


def mooncake_config(servers: Any, folder: Path) -> Path:
    """The JSON file vLLM's MooncakeStoreConnector reads (MOONCAKE_CONFIG_PATH)."""
    path = folder / f"mooncake-{servers.rpc_port}.json"
    path.write_text(
        json.dumps(
            {
                "metadata_server": servers.metadata_url,
                "master_server_address": f"127.0.0.1:{servers.rpc_port}",
                "protocol": "tcp",
                "device_name": "",
                "mode": "standalone-store",
                "global_segment_size": 0,
                "local_buffer_size": "256MB",
            }
        )
    )
    return path


def run_arm(arm: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """A fresh store; engine A (skipped for cold) fills it; engine B's reads."""
    from vllm_cpu_offload.testing.store_servers import MooncakeServers

    with MooncakeServers() as servers:
        argv = document_argv(args, arm, servers.url)
        env = {
            "MOONCAKE_CONFIG_PATH": str(mooncake_config(servers, folder)),
            "VLLM_CPU_OMP_THREADS_BIND": OMP_BIND,
        }
        if arm not in WITHOUT_A and args.scenario != "no-reuse":
            run_engine_process("benchmarks.shared_tier", argv, env)
            if args.scenario == "node-killed":
                servers.kill_storage_node()
        return run_engine_process("benchmarks.shared_tier", argv, env)


def median_read_s(reads: list[dict[str, Any]]) -> float:
    return statistics.median(r["seconds"] for r in reads)


def all_reads_s(reads: list[dict[str, Any]]) -> float:
    return sum(r["seconds"] for r in reads)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    reads = [run["reads"] for run in runs]
    return {
        "ttft_s": spread([median_read_s(rs) for rs in reads]),
        "slowest_read_s": spread([max(r["seconds"] for r in rs) for rs in reads]),
        "all_reads_s": spread([all_reads_s(rs) for rs in reads]),
        "cached_tokens": spread(
            [statistics.median(r["cached"] for r in rs) for rs in reads]
        ),
    }


def ratio_per_repetition(
    over: list[dict[str, Any]],
    under: list[dict[str, Any]],
    stat: Callable[[list[dict[str, Any]]], float],
) -> list[float]:
    """`stat(over's reads) / stat(under's reads)`, repetition by repetition (the same
    documents, run next to each other)."""
    return [
        stat(a["reads"]) / stat(b["reads"]) for a, b in zip(over, under, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=SCENARIOS, default="first-read")
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=ARMS,
        help="default: ours vllm multi cold; off host ours for no-reuse",
    )
    add_document_arguments(parser)
    args = parser.parse_args()
    if args.engine_run:
        engine_run(args)
        return
    if args.arms is None:
        no_reuse = args.scenario == "no-reuse"
        args.arms = ["off", "host", "ours"] if no_reuse else list(ARMS[:4])

    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    with tempfile.TemporaryDirectory(prefix="shared-tier-bench-") as folder:
        for rep in range(args.reps):
            shift = rep % len(args.arms)
            for arm in args.arms[shift:] + args.arms[:shift]:
                runs[arm].append(run_arm(arm, args, Path(folder)))
    reference = (runs.get("cold") or runs[args.arms[0]])[0]
    expected = [r["tokens"] for r in reference["reads"]]
    summary: dict[str, Any] = {"args": vars(args), "arms": {}}
    for arm, arm_runs in runs.items():
        row = summarize(arm_runs)
        row["outputs_equal_cold"] = all(
            [r["tokens"] for r in run["reads"]] == expected for run in arm_runs
        )
        summary["arms"][arm] = row
        print(
            f"{arm:6s} {args.scenario}: TTFT {ms(row['ttft_s'])}, slowest read "
            f"{ms(row['slowest_read_s'])}, cached tokens "
            f"{row['cached_tokens']['median']:.0f}, outputs equal cold: "
            f"{row['outputs_equal_cold']}"
        )
    if args.scenario == "no-reuse" and "off" in runs:
        for arm in (a for a in args.arms if a != "off"):
            ratios = ratio_per_repetition(runs["off"], runs[arm], all_reads_s)
            summary[f"{arm}_no_reuse_throughput_vs_off"] = spread(ratios)
            print(
                f"no reuse: {arm} throughput {statistics.median(ratios):.3f}x of off "
                f"({min(ratios):.3f}-{max(ratios):.3f}), per repetition"
            )
    peers = [a for a in args.arms if a not in ("ours", "off", "host")]
    for arm in peers if "ours" in runs else []:
        ratios = ratio_per_repetition(runs[arm], runs["ours"], median_read_s)
        summary[f"ours_vs_{arm}"] = spread(ratios)
        print(
            f"ours {statistics.median(ratios):.2f}x as fast as {arm} "
            f"({min(ratios):.2f}-{max(ratios):.2f}), per repetition"
        )
    FIGURES.mkdir(parents=True, exist_ok=True)
    length = "" if args.doc_tokens == 4000 else f"_{args.doc_tokens}_tokens"
    name = f"shared_tier_{args.scenario.replace('-', '_')}{length}_cpu.json"
    (FIGURES / name).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
