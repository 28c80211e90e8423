"""The KV cache groups the host tier serves, and which of a prefix's blocks each one
needs.

vLLM's hybrid KV cache manager splits a model's attention layers into groups that share
one device block pool: a full-attention group keeps KV for every block of the context, a
sliding-window (or chunked local attention) group only for the blocks inside the window
(vLLM swaps the others for its null block). The host tier keys blocks by (group id,
block hash) and stores every block of every group once it is full, as vLLM's own prefix
cache does: a later prompt may branch off after any block, and a window group then needs
the blocks just before that point. A hit is served only where every group can: the full
groups need every block after the device hit, a window group only the blocks of the
window that ends at the hit. Those are exactly the blocks vLLM's manager for the group
allocates for external tokens, so each one gets loaded and nothing else does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_cpu_offload.errors import OffloadConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: full attention, a sliding window of `sliding_window` tokens,
    or chunked local attention over chunks of `attention_chunk` tokens."""

    group_id: int
    sliding_window: int | None = None
    attention_chunk: int | None = None

    @property
    def is_full(self) -> bool:
        return self.sliding_window is None and self.attention_chunk is None

    def first_needed_block(self, hit_blocks: int, block_size: int) -> int:
        """The first block the token after a hit of `hit_blocks` blocks attends to.

        The tokens before it are those vLLM's manager for the group skips (holds as null
        blocks) once `hit_blocks` blocks are computed; a full group needs the whole
        prefix.
        """
        computed = hit_blocks * block_size
        if self.sliding_window is not None:
            return max(0, computed - self.sliding_window + 1) // block_size
        if self.attention_chunk is not None:
            return computed // self.attention_chunk * self.attention_chunk // block_size
        return 0


FULL_ATTENTION_ONLY = (KVGroup(0),)


def kv_groups_of(
    kv_cache_config: KVCacheConfig, block_size: int
) -> tuple[KVGroup, ...]:
    """The groups of a KV cache config; refuses a kind of group the host tier cannot
    serve."""
    groups = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        served = _group_of(group_id, spec)
        if served is None:
            names = ", ".join(group.layer_names[:3])
            more = ", ..." if len(group.layer_names) > 3 else ""
            raise OffloadConfigError(
                "--enable-cpu-offload supports full, sliding-window and chunked local "
                f"attention, but KV cache group {group_id} is {kind} (layers "
                f"{names}{more}); drop --enable-cpu-offload"
            )
        if spec.block_size != block_size:
            raise OffloadConfigError(
                "--enable-cpu-offload needs every KV cache group to use the block "
                f"size {block_size}, but group {group_id} ({kind}) uses "
                f"{spec.block_size}; set --block-size {spec.block_size} or drop "
                "--enable-cpu-offload"
            )
        groups.append(served)
    return tuple(groups)


def _group_of(group_id: int, spec: Any) -> KVGroup | None:
    """The group a spec makes, or None for a kind the host tier cannot serve.

    A full-attention group (any FullAttentionSpec, e.g. MLA) is always safe: the host
    tier only serves runs of blocks it stored, and stores only blocks vLLM still holds.
    """
    # vLLM on use only: this module runs without it in the pool's unit
    # tests and benchmarks.
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = {_group_of(group_id, s) for s in spec.kv_cache_specs.values()}
        return inner.pop() if len(inner) == 1 else None
    if isinstance(spec, SlidingWindowSpec):
        # Retained trailing tokens (multi-module speculative decoding) change which
        # blocks vLLM keeps: not modelled here.
        if getattr(spec, "extra_retained_tokens", 0):
            return None
        return KVGroup(group_id, sliding_window=spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return KVGroup(group_id, attention_chunk=spec.attention_chunk_size)
    if isinstance(spec, FullAttentionSpec):
        return KVGroup(group_id)
    return None


def longest_hit(
    groups: Sequence[KVGroup],
    block_size: int,
    first: int,
    last: int,
    is_ready: Callable[[int, int], bool],
) -> int:
    """Blocks after `first` (the device hit) that every group can serve, up to `last`.

    `is_ready(group_id, block_index)` says whether the host tier holds that block. A hit
    of `n` blocks is servable when every full group holds blocks [first, first + n) and
    every windowed group holds [max(first, first_needed_block(first + n)), first + n):
    the device hit already provides what lies before `first`. One pass over the blocks,
    O(blocks x groups).
    """
    full = [g.group_id for g in groups if g.is_full]
    windowed = [g for g in groups if not g.is_full]
    # Per windowed group: the first block of its current run of held blocks.
    run_start = {g.group_id: first for g in windowed}
    best = 0
    for i in range(first, last):
        if not all(is_ready(gid, i) for gid in full):
            break
        for g in windowed:
            if not is_ready(g.group_id, i):
                run_start[g.group_id] = i + 1
        end = i + 1
        if all(
            run_start[g.group_id] <= max(first, g.first_needed_block(end, block_size))
            for g in windowed
        ):
            best = end - first
    return best


def describe(groups: Sequence[KVGroup]) -> str:
    """For logs: e.g. 'full attention, sliding window of 4096 tokens'."""
    return ", ".join(
        f"sliding window of {g.sliding_window} tokens"
        if g.sliding_window is not None
        else f"chunked local attention of {g.attention_chunk} tokens"
        if g.attention_chunk is not None
        else "full attention"
        for g in groups
    )
