"""How one block is cut into values of the shared store, so that engines of any
tensor-parallel size read each other's blocks.

A block's key names its prefix; each of its values adds a shard name. How a block is cut
follows how its KV is spread over the ranks (`kv_identity.kv_sharding`):
- replicated (MLA's latent KV, the same on every rank): one value per pipeline stage,
  `pp{p}`, which the stage's first rank writes and every rank reads. The host tier is
  also one region per stage that every rank maps (`worker/shared_region.py`), so
  `--swap-space` sizes the KV an engine keeps, whatever its TP size;
- per KV head (sharded attention): one value per KV head, `pp{p}-h{h}`, every layer's
  bytes of that head. vLLM gives rank r of TP size t the heads r*H/t up to (r+1)*H/t
  (or, with more ranks than heads, head r*H/t, held alike by t/H ranks, of which the
  first writes), so a rank of any TP size finds the values of the heads it holds and
  cuts and joins them in host memory (`worker/head_slices.py`);
- per rank, where neither holds: `tp{t}-pp{p}`, and the namespace keeps the TP size.
The namespace leaves the TP size out in the first two cases (`kv_identity`).

Context parallelism spreads a block's tokens over ranks too; the tier refuses it
(`context_parallel.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_cpu_offload.kv_identity import (
    HEADS,
    REPLICATED,
    kv_sharding,
    total_kv_heads,
)
from vllm_cpu_offload.ranks import rank_name, worker_names


@dataclass(frozen=True)
class WorkerShards:
    """The values of a block one worker reads and writes.

    Attributes:
        names: the shard names of the values that make this worker's part of a
            block, in the order its host slot joins them.
        writes: whether this worker writes them (the first holder of a replicated
            value does).
        per_head: whether each value is one KV head of the slot (cut and joined in
            host memory), rather than the whole slot.

    """

    names: tuple[str, ...]
    writes: bool
    per_head: bool


def stage_name(pp_rank: int) -> str:
    """The shard name of a pipeline stage's replicated KV."""
    return f"pp{pp_rank}"


def head_name(pp_rank: int, head: int) -> str:
    """The shard name of one KV head of a pipeline stage."""
    return f"pp{pp_rank}-h{head}"


def shard_names(vllm_config: Any) -> list[str]:
    """Every value one block has in the shared store (it is a hit only where all are
    there)."""
    sharding = kv_sharding(vllm_config)
    stages = range(vllm_config.parallel_config.pipeline_parallel_size)
    if sharding == REPLICATED:
        return [stage_name(pp) for pp in stages]
    if sharding == HEADS:
        heads = total_kv_heads(vllm_config)
        return [head_name(pp, h) for pp in stages for h in range(heads)]
    return worker_names(vllm_config)


def worker_shards(vllm_config: Any, tp_rank: int, pp_rank: int) -> WorkerShards:
    """The values the worker of these ranks reads and writes (see the module
    docstring)."""
    sharding = kv_sharding(vllm_config)
    if sharding == REPLICATED:
        return WorkerShards((stage_name(pp_rank),), tp_rank == 0, per_head=False)
    if sharding != HEADS:
        return WorkerShards((rank_name(tp_rank, pp_rank),), True, per_head=False)
    heads = total_kv_heads(vllm_config)
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if tp <= heads:
        per_rank = heads // tp
        first, writes = tp_rank * per_rank, True
    else:
        per_rank, replicas = 1, tp // heads
        first, writes = tp_rank // replicas, tp_rank % replicas == 0
    names = tuple(head_name(pp_rank, h) for h in range(first, first + per_rank))
    return WorkerShards(names, writes, per_head=True)
