"""KV cache events for the tiers behind the device: `BlockStored` / `BlockRemoved`.

The host tier's events have medium CPU. The shared store's (`--swap-space-remote`) have
medium STORAGE and locality REMOTE, as vLLM's own secondary offloading tiers say it: a
block is stored there once every worker wrote its shard, and removed when a fetch found
it missing or refused. The store evicts on its own and tells no one, so a consumer
should read its stored blocks as likely there, not certainly.

A store's event carries what vLLM's device-tier event for the same blocks carries
(parent hash, token ids, block size, LoRA adapter, extra keys, KV cache group), from the
`StoredBlocks` the scheduler half recorded when it planned the store. Events without
that record (a pool driven directly, as in unit tests, or a write-through that stored
only some of a job's blocks) name the blocks only.

A layer of the tier (`layers.py`), wanted while vLLM's KV cache events are on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import groupby
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from vllm_cpu_offload.layers import TierLayer
from vllm_cpu_offload.scheduler.block_pool import BlockKey, PoolEvent
from vllm_cpu_offload.scheduler.stored_blocks import StoredBlocks
from vllm_cpu_offload.scheduler.tier_seams import RemoteTierEvent

if TYPE_CHECKING:
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler
    from vllm_cpu_offload.spec import OffloadSpec

# Where the shared store is, relative to the engine that publishes its events.
LOCALITY_REMOTE = "REMOTE"


def _external(block_hash: Any) -> Any:
    return maybe_convert_block_hash(BlockHash(block_hash))


def to_kv_events(
    events: Iterable[PoolEvent], block_size: int
) -> Iterator[KVCacheEvent]:
    """The vLLM KV events for the host pool's events, in order; keys are (KV group id,
    block hash).

    One event per KV cache group (and, for stores, per run of consecutive blocks).
    """
    return _kv_events(events, block_size, MEDIUM_CPU, None)


def remote_kv_events(
    events: Iterable[RemoteTierEvent], block_size: int
) -> Iterator[KVCacheEvent]:
    """The vLLM KV events for the shared store's events, in order."""
    return _kv_events(events, block_size, MEDIUM_STORAGE, LOCALITY_REMOTE)


def _kv_events(
    events: Iterable[PoolEvent | RemoteTierEvent],
    block_size: int,
    medium: str,
    locality: str | None,
) -> Iterator[KVCacheEvent]:
    """A tier's events: "stored" ones as `BlockStored` (with their record when there
    is one), any other kind as `BlockRemoved`."""
    for event in events:
        if event.kind == "stored" and event.detail is not None:
            for run in cast(Sequence[StoredBlocks], event.detail):
                yield _stored(run, block_size, medium, locality)
        else:
            yield from _named_only(
                event.kind == "stored", event.keys, block_size, medium, locality
            )


def _named_only(
    stored: bool,
    keys: Sequence[BlockKey],
    block_size: int,
    medium: str,
    locality: str | None,
) -> Iterator[KVCacheEvent]:
    """Events that name the blocks only, one per KV cache group."""
    pairs = cast(Sequence[tuple[int, bytes]], keys)
    for group, group_keys in groupby(pairs, key=lambda key: key[0]):
        hashes = [_external(block_hash) for _, block_hash in group_keys]
        if stored:
            yield BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=[],
                block_size=block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                group_idx=group,
                locality=locality,
            )
        else:
            yield BlockRemoved(
                block_hashes=hashes, medium=medium, group_idx=group, locality=locality
            )


def _stored(
    run: StoredBlocks, block_size: int, medium: str, locality: str | None
) -> BlockStored:
    parent = run.parent_block_hash
    return BlockStored(
        block_hashes=[_external(h) for h in run.block_hashes],
        parent_block_hash=_external(parent) if parent is not None else None,
        token_ids=run.token_ids,
        block_size=block_size,
        lora_id=run.lora_id,
        medium=medium,
        lora_name=run.lora_name,
        extra_keys=run.extra_keys,
        group_idx=run.group_id,
        session_id=run.session_id,
        locality=locality,
    )


class EventsLayer(TierLayer):
    """Publishes the host tier's and the shared store's blocks as KV cache events."""

    @classmethod
    def wanted(cls, spec: OffloadSpec) -> bool:
        return spec.publish_events

    def kv_events(
        self, scheduler: HostTierScheduler, pool_events: list[PoolEvent]
    ) -> list[KVCacheEvent]:
        block_size = scheduler.block_size * scheduler.blocks_per_host_block
        return [
            *to_kv_events(pool_events, block_size),
            *remote_kv_events(scheduler.take_remote_events(), block_size),
        ]


layer = EventsLayer
