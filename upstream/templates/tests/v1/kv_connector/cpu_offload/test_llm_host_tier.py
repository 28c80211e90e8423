# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LLM(kv_transfer_config=CPUOffloadConnector) serves re-reads from host memory, with
the greedy outputs of the same engine without it."""

import gc
import random

from tests.v1.kv_connector.cpu_offload.tiny_model import random_token_ids
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt

BLOCK_SIZE = 32
DEVICE_BLOCKS = 24  # the device cache holds about two of the documents
DOCS = 6
DOC_TOKENS = 300
FULL_BLOCKS = (DOC_TOKENS - 1) // BLOCK_SIZE


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
        (out,) = llm.generate(
            [TokensPrompt(prompt_token_ids=doc)], params, use_tqdm=False
        )
        results.append((list(out.outputs[0].token_ids), out.num_cached_tokens or 0))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return results


def test_rereads_come_from_host_memory_with_the_same_tokens(tiny_model: str) -> None:
    without = read_twice(tiny_model)
    with_tier = read_twice(
        tiny_model,
        kv_transfer_config=KVTransferConfig(
            kv_connector="CPUOffloadConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"swap_space_gib": 0.05},
        ),
    )
    assert [tokens for tokens, _ in with_tier] == [tokens for tokens, _ in without]
    # Without the tier the device cache is too small to keep any document until its
    # re-read; with it, every full block of each re-read comes back from host memory.
    assert all(cached == 0 for _, cached in without[DOCS:])
    assert all(cached >= FULL_BLOCKS * BLOCK_SIZE for _, cached in with_tier[DOCS:])
