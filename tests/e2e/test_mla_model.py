"""An MLA model (DeepSeek-V2-shaped, generated) stored once per engine.

MLA's latent KV is the same on every tensor-parallel rank. At TP=2 both ranks map one
host region (one file, one set of pages), the first rank stores into it and both load
from it: re-reads come from host memory with the tokens of an engine without the flags.
The TP=2 engine writes every block through to a redis-server as one value named
without the rank, under a namespace without the TP size; a TP=1 engine with an empty
host tier then reads the same documents from the store, exactly. vLLM's CPU platform
turns device prefix caching off for MLA models, so every cached token of these runs
came from the host tier or the store. fp32, one request at a time.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.e2e.conftest import script_result
from vllm_cpu_offload.testing.tiny_mla import BLOCK_SIZE, ensure_tiny_mla

pytestmark = pytest.mark.e2e

DOCS = 4
DOC_TOKENS = 150
DEVICE_BLOCKS = 25  # a document takes 10: the device keeps none between reads
FULL_BLOCK_TOKENS = (DOC_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE


def _run(model: str, *flags: str, tp: int = 1) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    # One core per rank, as on a two-core machine a user would bind them.
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % 2) for i in range(tp))
    args: tuple[str, ...] = ("--mla", "--dtype", "float32", "--docs", str(DOCS))
    args += ("--doc-tokens", str(DOC_TOKENS), "--device-blocks", str(DEVICE_BLOCKS))
    args += ("--metrics", "--tensor-parallel-size", str(tp))
    return dict(
        script_result(
            "tests.e2e.long_document_run", model, *args, *flags, env=env, timeout=500
        )
    )


@pytest.fixture(scope="module")
def runs(redis_url: str) -> dict[str, dict[str, Any]]:
    model = str(ensure_tiny_mla())
    remote = ("--offload", "--swap-space-remote", redis_url)
    return {
        "without": _run(model),
        "tp2": _run(model, *remote, tp=2),
        "tp1_reader": _run(model, *remote),
    }


def _tokens(run: dict[str, Any]) -> list[list[int]]:
    return [r["tokens"] for r in run["requests"]]


def test_tp2_ranks_share_one_host_region(runs: dict[str, dict[str, Any]]) -> None:
    tiers = runs["tp2"]["host_tier"]
    assert len(tiers) == 2 and all(t["shared"] for t in tiers)
    # Both ranks map the same file: one set of pages for the engine, resident once.
    assert tiers[0]["mapping"]["inode"] == tiers[1]["mapping"]["inode"]
    assert tiers[0]["nbytes"] == tiers[1]["nbytes"]
    # Its pages are resident once for both: each rank's proportional share is half.
    for tier in tiers:
        rss, pss = tier["mapping"]["rss_kib"], tier["mapping"]["pss_kib"]
        assert rss * 1024 >= tier["nbytes"] * 0.9 and pss <= 0.55 * rss, tier


def test_tp2_rereads_come_from_host_with_the_tokens_of_the_run_without_flags(
    runs: dict[str, dict[str, Any]],
) -> None:
    without, tp2 = runs["without"], runs["tp2"]
    assert _tokens(tp2) == _tokens(without)
    assert kv_groups_are_mla(tp2)
    assert all(r["cached"] == 0 for r in without["requests"])
    assert all(r["cached"] == 0 for r in tp2["requests"][:DOCS])
    assert all(r["cached"] >= FULL_BLOCK_TOKENS for r in tp2["requests"][DOCS:])


def test_a_tp1_engine_reads_what_the_tp2_engine_wrote_to_the_store(
    runs: dict[str, dict[str, Any]],
) -> None:
    without, tp2, reader = runs["without"], runs["tp2"], runs["tp1_reader"]
    assert tp2["metrics"]["vllm:cpu_offload_remote_written_blocks"] > 0
    # Its first read of each document comes from the store: TP=2's blocks.
    assert all(r["cached"] >= FULL_BLOCK_TOKENS for r in reader["requests"][:DOCS])
    assert reader["metrics"]["vllm:cpu_offload_remote_hit_tokens"] >= (
        DOCS * FULL_BLOCK_TOKENS
    )
    assert _tokens(reader) == _tokens(without)


def kv_groups_are_mla(run: dict[str, Any]) -> bool:
    return run["kv_cache_groups"] == ["MLAAttentionSpec"]
