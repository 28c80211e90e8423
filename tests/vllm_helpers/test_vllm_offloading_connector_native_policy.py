"""vLLM's own Scheduler and `OffloadingConnector`, unpatched, with `prefix_aware` from
`vllm_cpu_offload.native_policies`, configured by the `--kv-transfer-config` line the
docs give.

vLLM's CPU offloading refuses a CPU platform when it builds its worker, so the worker
here is a stand-in that reports every transfer of a step done when the step ends (what
vLLM's worker reports back: completed job ids, and the requests whose loads finished).
Everything the scheduler side does is vLLM's: its requests' block hashes, the keys'
positions, prepare/complete calls, the manager, and its counters. The helpers come from
the installed vLLM's tests (`tests/v1/kv_connector/unit/utils.py`, fetched by
`scripts/fetch_vllm_sdist.sh`).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm")

BLOCK_SIZE = 16
DEVICE_BLOCKS = 5  # few: the shared prefix leaves the GPU cache and is loaded back
HOST_CHUNKS = 6
SHARED_TOKENS = 2 * BLOCK_SIZE
PROMPT_TOKENS = 4 * BLOCK_SIZE


@pytest.fixture(scope="module")
def vllm_utils(vllm_sdist: Path) -> ModuleType:
    from tests.vllm_helpers.connector_test_utils import load_connector_test_utils

    return load_connector_test_utils(vllm_sdist)


def kv_transfer_config_line(host_bytes: int) -> str:
    """The line a user passes to `--kv-transfer-config` (see native_policies.py)."""
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": host_bytes,
                "eviction_policy": "PrefixAwareCachePolicy",
                "cache_policy_module_path": "vllm_cpu_offload.native_policies",
            },
        }
    )


def _step(scheduler: Any, utils: ModuleType, stats: dict[str, int]) -> None:
    """One engine step; every transfer the step starts is done when it ends."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    out = scheduler.schedule()
    meta = out.kv_connector_metadata
    done = {job_id: 1 for job_id in (*meta.load_jobs, *meta.store_jobs)}
    stats["loads"] += len(meta.load_jobs)
    stats["stores"] += len(meta.store_jobs)
    requests = [scheduler.requests[r] for r in out.num_scheduled_tokens]
    output = utils.create_model_runner_output(
        requests,
        finished_recving={job.req_id for job in meta.load_jobs.values()} or None,
        kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done)
        if done
        else None,
    )
    scheduler.update_from_output(out, output)


def test_vllms_scheduler_keeps_a_shared_prefix_on_the_host_with_prefix_aware(
    vllm_utils: ModuleType, tiny_model: str
) -> None:
    # Twelve requests, one after the other: the odd ones share a two-block prefix and
    # add two blocks, the even ones share nothing. The GPU cache (four blocks) loses
    # the prefix to each even request; the host tier (six chunks) evicts at every
    # store, and keeps the prefix for the next odd request to load.
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_offload.base import make_offload_key

    from vllm_cpu_offload.native_policies import PrefixAwareCachePolicy

    utils = vllm_utils
    config = utils.create_vllm_config(
        model=tiny_model,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=256,
        max_model_len=1024,
    )
    # Chunks of one full-attention layer, K and V of one head of size 1, in fp32,
    # each padded to vLLM's host alignment (4 KiB).
    line = kv_transfer_config_line(HOST_CHUNKS * 4096)
    config.kv_transfer_config = KVTransferConfig(**json.loads(line))
    scheduler = utils.create_scheduler(config, num_blocks=DEVICE_BLOCKS)
    manager = scheduler.connector.connector_scheduler.manager
    jobs = scheduler.connector.connector_scheduler._jobs  # transfers in flight
    policy = manager._policy
    assert isinstance(policy, PrefixAwareCachePolicy)
    assert policy.cache_capacity == HOST_CHUNKS

    stats = {"loads": 0, "stores": 0}
    stored: set[bytes] = set()
    for request_id in range(1, 13):
        # Odd requests share the prefix; even ones share nothing and push it out of
        # the GPU cache.
        request = utils.create_request(
            request_id=request_id,
            num_tokens=PROMPT_TOKENS,
            common_prefix_len=SHARED_TOKENS if request_id % 2 else 0,
            max_tokens=1,
            block_size=BLOCK_SIZE,
        )
        keys = [make_offload_key(h, 0) for h in request.block_hashes]
        scheduler.add_request(request)
        for _ in range(20):
            # Until vLLM's connector has seen the request finish (the step after).
            if not (scheduler.requests or scheduler.finished_req_ids or jobs):
                break
            _step(scheduler, utils, stats)
        else:
            pytest.fail(f"request {request_id} did not finish")
        stored.update(keys)
        policy.check_invariants()
        held = policy._held
        # vLLM's scheduler gave each chunk its position, and by the request's end the
        # chain is linked wherever a parent is held.
        for depth, key in enumerate(keys):
            if key in held:
                assert held[key].position == (depth + 1) * BLOCK_SIZE
                parent = keys[depth - 1] if depth else None
                if parent in held:
                    assert held[key].parent is held[parent], (request_id, depth)
        if request_id % 2:
            # Stores past the prefix evict, but never the prefix: it has children.
            assert all(k in held for k in keys[:2]), f"request {request_id}"

    assert len(stored) > 2 * HOST_CHUNKS, "the host tier hardly had to evict"
    # Every shared request after the first read the prefix from the host tier.
    assert stats["loads"] == 5
    assert manager._num_evictable_cache_chunks == len(policy._held)
