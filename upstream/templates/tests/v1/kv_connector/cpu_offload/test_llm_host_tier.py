# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LLM(enable_cpu_offload=True, swap_space=...) serves re-reads from host memory, with
the greedy outputs of the same engine without the flag."""

import gc
import random

import pytest

from tests.v1.kv_connector.cpu_offload.tiny_model import random_token_ids
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

BLOCK_SIZE = 32
DEVICE_BLOCKS = 24  # the device cache holds about two of the documents
DOCS = 6
DOC_TOKENS = 300


def read_twice(model: str, **flags: object) -> list[tuple[list[int], int]]:
    """Every document read, then read again, one request at a time (bf16, greedy)."""
    llm = LLM(
        model,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=DEVICE_BLOCKS,
        max_model_len=DOC_TOKENS + 2 * BLOCK_SIZE,
        dtype="bfloat16",
        seed=0,
        **flags,
    )
    rng = random.Random(11)
    docs = [random_token_ids(rng, DOC_TOKENS) for _ in range(DOCS)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = []
    for doc in docs * 2:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=doc)], params, use_tqdm=False)
        results.append((list(out.outputs[0].token_ids), out.num_cached_tokens or 0))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return results


@pytest.mark.parametrize("swap_space", [0.05])
def test_rereads_come_from_host_memory_with_the_same_tokens(
    tiny_model: str, swap_space: float
) -> None:
    without = read_twice(tiny_model)
    with_flag = read_twice(tiny_model, enable_cpu_offload=True, swap_space=swap_space)
    assert [tokens for tokens, _ in with_flag] == [tokens for tokens, _ in without]
    # Without the flag the device cache is too small to keep any document until its
    # re-read; with it, every full block of each re-read comes back from host memory.
    assert all(cached == 0 for _, cached in without[DOCS:])
    full_blocks = (DOC_TOKENS - 1) // BLOCK_SIZE
    assert all(cached >= full_blocks * BLOCK_SIZE for _, cached in with_flag[DOCS:])
