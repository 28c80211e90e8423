"""End to end on real vLLM: injected transfer faults cost recomputes only; an idle
engine holds no block for a store that is done."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import make_llm, scheduler_connector, shutdown
from tests.fault_injection import FaultInjector
from vllm_cpu_offload.testing.tiny_model import random_token_ids

pytestmark = pytest.mark.e2e

DOCS, DOC_TOKENS = 8, 6 * BLOCK_SIZE + 7


def _read(llm: Any, prompt: list[int], max_tokens: int = 6) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False
    )[0]


@pytest.fixture(scope="module")
def faulty_llm(tiny_model: str) -> Iterator[Any]:
    # The worker runs in this process: its half of the connector is vLLM's KV
    # transfer group here, and takes a test's injector.
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_cpu_offload.connector import CPUOffloadConnector

    llm = make_llm(tiny_model, offload=True)
    connector = get_kv_transfer_group()
    assert isinstance(connector, CPUOffloadConnector) and connector.worker is not None
    connector.worker.faults = FaultInjector(0.4, seed=5)
    yield llm
    shutdown(llm)


def test_failed_loads_and_stores_are_recomputed_with_exact_outputs(
    faulty_llm: Any,
) -> None:
    # One request at a time: documents read twice while 40% of transfers fail.
    # Every re-read equals its first read; failures are counted, some loads still
    # succeed, and nothing is left pinned or in flight.
    sched = scheduler_connector(faulty_llm).scheduler
    rng = random.Random(21)
    docs = [random_token_ids(rng, DOC_TOKENS) for _ in range(DOCS)]
    first = [list(_read(faulty_llm, d).outputs[0].token_ids) for d in docs]
    again = [list(_read(faulty_llm, d).outputs[0].token_ids) for d in docs]
    assert again == first
    stats = sched.stats
    assert stats.failed_loads > 0 and stats.failed_stores > 0
    assert stats.loaded_blocks > 0 and stats.stored_blocks > 0
    assert sched.num_jobs_in_flight == 0 and sched.pool.num_pinned == 0


def test_engine_going_idle_holds_no_block_for_a_finished_store(faulty_llm: Any) -> None:
    # One output token: the prompt's blocks are stored in the request's only step. When
    # generate returns (the engine steps no more), vLLM holds no finished request and
    # its device cache resets.
    engine_core = faulty_llm.llm_engine.engine_core.engine_core
    for seed in range(3):
        _read(faulty_llm, random_token_ids(random.Random(100 + seed), DOC_TOKENS), 1)
        assert not engine_core.scheduler.requests
        assert faulty_llm.reset_prefix_cache()
