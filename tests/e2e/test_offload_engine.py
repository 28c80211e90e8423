"""End to end on real vLLM (CPU platform): blocks evicted from the device come back from
host; conversations, preemption and aborts with the host tier on.

One engine with the flags on serves every scenario of this module, in order; a baseline
engine without the flags (and without the plugin) gives the reference outputs of the
first scenarios. The later ones run requests together and compare with the same
requests run alone. In bf16 that comparison fails on vLLM's CPU path even without this
package (measured: 2 of the 6 preempted requests of the preemption scenario differ from
their solo runs with the flags off), because a batch changes the kernels' reduction
order; so this module runs in fp32 (make_llm's default).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import make_llm, scheduler_connector, shutdown, worker_connector
from vllm_cpu_offload.testing.tiny_model import random_token_ids

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
        # One at a time, as the scenarios send them.
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
    # Both halves size the tier alike; the worker counts slots, k per host block.
    tier, k = worker.worker, sched.scheduler.blocks_per_host_block
    assert tier.blocks_per_host_block == k
    assert tier.num_slots == sched.num_host_blocks * k > 0


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


# Conversations, preemption and aborts: requests run together.


def _words(seed: int, n: int) -> list[int]:
    return random_token_ids(random.Random(seed), n)


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    return llm.generate(inputs, _greedy(max_tokens), use_tqdm=False)


def _assert_idle(sched: Any) -> None:
    assert sched.num_jobs_in_flight == 0
    assert sched.pool.num_pinned == 0 and sched.pool.num_storing == 0


def test_second_turn_hits_blocks_stored_during_first_turn_decode(
    offload_llm: Any,
) -> None:
    # Turn 1 decodes past several block boundaries; after the device cache is flushed,
    # turn 2 (turn 1 + its answer + a question) loads the decode blocks from host too.
    sched = scheduler_connector(offload_llm).scheduler
    turn1 = _words(11, 2 * BLOCK_SIZE + 7)
    answer = list(
        _generate(offload_llm, [turn1], max_tokens=3 * BLOCK_SIZE)[0]
        .outputs[0]
        .token_ids
    )
    for seed in range(12, 16):
        _generate(offload_llm, [_words(seed, 6 * BLOCK_SIZE)], max_tokens=4)
    hits = sched.stats.hit_tokens
    turn2 = turn1 + answer + _words(17, 20)
    _generate(offload_llm, [turn2], max_tokens=4)
    loaded = sched.stats.hit_tokens - hits
    prompt_only = len(turn1) // BLOCK_SIZE * BLOCK_SIZE
    # Every full block of turn 1 and its answer (except the last token's)
    # comes from host.
    assert loaded > prompt_only
    assert loaded >= (len(turn1) + len(answer) - 1) // BLOCK_SIZE * BLOCK_SIZE
    _assert_idle(sched)


def test_preemption_under_memory_pressure_loses_nothing(offload_llm: Any) -> None:
    # Six requests whose decodes outgrow the 24-block device cache: vLLM preempts and
    # resumes them; every one finishes with the tokens it gets when run alone.
    sched = scheduler_connector(offload_llm).scheduler
    prompts = [_words(100 + i, 3 * BLOCK_SIZE + 5) for i in range(6)]
    alone = [
        _generate(offload_llm, [p], max_tokens=96)[0].outputs[0].token_ids
        for p in prompts
    ]
    preemptions = sched.stats.preempted_requests
    together = _generate(offload_llm, prompts, max_tokens=96)
    assert sched.stats.preempted_requests > preemptions, "the scenario did not preempt"
    assert [list(o.outputs[0].token_ids) for o in together] == [list(t) for t in alone]
    _assert_idle(sched)


def test_aborted_requests_leave_nothing_behind(offload_llm: Any) -> None:
    # Abort requests mid-decode (stores planned and in flight); the engine drains, frees
    # everything, and the next request still hits the blocks stored before the abort.
    sched = scheduler_connector(offload_llm).scheduler
    engine = offload_llm.llm_engine
    prompts = [_words(200 + i, 4 * BLOCK_SIZE) for i in range(3)]
    from vllm.inputs import TokensPrompt

    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", TokensPrompt(prompt_token_ids=p), _greedy(200))
    for _ in range(6):
        engine.step()
    engine.abort_request([f"abort-{i}" for i in range(3)])
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    _assert_idle(sched)
    assert not sched._requests
    hits = sched.stats.hit_tokens
    # Device only: the host tier must serve the next read.
    offload_llm.reset_prefix_cache()
    _generate(offload_llm, [prompts[0] + _words(300, 5)], max_tokens=2)
    assert sched.stats.hit_tokens - hits >= 3 * BLOCK_SIZE


def test_requests_sharing_a_prefix_load_it_once_without_waiting(
    offload_llm: Any,
) -> None:
    # Two requests with one host-resident prefix arrive together: the first
    # loads it within the step, the second finds it in the device cache; the
    # prefix is loaded once.
    sched = scheduler_connector(offload_llm).scheduler
    prefix = _words(400, 5 * BLOCK_SIZE)
    prompts = [prefix + _words(401, 9), prefix + _words(402, 9)]
    alone = [
        list(_generate(offload_llm, [p], max_tokens=8)[0].outputs[0].token_ids)
        for p in prompts
    ]
    for seed in range(403, 407):
        _generate(offload_llm, [_words(seed, 6 * BLOCK_SIZE)], max_tokens=2)
    loaded = sched.stats.loaded_blocks
    together = _generate(offload_llm, prompts, max_tokens=8)
    assert sched.stats.loaded_blocks - loaded == 5
    assert [list(o.outputs[0].token_ids) for o in together] == alone
    assert [o.num_cached_tokens for o in together] == [5 * BLOCK_SIZE] * 2
    _assert_idle(sched)
