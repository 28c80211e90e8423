"""What the scheduler half remembers per request and per job in flight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from vllm_cpu_offload.scheduler.block_pool import BlockKey
from vllm_cpu_offload.scheduler.stored_blocks import StoredBlocks
from vllm_cpu_offload.scheduler.tier_seams import NO_HINTS, RequestHints

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class JobInFlight:
    """What the scheduler half settles when every worker has reported a job: the keys
    to unpin (load) or to make visible or free (store)."""

    kind: Literal["load", "store", "async"]
    req_id: str
    # load, async: the host blocks to unpin; store: the blocks to make visible or free
    keys: list[BlockKey]
    stored: list[StoredBlocks] | None = None  # for KV events, when they are on
    # async: the host blocks the workers fill from the shared store, in order
    fetched: list[BlockKey] = field(default_factory=list)
    # Some worker reported it failed.
    failed: bool = False


@dataclass
class RequestState:
    request: Request
    # What its client said of its KV (`kv_transfer_params`).
    hints: RequestHints = NO_HINTS
    # Blocks [0, planned_upto) were stored, are being stored, or were skipped.
    planned_upto: int = 0
    # (first block, blocks) of the last lookup, for the load plan after allocation.
    lookup: tuple[int, int] = (0, 0)
    # Of that lookup, with a shared store: (first host block, host blocks) it holds
    # past the host hit. The hit then loads asynchronously, across steps.
    remote_hit: tuple[int, int] | None = None
    # The last question to the store: (first, end host block) -> its answer.
    remote_asked: tuple[int, int, int] | None = None
    # With several KV cache groups: (first, end host block) -> the keys of every
    # group's blocks there that the store held.
    remote_held: tuple[int, int, frozenset[BlockKey]] | None = None
    # The last lookup's hit is in host memory alone and large enough to load across
    # steps (`async_load_tokens`).
    async_host: bool = False
    # A fetch of this request came back short: vLLM recomputes, and the store is not
    # asked for it again (a store that lists blocks it cannot serve would otherwise
    # send the request round and round).
    remote_failed: bool = False
    # A load across steps of this request failed in its copy: vLLM recomputes, from
    # the device hit on (a copy that fails again would send the request round too).
    load_failed: bool = False
    # Store jobs in flight: the request's device blocks outlive it until they are
    # done. (An async load needs no such care: vLLM keeps the blocks of a request
    # that waits for remote KV until the workers report the load.)
    store_jobs: set[int] = field(default_factory=set)
    # The load that spans steps, while the request waits for it (vLLM's
    # WAITING_FOR_REMOTE_KVS).
    async_job: int | None = None
