"""One arm of benchmarks/side_by_side.py: one engine, three workloads, one RESULT line.

Run by the driver as `python -m benchmarks.side_by_side_engine --engine-run ...` in a
fresh process, with the patched vLLM 0.33.0 overlay first on PYTHONPATH
(scripts/patched_vllm033.sh) and VLLM_TARGET_DEVICE=cpu. The arms differ only in the
engine arguments of `ARM_KWARGS`; the model, dtype, device cache, scheduler limits and
the engine's process layout (vLLM's default multiprocess engine, its OpenMP binding)
are the same in each.

Workloads, each after both tiers are emptied:
- `reread`: for each N of `--docs`, N documents read once in order (warm-up), then
  re-read in a random order, one request at a time (PR 11532's loop).
- `no_reuse`: unique prompts, one at a time: the tiers' cost where nothing is reused.
- `convoy`: a long prefix read once, the device cache emptied (the prefix is then in
  host memory only), and `--convoy-requests` requests that share it and differ in a
  short suffix sent at once (vLLM issue #44294's shape), behind one unrelated
  document that keeps the engine busy while they arrive (`run_convoy`). Repeated
  `--convoy-rounds` times with a new prefix each.

Per request: time to first token as vLLM's frontend measures it (arrival to first
token, `RequestOutput.metrics.first_token_latency`), the wall time of the call when
requests go one at a time, cached prompt tokens, greedy tokens. Per phase: the deltas
of vLLM's and the tiers' counters, steal time, load average, the engine processes' CPU
time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

from benchmarks.engine_runs import print_result
from benchmarks.long_document_qa import (
    BLOCK_SIZE,
    _engine_cpu_seconds,
    _steal_seconds,
    block_bytes,
    shape_of,
)
from vllm_cpu_offload.testing.tiny_model import TinyLlamaShape

ARMS = (
    "none",
    "none+tier_bytes",
    "vllm",
    "vllm+arc",
    "vllm+store_threshold2",
    "vllm+prefix_aware",
    "vllm+sync_load",
    "plugin",
)
# The arm a CPU user would pick instead of a tier: prefix caching, the device cache
# given the tier's bytes (on the CPU platform both are RAM).
EQUAL_RAM_ARM = "none+tier_bytes"
# vLLM's loads within the step (`sync_load_budget_bytes`, off by default), up to the
# plugin's bound for the same (`async_load_tokens`, 4096 tokens), in bytes per step.
SYNC_LOAD_TOKENS = 4096
MAX_BATCHED_TOKENS = 4096  # a step's token budget
# vLLM's own policy by name, the plugin's through the module path vLLM loads it from.
PREFIX_AWARE_CONFIG = {
    "eviction_policy": "PrefixAwareCachePolicy",
    "cache_policy_module_path": "vllm_cpu_offload.native_policies",
}
# Counters read before and after each phase (summed over label sets).
COUNTERS = (
    "vllm:prefix_cache_hits",  # device hits, tokens
    "vllm:external_prefix_cache_hits",  # connector hits, tokens (every arm's)
    "vllm:kv_offload_load_bytes",
    "vllm:kv_offload_store_bytes",
    "vllm:cpu_offload_hit_tokens",
    "vllm:cpu_offload_loaded_bytes",
    "vllm:cpu_offload_stored_bytes",
    "vllm:cpu_offload_evicted_blocks",
    "vllm:cpu_offload_failed_transfers",
    "vllm:num_preemptions",
)


def arm_kwargs(arm: str, host_gib: float, kv_bytes_per_token: int) -> dict[str, Any]:
    """The engine arguments that make `arm`, at `host_gib` GiB of host tier."""
    if arm in ("none", EQUAL_RAM_ARM):
        return {}  # EQUAL_RAM_ARM's larger device cache: device_blocks
    if arm == "vllm":
        return {"kv_offloading_size": host_gib}
    if arm in ("vllm+arc", "vllm+store_threshold2"):
        # vLLM 0.33's own choices (`v1/kv_offload/cpu/spec.py:142`, `:160`).
        extra = (
            {"eviction_policy": "arc"} if arm == "vllm+arc" else {"store_threshold": 2}
        )
        return {
            "kv_offloading_size": host_gib,
            "kv_transfer_config": {
                "kv_connector_extra_config": extra,
                "kv_load_failure_policy": "recompute",
            },
        }
    if arm == "vllm+prefix_aware":
        # `kv_offloading_size` fills in the connector, its role and cpu_bytes_to_use;
        # the load failure policy it sets when it creates the config is set here.
        return {
            "kv_offloading_size": host_gib,
            "kv_transfer_config": {
                "kv_connector_extra_config": dict(PREFIX_AWARE_CONFIG),
                "kv_load_failure_policy": "recompute",
            },
        }
    if arm == "vllm+sync_load":
        return {
            "kv_offloading_size": host_gib,
            "kv_transfer_config": {
                "kv_connector_extra_config": {
                    "sync_load_budget_bytes": SYNC_LOAD_TOKENS * kv_bytes_per_token
                },
                "kv_load_failure_policy": "recompute",
            },
        }
    if arm == "plugin":
        return {"enable_cpu_offload": True, "swap_space": host_gib}
    raise ValueError(f"unknown arm {arm!r}; choose one of {', '.join(ARMS)}")


def kv_bytes_per_token(shape: TinyLlamaShape, dtype: str) -> int:
    return block_bytes(shape, dtype) // BLOCK_SIZE


def device_blocks(args: argparse.Namespace, shape: TinyLlamaShape) -> int:
    """The arm's device cache: EQUAL_RAM_ARM's holds the tier's blocks too."""
    if args.arm != EQUAL_RAM_ARM:
        return int(args.device_blocks)
    host_blocks = args.host_gib * (1 << 30) / block_bytes(shape, args.dtype)
    return int(args.device_blocks) + round(host_blocks)


def make_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM

    from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama

    longest = max(
        args.doc_tokens,
        args.convoy_prefix_tokens + args.convoy_suffix_tokens,
        MAX_BATCHED_TOKENS,  # the document ahead of a convoy
    )
    shape = shape_of(args.layers)
    return LLM(
        str(ensure_tiny_llama(shape)),
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=device_blocks(args, shape),
        max_model_len=longest + BLOCK_SIZE + args.max_tokens,
        max_num_seqs=args.convoy_requests + 1,  # a convoy and the document ahead
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        dtype=args.dtype,
        seed=0,
        disable_log_stats=False,  # the counters and per-request TTFT
        **arm_kwargs(args.arm, args.host_gib, kv_bytes_per_token(shape, args.dtype)),
    )


def counters(llm: Any) -> dict[str, float]:
    values = dict.fromkeys(COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in values and isinstance(metric.value, int | float):
            values[metric.name] += metric.value
    return values


class Phase:
    """Counters, steal, load and CPU time around a phase."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.before = counters(llm)
        self.steal, self.cpu = _steal_seconds(), _engine_cpu_seconds()
        self.start = time.perf_counter()

    def end(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        wall = time.perf_counter() - self.start
        after = counters(self.llm)
        return {
            "wall_s": wall,
            "counters": {k: after[k] - self.before[k] for k in COUNTERS},
            "steal_s": _steal_seconds() - self.steal,
            "engine_cpu_s": _engine_cpu_seconds() - self.cpu,
            "loadavg_1m": os.getloadavg()[0],
            "requests": requests,
        }


def _record(out: Any, wall: float | None) -> dict[str, Any]:
    m = out.metrics  # vLLM's RequestStateStats: the engine core's timestamps
    return {
        "ttft_s": m.first_token_latency,
        # in the waiting queue until first scheduled, then until the first token
        "queued_s": m.scheduled_ts - m.queued_ts,
        "queued_ts": m.queued_ts,
        "scheduled_ts": m.scheduled_ts,
        "first_token_ts": m.first_token_ts,
        "scheduled_to_token_s": m.first_token_ts - m.scheduled_ts,
        "wall_s": wall,
        "cached": out.num_cached_tokens or 0,
        "tokens": list(out.outputs[0].token_ids),
    }


def read_one_at_a_time(
    llm: Any, prompts: list[list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    records = []
    for prompt in prompts:
        start = time.perf_counter()
        [out] = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False
        )
        records.append(_record(out, time.perf_counter() - start))
    return records


def read_at_once(
    llm: Any, prompts: list[list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    """All prompts in one call: every request arrives before the engine's next step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    return [_record(out, None) for out in outs]


def reset_tiers(llm: Any, arm: str) -> None:
    assert llm.reset_prefix_cache(reset_connector=arm != "none"), "a block is held"


def empty_device_cache(llm: Any) -> None:
    """Empties the device prefix cache only; the host tier keeps what it holds. The
    reset waits for the stores in flight, which end within a step."""
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "the stores in flight did not end"
        read_one_at_a_time(llm, [[3]], 1)


def run_reread(llm: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from vllm_cpu_offload.testing.tiny_model import random_token_ids

    results = []
    for n in args.docs:
        reset_tiers(llm, args.arm)
        rng = random.Random(n)
        docs = [random_token_ids(rng, args.doc_tokens) for _ in range(n)]
        order = list(range(n))
        rng.shuffle(order)
        phase = Phase(llm)
        warm = phase.end(read_one_at_a_time(llm, docs, args.max_tokens))
        phase = Phase(llm)
        again = read_one_at_a_time(llm, [docs[i] for i in order], args.max_tokens)
        results.append({"docs": n, "order": order, "warmup": warm,
                        "reread": phase.end(again)})  # fmt: skip
    return results


def run_no_reuse(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from vllm_cpu_offload.testing.tiny_model import random_token_ids

    reset_tiers(llm, args.arm)
    rng = random.Random(12345)
    prompts = [random_token_ids(rng, args.doc_tokens) for _ in range(args.no_reuse)]
    phase = Phase(llm)
    return phase.end(read_one_at_a_time(llm, prompts, args.max_tokens))


def run_convoy(llm: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each round: the prefix computed once and stored, the device cache emptied,
    then a burst. The engine core takes requests between steps, so requests a client
    hands over one by one could reach its scheduler over two steps. The burst's
    first request, a document that shares nothing and fills a step's token budget,
    makes the first step its alone while the convoy's requests arrive: the scheduler
    then sees all of them in the same step (`together` in the result checks it)."""
    from vllm_cpu_offload.testing.tiny_model import random_token_ids

    rounds = []
    for r in range(args.convoy_rounds):
        reset_tiers(llm, args.arm)
        rng = random.Random(4429400 + r)
        prefix = random_token_ids(rng, args.convoy_prefix_tokens)
        prompts = [
            prefix + random_token_ids(rng, args.convoy_suffix_tokens)
            for _ in range(args.convoy_requests + 1)
        ]
        read_one_at_a_time(llm, prompts[:1], 1)  # the prefix's first (only) compute
        empty_device_cache(llm)
        unrelated = random_token_ids(rng, MAX_BATCHED_TOKENS)
        phase = Phase(llm)
        burst = read_at_once(llm, [unrelated, *prompts[1:]], args.max_tokens)
        ahead, convoy = burst[0], burst[1:]
        first_scheduled = min(r["scheduled_ts"] for r in convoy)
        together = all(r["queued_ts"] <= first_scheduled for r in convoy)
        for r in convoy:
            # From the end of the step that prefilled the document ahead, when the
            # engine turns to the convoy: the same wait is left out of every arm.
            r["after_ahead_s"] = r["first_token_ts"] - ahead["first_token_ts"]
        rounds.append(phase.end(convoy) | {"ahead": ahead, "together": together})
    return rounds


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    llm = make_llm(args)
    try:
        return {
            "arm": args.arm,
            "reread": run_reread(llm, args),
            "no_reuse": run_no_reuse(llm, args) if args.no_reuse else None,
            "convoy": run_convoy(llm, args) if args.convoy_rounds else None,
        }
    finally:
        llm.llm_engine.engine_core.shutdown()


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags the driver passes on to every engine process."""
    parser.add_argument("--docs", type=int, nargs="*", default=[16, 32, 64])
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--no-reuse", type=int, default=24, help="unique prompts")
    parser.add_argument("--convoy-requests", type=int, default=8)
    parser.add_argument("--convoy-prefix-tokens", type=int, default=2000)
    parser.add_argument("--convoy-suffix-tokens", type=int, default=64)
    parser.add_argument("--convoy-rounds", type=int, default=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-run", action="store_true", required=True)
    parser.add_argument("--arm", choices=ARMS, required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--device-blocks", type=int, required=True)
    parser.add_argument("--host-gib", type=float, required=True)
    add_workload_arguments(parser)
    args = parser.parse_args()
    result = run_arm(args)
    print_result(json.loads(json.dumps(result)))


if __name__ == "__main__":
    main()
