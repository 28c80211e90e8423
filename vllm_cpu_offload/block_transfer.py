"""One transfer job, the same object from the scheduler half to the copiers.

The scheduler half plans it, the step's metadata carries it to every worker, the
transfer engine validates it and hands its ids to a copier. Imports nothing, so the
worker's transfer engine runs where vLLM is not installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockTransfer:
    """Copy `device_block_ids[i]` <-> `host_block_ids[i]` for every layer.

    Attributes:
        job_id: unique per connector; workers report jobs by it.
        device_block_ids: device KV cache block ids (a list, or an int64 tensor).
        host_block_ids: host buffer block ids, one per device block.
        req_id: the request the job belongs to ("" where no request is involved).

    """

    job_id: int
    device_block_ids: Sequence[int]
    host_block_ids: Sequence[int]
    req_id: str = ""


@dataclass(frozen=True)
class RemoteBlocks:
    """Host blocks `host_blocks[i]` <-> the shared store's `keys[i]` (the rank-free
    part of each key: every worker adds its own rank)."""

    job_id: int
    keys: Sequence[str]
    host_blocks: Sequence[int]
    # Written before the writes queued earlier: its client said it will read the
    # prefix again (`retain`), maybe on another engine.
    first: bool = False


@dataclass(frozen=True)
class AsyncLoad:
    """A hit that spans steps: some of its blocks are fetched from the shared store
    into host memory first, then every block of the hit is loaded.

    Attributes:
        load: every (device block, host slot) pair of the hit, those already in host
            memory first, then those of the fetched host blocks in order.
        fetch: the host blocks to fill from the store (`fetch.job_id == load.job_id`).
        fetched_from: the index in `load`'s pairs where the fetched blocks' pairs start;
            a pair from there on is loaded only if its host block and every fetched
            one before it arrived.
        unloadable: device blocks of the hit that got no host block; vLLM recomputes
            them.
        whole: the hit loads whole or not at all (several KV cache groups: vLLM's
            hybrid manager takes no load error of single blocks). A fetched block that
            did not arrive, or any unloadable block, fails the load: nothing is
            loaded, and vLLM recomputes the request.

    """

    load: BlockTransfer
    fetch: RemoteBlocks
    fetched_from: int
    unloadable: Sequence[int] = ()
    whole: bool = False
