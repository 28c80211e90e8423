"""End to end on vLLM 0.33.0 with the upstream series applied: vLLM's own offloading
(`kv_offloading_size`) on the CPU platform, with the plugin's `prefix_aware` as its
`CachePolicy` (`vllm_cpu_offload.native_policies`), keeps a shared prefix in host
memory where vLLM's `lru` evicts it, with the greedy outputs of a device cache that
holds everything.

Unpatched vLLM refuses `kv_offloading_size` on the CPU platform (upstream/ [2/3]), so
this module is skipped unless the series' worker is importable. Run it on the
patched overlay:

    OVERLAY="$(bash scripts/patched_vllm033.sh upstream .cache/patched-vllm033)"
    PYTHONPATH="$OVERLAY:$PWD" VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python \\
        -m pytest -q tests/e2e/test_vllm_offloading_prefix_aware.py
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import make_llm, scheduler_connector, shutdown

if importlib.util.find_spec("vllm.v1.kv_offload.cpu.cpu_worker") is None:
    pytest.skip(
        'needs vLLM with upstream/ applied: PYTHONPATH="$(bash '
        'scripts/patched_vllm033.sh upstream .cache/patched-vllm033):$PWD"',
        allow_module_level=True,
    )

# One request's prompt and output (5 blocks) and vLLM's null block: each request
# takes every block of the device cache.
DEVICE_BLOCKS = 6
HOST_CHUNKS = 6  # three requests' prompts of four blocks would need 12
PREFIX_TOKENS = 2 * BLOCK_SIZE
PROMPT_TOKENS = 4 * BLOCK_SIZE
REQUESTS = 12
MAX_TOKENS = 8
MAX_MODEL_LEN = 5 * BLOCK_SIZE


def prompts() -> list[list[int]]:
    """Odd requests: a shared two-block prefix and two blocks of their own; even
    requests: four blocks of their own."""
    from vllm_cpu_offload.testing.tiny_model import random_token_ids

    rng = random.Random(7)
    prefix = random_token_ids(rng, PREFIX_TOKENS)
    return [
        prefix + random_token_ids(rng, PROMPT_TOKENS - PREFIX_TOKENS)
        if i % 2
        else random_token_ids(rng, PROMPT_TOKENS)
        for i in range(1, REQUESTS + 1)
    ]


def host_gib() -> float:
    """HOST_CHUNKS blocks of the test model in fp32 (e2e's dtype), in GiB."""
    from vllm_cpu_offload.testing.tiny_model import TEST_SHAPE as s

    head_dim = s.hidden_size // s.num_heads
    block_bytes = 2 * s.num_layers * BLOCK_SIZE * s.num_kv_heads * head_dim * 4
    return HOST_CHUNKS * block_bytes / (1 << 30)


def read(llm: Any) -> list[tuple[int, list[int]]]:
    """(cached prompt tokens, greedy tokens) of each request, one at a time."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = []
    for prompt in prompts():
        [out] = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False
        )
        results.append((out.num_cached_tokens or 0, list(out.outputs[0].token_ids)))
    return results


def counter(llm: Any, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def test_prefix_aware_keeps_a_shared_prefix_in_vllms_host_tier(tiny_model: str):
    # Each even request fills the device cache and makes the host tier (6 chunks)
    # evict 2-4 chunks. vLLM's lru evicts the shared prefix, its oldest chunks (one
    # of the five shared re-reads hit with it); prefix_aware evicts leaves before
    # their ancestors and keeps it, so every shared request after the first reads it
    # from host memory, as a device cache that holds everything serves it from there.
    from vllm_cpu_offload.native_policies import PrefixAwareCachePolicy

    llm = make_llm(
        tiny_model,
        offload=False,
        num_gpu_blocks_override=DEVICE_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        disable_log_stats=False,  # the counters
        kv_offloading_size=host_gib(),
        kv_transfer_config={
            "kv_connector_extra_config": {
                "eviction_policy": "PrefixAwareCachePolicy",
                "cache_policy_module_path": "vllm_cpu_offload.native_policies",
            },
        },
    )
    try:
        manager = scheduler_connector(llm).connector_scheduler.manager
        policy = manager._policy
        assert isinstance(policy, PrefixAwareCachePolicy)
        assert policy.cache_capacity == HOST_CHUNKS
        offloaded = read(llm)
        policy.check_invariants()
        host_hits = counter(llm, "vllm:external_prefix_cache_hits")
        stored = counter(llm, "vllm:kv_offload_store_bytes")
        chunk = counter(llm, "vllm:kv_offload_load_bytes") / max(host_hits, 1)
    finally:
        shutdown(llm)
    reference = read_with_everything_on_the_device(tiny_model)

    shared_rereads = (REQUESTS // 2 - 1) * PREFIX_TOKENS
    assert host_hits == shared_rereads
    # Every chunk stored is one block; far more were stored than the tier holds.
    assert stored / (chunk * BLOCK_SIZE) > 2 * HOST_CHUNKS
    assert [cached for cached, _ in reference] == [0, 0] + [PREFIX_TOKENS, 0] * (
        REQUESTS // 2 - 1
    )
    assert offloaded == reference


def read_with_everything_on_the_device(model: str) -> list[tuple[int, list[int]]]:
    llm = make_llm(model, offload=False, max_model_len=MAX_MODEL_LEN)
    try:
        return read(llm)
    finally:
        shutdown(llm)
