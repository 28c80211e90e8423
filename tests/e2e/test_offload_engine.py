"""End to end on real vLLM (CPU platform): blocks evicted from the device come back from
host.

One engine with the flags on serves every scenario of this module, in order; a baseline
engine without the flags (and without the plugin) gives the reference outputs.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import make_llm, scheduler_connector, shutdown, worker_connector

pytestmark = pytest.mark.e2e

PROMPT_BLOCKS = 6  # 192 tokens: four such prompts overflow the 24-block device cache


def _prompts(
    seed: int, count: int, blocks: int = PROMPT_BLOCKS, tail: int = 5
) -> list[str]:
    from vllm_cpu_offload.testing.tiny_model import random_words

    rng = random.Random(seed)
    return [random_words(rng, blocks * BLOCK_SIZE + tail) for _ in range(count)]


def _greedy(max_tokens: int = 12) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run(llm: Any, prompts: list[str], max_tokens: int = 12) -> list[Any]:
    return llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def baseline_tokens(tiny_model: str) -> dict[str, list[int]]:
    """Greedy tokens of every prompt this module uses, from vLLM without the flags."""
    llm = make_llm(
        tiny_model, offload=False, num_gpu_blocks_override=64, max_num_seqs=4
    )
    try:
        assert llm.llm_engine.vllm_config.kv_transfer_config is None
        prompts = _prompts(1, 6) + _prompts(2, 1, blocks=3)
        # One at a time, as the scenarios send them: bf16 outputs depend on the batch.
        return {p: _tokens(_run(llm, [p]))[0] for p in prompts}
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def llm(baseline_tokens: dict[str, list[int]], offload_llm: Any) -> Any:
    return offload_llm


def test_engine_starts_with_our_connector_on_both_sides(llm: Any) -> None:
    # The flags turn into our connector, in the scheduler and in the worker.
    from vllm_cpu_offload.connector import CPUOffloadConnector

    assert (
        llm.llm_engine.vllm_config.kv_transfer_config.kv_connector
        == "CPUOffloadConnector"
    )
    sched = scheduler_connector(llm)
    worker = worker_connector()
    assert isinstance(sched, CPUOffloadConnector) and sched.scheduler is not None
    assert isinstance(worker, CPUOffloadConnector) and worker.worker is not None
    assert worker.worker.engine is not None, "register_kv_caches was not called"
    assert sched.num_host_blocks == worker.num_host_blocks > 0


def test_evicted_prompt_comes_back_from_host_with_equal_outputs(
    llm: Any, baseline_tokens: dict[str, list[int]]
) -> None:
    # Read A, flush it out of the device cache with B..E, read A again: A
    # loads from host.
    sched = scheduler_connector(llm).scheduler
    a, *others = _prompts(1, 5)
    first = _run(llm, [a])
    for prompt in others:
        _run(llm, [prompt])
    hits_before, loads_before = sched.stats.hit_tokens, sched.stats.loaded_blocks
    again = _run(llm, [a])

    loaded_tokens = sched.stats.hit_tokens - hits_before
    assert loaded_tokens >= (PROMPT_BLOCKS - 1) * BLOCK_SIZE
    assert sched.stats.loaded_blocks - loads_before == loaded_tokens // BLOCK_SIZE
    # vLLM's own per-request count includes the host hit.
    assert again[0].num_cached_tokens >= loaded_tokens
    assert _tokens(again) == _tokens(first) == [baseline_tokens[a]]
    assert sched.stats.stored_blocks > 0 and sched.stats.failed_loads == 0


def test_no_request_state_or_pin_left_after_requests_finish(llm: Any) -> None:
    # After the engine is idle: no job in flight, no pinned or storing host block.
    sched = scheduler_connector(llm).scheduler
    _run(llm, _prompts(1, 2))
    assert sched.num_jobs_in_flight == 0
    assert sched.pool.num_pinned == 0 and sched.pool.num_storing == 0


def test_reset_prefix_cache_empties_the_host_tier(llm: Any) -> None:
    # reset_prefix_cache(reset_connector=True) drops every host block; the
    # next read misses.
    sched = scheduler_connector(llm).scheduler
    prompt = _prompts(2, 1, blocks=3)[0]
    _run(llm, [prompt])
    assert sched.pool.num_used > 0
    assert llm.reset_prefix_cache(reset_connector=True)
    assert sched.pool.num_used == 0
    hits = sched.stats.hit_tokens
    _run(llm, [prompt])
    assert sched.stats.hit_tokens == hits
