"""Context parallelism, which the host tier refuses.

vLLM's decode and prefill context parallelism spread a block's tokens over ranks, and
vLLM hashes blocks of `block_size` times the decode size: the tier would need to store
and key a block's token shards, which no platform this package is tested on runs
(vLLM's CPU attention backends cannot return the softmax statistics decode context
parallelism needs, and its CPU model runner refuses prefill context parallelism). It
is refused before the engine starts, never run wrong.
"""

from __future__ import annotations

from typing import Any

from vllm_cpu_offload.errors import OffloadConfigError


def context_parallel_sizes(vllm_config: Any) -> tuple[int, int]:
    """The prefill and decode context-parallel sizes (1 where vLLM has none)."""
    parallel = vllm_config.parallel_config
    return (
        int(getattr(parallel, "prefill_context_parallel_size", 1)),
        int(getattr(parallel, "decode_context_parallel_size", 1)),
    )


def check_context_parallelism(prefill: int, decode: int) -> None:
    """Refuses context parallelism (see the module docstring) in one line."""
    for size, flag in (
        (decode, "--decode-context-parallel-size"),
        (prefill, "--prefill-context-parallel-size"),
    ):
        if size > 1:
            raise OffloadConfigError(
                f"--enable-cpu-offload does not support context parallelism "
                f"({flag} {size}): each rank caches its own share of a block's "
                f"tokens, which the host tier does not store; use {flag} 1 or drop "
                "--enable-cpu-offload"
            )
