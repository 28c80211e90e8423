"""Cost per block of the scheduler half's planning, in microseconds: what one engine
step adds to vLLM's scheduler for each block the host tier serves or stores.

vLLM's own `KVCacheManager` and our `HostTierScheduler` (no shared store), stepped as
vLLM's scheduler steps them. `--requests` prompts of `--blocks` blocks each:
  store   lookup (a miss), allocation, the store plan of the whole prompt, its report
  load    the same prompts again once evicted from the device: lookup (a hit of every
          block), the load plan, its report
Prints the best of `--repeat` rounds, per block.

Usage: .venv/bin/python benchmarks/scheduler_planning.py [--blocks N] [--requests R]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BLOCK_SIZE = 16


def _round(num_requests: int, num_blocks: int) -> tuple[float, float]:
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request

    from vllm_cpu_offload.metadata import OffloadWorkerReport
    from vllm_cpu_offload.scheduler.block_pool import HostBlockPool
    from vllm_cpu_offload.scheduler.kv_groups import kv_groups_of
    from vllm_cpu_offload.scheduler.policies.registry import make_policy
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    device_blocks = num_blocks + 8
    config = KVCacheConfig(
        num_blocks=device_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )
    host_blocks = num_requests * num_blocks
    tier = HostTierScheduler(
        HostBlockPool(host_blocks, make_policy("lru", host_blocks)),
        block_size=BLOCK_SIZE,
        num_workers=1,
        block_bytes=64,
        groups=kv_groups_of(config, BLOCK_SIZE),
    )
    prompts = [
        [r * 100_000 + t for t in range(num_blocks * BLOCK_SIZE + 1)]
        for r in range(num_requests)
    ]

    def serve(tag: str) -> float:
        kv = KVCacheManager(
            config,
            max_model_len=(num_blocks + 2) * BLOCK_SIZE,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
        )
        tier.bind_kv_cache_manager(kv)
        start = time.perf_counter()
        for r, tokens in enumerate(prompts):
            request = Request(
                f"{tag}{r}",
                tokens,
                SamplingParams(max_tokens=1),
                None,
                block_hasher=hasher,
            )
            hit = tier.get_num_new_matched_tokens(request, 0)
            kv.allocate_slots(
                request, request.num_tokens - hit, num_external_computed_tokens=hit
            )
            tier.update_state_after_alloc(
                request, kv.get_block_ids(request.request_id), hit
            )
            request.num_computed_tokens = hit
            out = SchedulerOutput.make_empty()
            out.num_scheduled_tokens = {request.request_id: request.num_tokens - hit}
            meta = tier.build_connector_meta(out)
            jobs = [t.job_id for t in (*meta.loads, *meta.stores)]
            tier.update_connector_output(OffloadWorkerReport(Counter(jobs), Counter()))
            request.num_computed_tokens = request.num_tokens
            tier.request_finished(request)
            kv.free(request)
        return (time.perf_counter() - start) / (num_requests * num_blocks) * 1e6

    store, load = serve("s"), serve("l")
    assert tier.stats.loaded_blocks == num_requests * num_blocks, "the loads missed"
    return store, load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rounds = [_round(args.requests, args.blocks) for _ in range(args.repeat)]
    store = min(r[0] for r in rounds)
    load = min(r[1] for r in rounds)
    python = sys.version.split()[0]
    print(f"# {platform.processor() or platform.machine()}, python {python}")
    print(f"store plan  {store:7.2f} us/block  (best of {args.repeat})")
    print(f"load plan   {load:7.2f} us/block")


if __name__ == "__main__":
    main()
