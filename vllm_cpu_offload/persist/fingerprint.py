"""What a persisted tier's blocks mean, so that a new engine serves only blocks it can
use.

Keys are vLLM's block hashes. They come from the tokens, the extra keys (LoRA,
multimodal inputs, `cache_salt`) and the parent's hash, rooted at `NONE_HASH`. vLLM
derives `NONE_HASH` from a fixed seed for sha256 and sha256_cbor, and from
PYTHONHASHSEED when it is set; for xxhash without PYTHONHASHSEED the seed is random per
process, and such keys would mean nothing after a restart: that combination is refused.
The fingerprint then pins everything else a block's bytes depend on: model and weights,
dtypes, block and KV layout, the worker's place in tensor and pipeline parallelism, the
vLLM release and the hash that keys them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_cpu_offload.errors import OffloadConfigError

# vLLM's non-cryptographic prefix-caching hashes: a random per-process NONE_HASH seed
# unless PYTHONHASHSEED is set.
_PER_PROCESS_SEEDED = ("xxhash", "xxhash_cbor")
# vLLM's seed for the cryptographic hashes when PYTHONHASHSEED is not set.
_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def check_stable_block_hashes(hash_algo: str, flag: str) -> None:
    """Refuses a prefix-caching hash whose keys change from one process to the next
    (`flag` needs them stable)."""
    if hash_algo in _PER_PROCESS_SEEDED and os.getenv("PYTHONHASHSEED") is None:
        raise OffloadConfigError(
            f"{flag} needs block hashes that are the same in every process, "
            f"but --prefix-caching-hash-algo {hash_algo} seeds them at random per "
            "process; use sha256 or sha256_cbor, or set PYTHONHASHSEED"
        )


def _seed_digest() -> str:
    # The seed itself stays out of the files: only whether two engines share it.
    seed = os.getenv("PYTHONHASHSEED", _DEFAULT_NONE_HASH_SEED)
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


def _weights_digest(model: str) -> str:
    """Names, sizes and modification times of a local model directory's files: a
    checkpoint replaced in place changes it. A hub name is pinned by its name and
    revision instead."""
    directory = Path(model)
    if not directory.is_dir():
        return ""
    h = hashlib.sha256()
    for f in sorted(directory.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def tier_fingerprint(
    vllm_config: Any,
    groups: Sequence[object],
    num_host_blocks: int,
    blocks_per_host_block: int,
) -> dict[str, Any]:
    """The configuration a tier's index and data files were written for (JSON
    values)."""
    # vLLM on use only, here and below: the flags check directories before it loads.
    import vllm

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    return {
        "vllm": vllm.__version__.split("+")[0],
        "model": str(model.model),
        "revision": str(model.revision),
        "weights": _weights_digest(str(model.model)),
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": int(cache.block_size),
        "blocks_per_host_block": blocks_per_host_block,
        "kv_cache_groups": [repr(g) for g in groups],
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
        "pipeline_parallel_size": int(parallel.pipeline_parallel_size),
        "hash_algo": str(cache.prefix_caching_hash_algo),
        "hash_seed": _seed_digest(),
        "num_host_blocks": num_host_blocks,
    }


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


def this_worker_name() -> str:
    """The calling worker's name (its tensor and pipeline parallel ranks)."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized():
        return rank_name(0, 0)  # a worker outside vLLM's process groups is alone
    return rank_name(get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)


def differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The fields two fingerprints disagree on, for a one-line message."""
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:4]) + (
        ", ..." if len(keys) > 4 else ""
    )
