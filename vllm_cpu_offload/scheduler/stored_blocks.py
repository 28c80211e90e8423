"""What a KV event tells about blocks the host tier stored, as vLLM's device tier tells
it.

Recorded by the scheduler half when it plans a store (only while KV events are on) and
published once the store has finished, so a `BlockStored` event of the host tier carries
what vLLM's own device-tier event for the same blocks carries: the parent block hash,
the token ids, the LoRA adapter and the extra keys of the block hashes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """A run of consecutive blocks of one request and one KV cache group."""

    group_id: int
    block_hashes: tuple[Any, ...]
    parent_block_hash: Any | None  # the block before the run; None at the root
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None
    session_id: str | None


def stored_runs(
    request: Request, group_id: int, indices: list[int], block_size: int, k: int = 1
) -> list[StoredBlocks]:
    """One record per run of consecutive host block indices (ascending) of `request`.

    A host block holds `k` device blocks of `block_size` tokens and is named by the hash
    of its last one; its event reports a block of `k * block_size` tokens.
    """
    # vLLM on use only: the scheduler's unit tests and benchmarks run without it.
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        to_event_extra_keys,
    )

    hashes = request.block_hashes
    tokens = request.all_token_ids
    lora = request.lora_request
    runs: list[StoredBlocks] = []
    start = 0
    while start < len(indices):
        end = start + 1
        while end < len(indices) and indices[end] == indices[end - 1] + 1:
            end += 1
        first, last = indices[start], indices[end - 1] + 1
        size = k * block_size
        extra, mm_index = [], 0
        for i in range(first, last):
            keys, mm_index = generate_block_hash_extra_keys(
                request, i * size, (i + 1) * size, mm_index
            )
            extra.append(keys)
        runs.append(
            StoredBlocks(
                group_id=group_id,
                block_hashes=tuple(hashes[i * k + k - 1] for i in range(first, last)),
                parent_block_hash=hashes[first * k - 1] if first > 0 else None,
                token_ids=list(tokens[first * size : last * size]),
                lora_id=lora.adapter_id if lora else None,
                lora_name=lora.name if lora else None,
                extra_keys=to_event_extra_keys(extra),
                session_id=getattr(request, "session_id", None),
            )
        )
        start = end
    return runs
