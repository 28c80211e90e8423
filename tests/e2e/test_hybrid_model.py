"""A hybrid sliding-window model (Gemma-2 style) keeps vLLM's hybrid KV cache manager
on, in host memory and in the shared store.

The generated model alternates sliding-window layers (a 64-token window) with
full-attention ones, so vLLM's hybrid manager makes two KV cache groups. With the flags
it must stay on: the connector serves both groups, a sliding-window group loading only
the blocks of its window. The run with the flags also writes every block it stores
through to a redis-server; a second engine, with an empty host tier, then reads the same
documents from there. One request at a time, the engine as users run it, as in
test_bf16_exact, but in fp32: which blocks each group stores and loads does not depend
on the dtype, and an AVX2-only CPU runs bf16 about 100x slower.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import assert_exact_with_host_rereads, long_documents
from vllm_cpu_offload.testing.tiny_model import TEST_SHAPE, ensure_tiny_llama

pytestmark = pytest.mark.e2e

WINDOW = 64
DOC_TOKENS = 300
DOCS = 6
DEVICE_BLOCKS = 32  # shared by both groups: a document takes 10 full-attention blocks


def _run(model: str, *flags: str) -> dict[str, Any]:
    args: tuple[str, ...]
    args = ("--docs", str(DOCS), "--doc-tokens", str(DOC_TOKENS), "--metrics")
    args += ("--dtype", "float32")
    return long_documents(model, *args, "--device-blocks", str(DEVICE_BLOCKS), *flags)


@pytest.fixture(scope="module")
def hybrid_model() -> str:
    return str(
        ensure_tiny_llama(dataclasses.replace(TEST_SHAPE, sliding_window=WINDOW))
    )


@pytest.fixture(scope="module")
def runs(hybrid_model: str, redis_url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    # With the flags, every stored block is written through to the store too.
    remote = ("--swap-space-remote", redis_url)
    return _run(hybrid_model), _run(hybrid_model, "--offload", *remote)


def test_hybrid_manager_stays_on_with_the_flags(
    runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    without, with_flag = runs
    assert sorted(without["kv_cache_groups"]) == [
        "FullAttentionSpec",
        "SlidingWindowSpec",
    ]
    assert with_flag["kv_cache_groups"] == without["kv_cache_groups"]


def test_hybrid_rereads_come_from_host_with_the_tokens_of_the_run_without_flags(
    runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    without, with_flag = runs
    full_blocks = (DOC_TOKENS - 1) // BLOCK_SIZE
    assert_exact_with_host_rereads(without, with_flag, DOCS, full_blocks * BLOCK_SIZE)


def test_window_group_loads_only_its_window_per_group_metrics(
    runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    # Per KV cache group (LLM.get_metrics names counters without _total): both groups
    # stored every full block of the documents;
    # on re-reads the full-attention group loaded every block after the device hit, the
    # window group only the blocks of its 64-token window (2 or 3 per document).
    without, with_flag = runs
    assert not any(name.startswith("vllm:cpu_offload_") for name in without["metrics"])
    full = with_flag["kv_cache_groups"].index("FullAttentionSpec")
    window = 1 - full
    metrics = with_flag["metrics"]
    loaded = {
        g: metrics[f"vllm:cpu_offload_group_loaded_blocks{{{g}}}"] for g in (0, 1)
    }
    stored = {
        g: metrics[f"vllm:cpu_offload_group_stored_blocks{{{g}}}"] for g in (0, 1)
    }
    full_blocks = (DOC_TOKENS - 1) // BLOCK_SIZE  # 9 per document
    assert stored[full] == stored[window] >= DOCS * full_blocks, stored
    # most re-reads from host
    assert loaded[full] >= DOCS * full_blocks - full_blocks, loaded
    window_blocks = WINDOW // BLOCK_SIZE + 1
    assert 0 < loaded[window] <= DOCS * window_blocks < loaded[full], loaded
    assert loaded[full] + loaded[window] == metrics["vllm:cpu_offload_loaded_blocks"]


def test_a_second_engine_reads_the_hybrid_documents_from_the_shared_store(
    hybrid_model: str,
    redis_url: str,
    runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    # The run with the flags wrote every block of both groups to the store before it
    # exited. A fresh engine's first read of each document fetches its full blocks
    # (every full-attention block, the window group's last window) from the store,
    # its second read hits host memory; the tokens are those of the run without flags.
    without, _ = runs
    second = _run(hybrid_model, "--offload", "--swap-space-remote", redis_url)
    full_blocks = (DOC_TOKENS - 1) // BLOCK_SIZE  # 9 per document
    assert [r["tokens"] for r in second["requests"]] == [
        r["tokens"] for r in without["requests"]
    ]
    assert all(r["cached"] >= full_blocks * BLOCK_SIZE for r in second["requests"]), (
        second["requests"]
    )
    metrics = second["metrics"]
    remote = {
        name.removeprefix("vllm:cpu_offload_remote_"): value
        for name, value in metrics.items()
        if name.startswith("vllm:cpu_offload_remote_")
    }
    assert remote["hit_tokens"] == DOCS * full_blocks * BLOCK_SIZE, remote
    assert remote.get("missed_blocks", 0) == remote.get("rejected_blocks", 0) == 0
    # The window group loaded (from the store, then from host memory) only the
    # blocks of its 64-token window: 2 before a 9-block hit's end, at most 3.
    full = second["kv_cache_groups"].index("FullAttentionSpec")
    loaded = {
        g: metrics[f"vllm:cpu_offload_group_loaded_blocks{{{g}}}"] for g in (0, 1)
    }
    window_blocks = WINDOW // BLOCK_SIZE + 1
    assert DOCS * 2 <= loaded[1 - full] <= DOCS * 2 * window_blocks < loaded[full], (
        loaded
    )
