"""An MLA model (DeepSeek-V2-shaped, generated) on each of vLLM's CPU MLA backends.

CPU_MLA, the reference backend, runs on every machine (asked for, fp32): vLLM turns
prefix caching off with it for MLA models, so the host tier serves no hits and stores
nothing, and one start-up line says why; tokens are those of an engine without the
flags. Its TP=2 ranks still map one host region.

AMX_MLA runs where the CPU has AMX tiles (bf16, 32-token blocks), with prefix caching
on. MLA's latent KV is the same on every tensor-parallel rank: at TP=2 the first rank
stores into the host region both ranks map, and both load from it, so re-reads come
from host memory with the tokens of the first reads, which hit nothing. (In bf16 a
TP=2 engine's sums differ from a TP=1 engine's: its greedy tokens may differ from
TP=1's, with or without the flags, so its first reads are its reference.) The TP=2
engine writes every block through to a redis-server as one value named without the
rank, under a namespace without the TP size; a TP=1 engine with an empty host tier
then reads the same documents from the store with the tokens of a TP=1 engine without
the flags. The device cache is too small to keep a document between its reads (the
engine without the flags hits nothing), so every cached token came from the host tier
or the store. One request at a time.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.e2e.conftest import script_output
from vllm_cpu_offload.testing import tiny_mla

pytestmark = pytest.mark.e2e

DOCS = 4
DOC_TOKENS = 150
# Per backend: its block size, and a device cache that keeps 2.5 documents, so none
# between its reads (four documents apart).
BLOCK_SIZES = {"CPU_MLA": tiny_mla.BLOCK_SIZE, "AMX_MLA": tiny_mla.AMX_BLOCK_SIZE}
DEVICE_BLOCKS = {"CPU_MLA": 25, "AMX_MLA": 12}
DTYPES = {"CPU_MLA": "float32", "AMX_MLA": "bfloat16"}  # AMX_MLA takes bf16 only
NOTICE = "CPU offload: vLLM has prefix caching off (vLLM's CPU platform turns it off"


def _full_block_tokens(backend: str) -> int:
    """The prompt tokens of a document in full blocks: what a hit can cover."""
    block = BLOCK_SIZES[backend]
    return (DOC_TOKENS - 1) // block * block


def _run(model: str, backend: str, *flags: str, tp: int = 1) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    # One core per rank, as on a two-core machine a user would bind them.
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % 2) for i in range(tp))
    args: tuple[str, ...] = ("--mla", backend, "--dtype", DTYPES[backend])
    args += ("--docs", str(DOCS))
    args += ("--doc-tokens", str(DOC_TOKENS))
    args += ("--device-blocks", str(DEVICE_BLOCKS[backend]))
    args += ("--metrics", "--tensor-parallel-size", str(tp))
    result, log = script_output(
        "tests.e2e.long_document_run", model, *args, *flags, env=env, timeout=500
    )
    return {**result, "log": log}


def _runs(backend: str, redis_url: str, with_reader: bool) -> dict[str, dict[str, Any]]:
    model = str(tiny_mla.ensure_tiny_mla())
    remote = ("--offload", "--swap-space-remote", redis_url)
    runs = {
        "without": _run(model, backend),
        "tp2": _run(model, backend, *remote, tp=2),
    }
    if with_reader:
        runs["tp1_reader"] = _run(model, backend, *remote)
    return runs


@pytest.fixture(scope="module")
def cpu_mla(redis_url: str) -> dict[str, dict[str, Any]]:
    """Runs on CPU_MLA: without the flags, and TP=2 with the host tier and the store.
    (A reader of the store would find nothing: the TP=2 engine stores nothing.)"""
    return _runs("CPU_MLA", redis_url, with_reader=False)


@pytest.fixture(scope="module")
def amx_mla(redis_url: str) -> dict[str, dict[str, Any]]:
    """Runs on AMX_MLA: without the flags, TP=2 with the host tier and the store, and
    then TP=1 with them (an empty host tier, the store TP=2 filled)."""
    if not tiny_mla.amx_mla_runs_here():
        pytest.skip("vLLM runs AMX_MLA only on an x86 CPU with AMX tiles (amx_tile)")
    return _runs("AMX_MLA", redis_url, with_reader=True)


def _tokens(run: dict[str, Any]) -> list[list[int]]:
    return [r["tokens"] for r in run["requests"]]


def _engine_is(run: dict[str, Any], backend: str, prefix_caching: bool) -> None:
    assert run["attention_backends"] == [backend]
    assert run["kv_cache_groups"] == ["MLAAttentionSpec"]
    assert run["block_size"] == BLOCK_SIZES[backend]
    assert run["prefix_caching"] is prefix_caching


def test_on_cpu_mla_the_tier_serves_no_hits_stores_nothing_and_says_why(
    cpu_mla: dict[str, dict[str, Any]],
) -> None:
    without, tp2 = cpu_mla["without"], cpu_mla["tp2"]
    for run in (without, tp2):
        _engine_is(run, "CPU_MLA", prefix_caching=False)
        assert all(r["cached"] == 0 for r in run["requests"])
    assert _tokens(tp2) == _tokens(without)
    metrics = tp2["metrics"]
    for name in ("stored_blocks", "loaded_blocks", "hit_tokens", "remote_hit_tokens"):
        assert metrics["vllm:cpu_offload_" + name] == 0, name
    assert metrics["vllm:cpu_offload_remote_written_blocks"] == 0
    # One line at start says why (the scheduler logs it once per engine).
    assert tp2["log"].count(NOTICE) == 1
    assert NOTICE not in without["log"]


def test_on_cpu_mla_tp2_ranks_share_one_host_region(
    cpu_mla: dict[str, dict[str, Any]],
) -> None:
    # The region is mapped at start, whether or not the tier serves hits.
    assert_ranks_share_one_host_region(cpu_mla["tp2"])


def test_on_amx_mla_tp2_rereads_come_from_host_with_the_tokens_of_the_first_reads(
    amx_mla: dict[str, dict[str, Any]],
) -> None:
    without, tp2 = amx_mla["without"], amx_mla["tp2"]
    for run in (without, tp2):
        _engine_is(run, "AMX_MLA", prefix_caching=True)
    assert NOTICE not in tp2["log"]
    # The device keeps no document between its reads: what TP=2 hits is the host's.
    assert all(r["cached"] == 0 for r in without["requests"])
    assert all(r["cached"] == 0 for r in tp2["requests"][:DOCS])
    full = _full_block_tokens("AMX_MLA")
    assert all(r["cached"] >= full for r in tp2["requests"][DOCS:])
    # Re-reads from host give the tokens of the first reads, computed without a hit
    # as by an engine without the flags (of TP=2: see the module's docstring).
    first_reads, rereads = _tokens(tp2)[:DOCS], _tokens(tp2)[DOCS:]
    assert rereads == first_reads
    assert tp2["metrics"]["vllm:cpu_offload_hit_tokens"] >= DOCS * full
    assert_ranks_share_one_host_region(tp2)


def test_on_amx_mla_a_tp1_engine_reads_what_the_tp2_engine_wrote_to_the_store(
    amx_mla: dict[str, dict[str, Any]],
) -> None:
    without, tp2, reader = amx_mla["without"], amx_mla["tp2"], amx_mla["tp1_reader"]
    assert tp2["metrics"]["vllm:cpu_offload_remote_written_blocks"] > 0
    # Its first read of each document comes from the store: TP=2's blocks.
    full = _full_block_tokens("AMX_MLA")
    assert all(r["cached"] >= full for r in reader["requests"][:DOCS])
    assert reader["metrics"]["vllm:cpu_offload_remote_hit_tokens"] >= DOCS * full
    assert _tokens(reader) == _tokens(without)


def assert_ranks_share_one_host_region(run: dict[str, Any]) -> None:
    tiers = run["host_tier"]
    assert len(tiers) == 2 and all(t["shared"] for t in tiers)
    # Both ranks map the same file: one set of pages for the engine, resident once.
    assert tiers[0]["mapping"]["inode"] == tiers[1]["mapping"]["inode"]
    assert tiers[0]["nbytes"] == tiers[1]["nbytes"]
    # Its pages are resident once for both: each rank's proportional share is half.
    for tier in tiers:
        rss, pss = tier["mapping"]["rss_kib"], tier["mapping"]["pss_kib"]
        assert rss * 1024 >= tier["nbytes"] * 0.9 and pss <= 0.55 * rss, tier
