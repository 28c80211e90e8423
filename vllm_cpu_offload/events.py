"""KV cache events for the host tier: `BlockStored` / `BlockRemoved` with medium CPU.

A store's event carries what vLLM's device-tier event for the same blocks carries
(parent hash, token ids, block size, LoRA adapter, extra keys, KV cache group), from the
`StoredBlocks` the scheduler half recorded when it planned the store. Events without
that record (a pool driven directly, as in unit tests) name the blocks only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import groupby
from typing import Any, cast

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from vllm_cpu_offload.scheduler.block_pool import PoolEvent
from vllm_cpu_offload.scheduler.stored_blocks import StoredBlocks


def _external(block_hash: Any) -> Any:
    return maybe_convert_block_hash(BlockHash(block_hash))


def to_kv_events(
    events: Iterable[PoolEvent], block_size: int
) -> Iterator[KVCacheEvent]:
    """The vLLM KV events for the pool's events, in order; keys are (KV group id,
    block hash).

    One event per KV cache group (and, for stores, per run of consecutive blocks).
    """
    for event in events:
        if event.kind == "stored" and event.detail is not None:
            for run in cast(Sequence[StoredBlocks], event.detail):
                yield _stored(run, block_size)
            continue
        keys = cast(tuple[tuple[int, bytes], ...], event.keys)
        for group, group_keys in groupby(keys, key=lambda key: key[0]):
            hashes = [_external(block_hash) for _, block_hash in group_keys]
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
                yield BlockRemoved(
                    block_hashes=hashes, medium=MEDIUM_CPU, group_idx=group
                )


def _stored(run: StoredBlocks, block_size: int) -> BlockStored:
    parent = run.parent_block_hash
    return BlockStored(
        block_hashes=[_external(h) for h in run.block_hashes],
        parent_block_hash=_external(parent) if parent is not None else None,
        token_ids=run.token_ids,
        block_size=block_size,
        lora_id=run.lora_id,
        medium=MEDIUM_CPU,
        lora_name=run.lora_name,
        extra_keys=run.extra_keys,
        group_idx=run.group_id,
        session_id=run.session_id,
    )
