"""KV that every tensor-parallel rank holds alike: MLA's latent KV.

MLA caches one latent vector per token, made by replicated projections, so each rank
of a tensor-parallel group computes and keeps the same bytes; sharded attention keeps
a slice of the KV heads per rank. Replicated KV is stored once:
- the host tier is one region per engine (per pipeline stage), which every rank of the
  stage maps (`worker/shared_region.py`); its first rank copies stores into it, every
  rank loads from it;
- the shared store holds one value per block, named by the pipeline stage alone, which
  the first rank writes and every rank reads; its namespace leaves the tensor-parallel
  size out, so engines of any TP size read each other's blocks.
`--swap-space` then sizes the KV an engine keeps, whatever its TP size.
"""

from __future__ import annotations

from typing import Any

from vllm_cpu_offload.kv_identity import kv_is_replicated
from vllm_cpu_offload.persist.fingerprint import rank_name, worker_names


def stage_name(pp_rank: int) -> str:
    """The shard name of a pipeline stage's replicated KV."""
    return f"pp{pp_rank}"


def shard_names(vllm_config: Any) -> list[str]:
    """The names of the shards one block has in the shared store, in rank order: one
    per worker, or one per pipeline stage where KV is replicated."""
    if not kv_is_replicated(vllm_config):
        return worker_names(vllm_config)
    stages = vllm_config.parallel_config.pipeline_parallel_size
    return [stage_name(pp) for pp in range(stages)]


def shard_name(vllm_config: Any, tp_rank: int, pp_rank: int) -> str:
    """The shard name of the worker of these ranks (see `shard_names`)."""
    if kv_is_replicated(vllm_config):
        return stage_name(pp_rank)
    return rank_name(tp_rank, pp_rank)
