# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LLM(enable_cpu_offload=True, swap_space=...) turns the host tier on: re-reads come
from host memory (test_llm_host_tier.py compares the tokens with the engine without
it)."""

from tests.v1.kv_connector.cpu_offload.test_llm_host_tier import (
    BLOCK_SIZE,
    DOCS,
    FULL_BLOCKS,
    read_twice,
)


def test_the_flags_turn_the_host_tier_on(tiny_model: str) -> None:
    with_flag = read_twice(tiny_model, enable_cpu_offload=True, swap_space=0.05)
    assert all(cached == 0 for _, cached in with_flag[:DOCS])
    assert all(cached >= FULL_BLOCKS * BLOCK_SIZE for _, cached in with_flag[DOCS:])
