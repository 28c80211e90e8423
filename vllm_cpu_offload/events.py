"""KV cache events for the host tier: `BlockStored` / `BlockRemoved` with medium CPU."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import cast

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from vllm_cpu_offload.scheduler.block_pool import PoolEvent


def to_kv_events(events: Iterable[PoolEvent], block_size: int) -> Iterator[KVCacheEvent]:
    """One vLLM event per pool event, in order; keys are (KV group id, block hash)."""
    for event in events:
        keys = cast(tuple[tuple[int, bytes], ...], event.keys)
        hashes = [maybe_convert_block_hash(BlockHash(block_hash)) for _, block_hash in keys]
        group = keys[0][0] if keys else None
        if event.kind == "stored":
            yield BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=[],
                block_size=block_size,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
                group_idx=group,
            )
        else:
            yield BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU, group_idx=group)
