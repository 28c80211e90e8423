"""A large host hit loaded inside its step against one loaded across steps
(`async_load_tokens`), while another request decodes.

Each engine process reads the documents once (the host tier stores them), resets
vLLM's prefix cache (the host tier keeps its blocks), then, per document: a short
request starts decoding, and once it has produced a few tokens the document is read
again, a host hit of all its blocks. Recorded per document: the document's time to
first token, and the decoding request's longest gap between two tokens while the
document loads, against its median gap before.

Arms, one fresh engine process per arm and repetition, in an order that rotates:
- `sync`: `async_load_tokens = 0`, every host hit loads inside its step;
- `async`: `async_load_tokens = 1`, every host hit loads across steps.
Both use the same connector, the same core (`VLLM_CPU_OMP_THREADS_BIND`) and the same
documents; greedy outputs are compared.

    python -m benchmarks.async_host_load [--reps 3] [--docs 3] [--doc-tokens 8000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from itertools import pairwise
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

ARMS = {"sync": 0, "async": 1}  # arm -> async_load_tokens
OMP_BIND = "1"  # the model on one core in both arms
DECODE_PROMPT_TOKENS = 64
DECODE_TOKENS = 48
TOKENS_BEFORE_THE_HIT = 8


def engine_run(args: argparse.Namespace) -> None:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig

    from vllm_cpu_offload.testing.tiny_model import random_token_ids

    config = KVTransferConfig(
        kv_connector="CPUOffloadConnector",
        kv_connector_module_path="vllm_cpu_offload.connector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "swap_space_gib": 1,
            "async_load_tokens": ARMS[args.arm],
        },
    )
    llm = document_engine(args.doc_tokens, kv_transfer_config=config)
    rng = random.Random(11)  # the documents', then the decoding requests' prompts
    docs = documents(args, rng)
    read_documents(llm, docs, 1)
    engine = llm.llm_engine
    greedy: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
    reads = []
    for n, doc in enumerate(docs):
        assert llm.reset_prefix_cache(), "a device block is still held"
        decode_id, doc_id = f"decode-{n}", f"doc-{n}"
        engine.add_request(
            decode_id,
            {"prompt_token_ids": random_token_ids(rng, DECODE_PROMPT_TOKENS)},
            SamplingParams(max_tokens=DECODE_TOKENS, **greedy),
        )
        arrivals: list[float] = []  # the decoding request's tokens
        doc_added = doc_done = 0.0
        first_token: list[int] = []
        cached = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if out.request_id == decode_id:  # cumulative outputs
                    arrivals += [now] * (len(out.outputs[0].token_ids) - len(arrivals))
                elif out.request_id == doc_id and out.finished:
                    doc_done = now
                    first_token = list(out.outputs[0].token_ids)
                    cached = out.num_cached_tokens or 0
            if not doc_added and len(arrivals) >= TOKENS_BEFORE_THE_HIT:
                doc_added = time.perf_counter()
                engine.add_request(
                    doc_id,
                    {"prompt_token_ids": doc},
                    SamplingParams(max_tokens=1, **greedy),
                )
        gaps_before = [b - a for a, b in pairwise(arrivals) if b < doc_added]
        loading = [
            b - a for a, b in pairwise(arrivals) if b > doc_added and a < doc_done
        ]
        reads.append(
            {
                "ttft_s": doc_done - doc_added,
                "decode_gap_before_s": statistics.median(gaps_before),
                "decode_longest_gap_s": max(loading),
                "tokens": first_token,
                "cached": cached,
            }
        )
    print_result({"reads": reads})
    engine.engine_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    add_document_arguments(parser)
    parser.set_defaults(docs=3, doc_tokens=8000)
    args = parser.parse_args()
    if args.engine_run:
        engine_run(args)
        return
    arms = list(ARMS)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    env = {"VLLM_CPU_OMP_THREADS_BIND": OMP_BIND}
    for rep in range(args.reps):
        for arm in arms[rep % 2 :] + arms[: rep % 2]:
            argv = document_argv(args, arm, "")
            run = run_engine_process("benchmarks.async_host_load", argv, env)
            runs[arm].append(run)

    def per_run(arm: str, key: str) -> list[float]:
        return [statistics.median(r[key] for r in run["reads"]) for run in runs[arm]]

    expected = [r["tokens"] for r in runs["sync"][0]["reads"]]
    summary: dict[str, Any] = {"args": vars(args), "arms": {}}
    for arm in arms:
        row: dict[str, Any] = {
            key: spread(per_run(arm, key))
            for key in ("ttft_s", "decode_gap_before_s", "decode_longest_gap_s")
        }
        row["cached"] = min(r["cached"] for run in runs[arm] for r in run["reads"])
        row["outputs_equal"] = all(
            [r["tokens"] for r in run["reads"]] == expected for run in runs[arm]
        )
        summary["arms"][arm] = row
        print(
            f"{arm:5s} {args.doc_tokens}-token host hit: TTFT {ms(row['ttft_s'])}; "
            f"decoding request's longest gap {ms(row['decode_longest_gap_s'])} "
            f"(median gap before {ms(row['decode_gap_before_s'])}); cached tokens "
            f"{row['cached']}; outputs equal: {row['outputs_equal']}"
        )
    for key in ("ttft_s", "decode_longest_gap_s"):
        ratios = [
            a / s
            for a, s in zip(per_run("async", key), per_run("sync", key), strict=True)
        ]
        summary[f"async_over_sync_{key}"] = spread(ratios)
        print(
            f"async / sync {key}: {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}), per repetition"
        )
    FIGURES.mkdir(parents=True, exist_ok=True)
    name = f"async_host_load_{args.doc_tokens}_tokens_cpu.json"
    (FIGURES / name).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
