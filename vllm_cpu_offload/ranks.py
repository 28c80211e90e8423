"""An engine's workers: their names, and the calling worker's ranks.

A worker is named by its (tensor, pipeline) parallel ranks, `tp{t}-pp{p}`: the file
tier keeps a file per name, and the shared store a value per name where a block's KV
differs per rank.
"""

from __future__ import annotations

from typing import Any


def worker_names(vllm_config: Any) -> list[str]:
    """Every worker's name in the tier directory, in rank order."""
    parallel = vllm_config.parallel_config
    return [
        rank_name(tp, pp)
        for pp in range(parallel.pipeline_parallel_size)
        for tp in range(parallel.tensor_parallel_size)
    ]


def rank_name(tp_rank: int, pp_rank: int) -> str:
    return f"tp{tp_rank}-pp{pp_rank}"


def this_ranks() -> tuple[int, int]:
    """The calling worker's (tensor, pipeline) parallel ranks; (0, 0) for a worker
    outside vLLM's process groups, which is alone."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized():
        return 0, 0
    return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
