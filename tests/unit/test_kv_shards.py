"""How a block is cut into the shared store's values at every TP size: one per pipeline
stage for replicated KV (MLA), one per KV head for sharded attention (a rank holds the
heads vLLM gives it, and the first of the ranks that hold a head alike writes it), one
per rank where context parallelism also splits the tokens."""

from __future__ import annotations

import types

import pytest

from vllm_cpu_offload.kv_identity import HEADS, RANKS, REPLICATED, kv_sharding
from vllm_cpu_offload.kv_shards import WorkerShards, shard_names, worker_shards


def _config(
    *, heads: int = 8, mla: bool = False, tp: int = 1, pp: int = 1, dcp: int = 1
) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            use_mla=mla, get_total_num_kv_heads=lambda: heads
        ),
        parallel_config=types.SimpleNamespace(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=dcp,
        ),
    )


def test_replicated_kv_is_one_value_per_stage_written_by_the_first_rank() -> None:
    assert kv_sharding(_config(mla=True, tp=2)) == REPLICATED
    assert shard_names(_config(mla=True, tp=4, pp=2)) == ["pp0", "pp1"]
    assert shard_names(_config(mla=True, tp=1)) == shard_names(_config(mla=True, tp=8))
    assert worker_shards(_config(mla=True, tp=4, pp=2), 0, 1) == WorkerShards(
        ("pp1",), writes=True, per_head=False
    )
    assert not worker_shards(_config(mla=True, tp=4), 3, 0).writes


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_every_tp_size_cuts_a_block_into_the_same_head_values(tp: int) -> None:
    config = _config(heads=8, tp=tp, pp=2)
    assert kv_sharding(config) == HEADS
    every = [f"pp{p}-h{h}" for p in range(2) for h in range(8)]
    assert shard_names(config) == every
    read = [worker_shards(config, r, p).names for p in range(2) for r in range(tp)]
    # Each head of each stage is read by exactly one rank, in head order.
    assert [name for names in read for name in names] == every
    assert all(worker_shards(config, r, 0).writes for r in range(tp))
    assert all(worker_shards(config, r, 0).per_head for r in range(tp))


def test_past_one_rank_per_head_the_first_of_a_heads_ranks_writes_it() -> None:
    # 2 KV heads at TP=8: ranks 0-3 hold head 0, ranks 4-7 head 1 (vLLM's rule).
    config = _config(heads=2, tp=8)
    held = [worker_shards(config, r, 0) for r in range(8)]
    assert [s.names for s in held] == [("pp0-h0",)] * 4 + [("pp0-h1",)] * 4
    assert [s.writes for s in held] == [True, False, False, False] * 2


def test_context_parallelism_keeps_one_value_per_rank() -> None:
    config = _config(heads=8, tp=2, dcp=2)
    assert kv_sharding(config) == RANKS
    assert shard_names(config) == ["tp0-pp0", "tp1-pp0"]
    assert worker_shards(config, 1, 0) == WorkerShards(
        ("tp1-pp0",), writes=True, per_head=False
    )
    # A model whose heads do not split over the ranks, or that does not say.
    assert kv_sharding(_config(heads=3, tp=2)) == RANKS
    assert kv_sharding(_config(heads=0, tp=1)) == RANKS


def test_a_fleet_of_one_tp_size_may_keep_one_value_per_rank() -> None:
    config = _config(heads=8, tp=2)
    config.kv_transfer_config = types.SimpleNamespace(
        kv_connector_extra_config={"remote_values": "per_rank"}
    )
    assert kv_sharding(config) == RANKS
    assert worker_shards(config, 1, 0) == WorkerShards(
        ("tp1-pp0",), writes=True, per_head=False
    )
    # MLA's one value per stage is already the fewest.
    config.model_config.use_mla = True
    assert kv_sharding(config) == REPLICATED
