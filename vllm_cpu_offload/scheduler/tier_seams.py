"""The seams of the scheduler half, and what fills each where no layer plugs in.

`HostTierScheduler` is the host tier alone. Three seams let a layer (`layers.py`)
extend it without the scheduler knowing the layer:

- `shared`, a tier beyond host memory that lookups reach past the host hit, loads
  fetch from and stores write through to (`scheduler/shared_tier.py`). `NoSharedTier`
  is the seam without one: nothing to ask, fetch or write, and a store's blocks settle
  when the copy does.
- `retention`, blocks kept from eviction for clients that will read them again
  (`scheduler/retention.py`). `NoRetention` keeps none.
- `read_hints`, what a client says of a request's KV (`scheduler/request_hints.py`).
  `no_hints` reads nothing: every request is served as if hints did not exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from vllm_cpu_offload.block_transfer import BlockTransfer, RemoteBlocks
from vllm_cpu_offload.scheduler.block_pool import BlockKey
from vllm_cpu_offload.scheduler.manager import HostTierManager
from vllm_cpu_offload.scheduler.stored_blocks import StoredBlocks


@dataclass(frozen=True)
class RemoteTierEvent:
    """Blocks the shared store holds now ("stored": every worker wrote its shard), or
    blocks it listed and did not serve ("missing"), in order; for KV events."""

    kind: Literal["stored", "missing"]
    keys: tuple[BlockKey, ...]
    # "stored", when every block of a store job was written: what its events say
    detail: list[StoredBlocks] | None = None


class NoSharedTier:
    """No store: lookups find nothing, loads fetch nothing, stores write nothing."""

    def __init__(self, pool: HostTierManager) -> None:
        self.pool = pool

    @property
    def num_held_writes(self) -> int:
        """Store jobs whose blocks wait for write-throughs (tests, quiescence)."""
        return 0

    def hits(self, keys: Iterable[BlockKey]) -> int:
        return 0

    def held(self, keys: Iterable[BlockKey]) -> frozenset[BlockKey]:
        return frozenset()

    def fetch(
        self, job_id: int, keys: list[BlockKey], host_blocks: list[int]
    ) -> RemoteBlocks:
        return RemoteBlocks(job_id, [], [])

    def fetch_reported(
        self, job_id: int, fetched: list[BlockKey], arrived: list[bool], reports: int
    ) -> tuple[list[BlockKey], list[BlockKey]] | None:
        return None

    def fetch_abandoned(self, job_id: int, fetched: list[BlockKey]) -> None:
        self.pool.complete_store(fetched, False)

    def write_through(
        self, store: BlockTransfer, keys: list[BlockKey], *, first: bool = False
    ) -> list[RemoteBlocks]:
        return []

    def store_completed(
        self,
        job_id: int,
        keys: list[BlockKey],
        stored: list[StoredBlocks] | None,
        success: bool,
    ) -> None:
        self.pool.complete_store(keys, success, stored)

    def write_reported(
        self, job_id: int, count: int, stored: list[bool] | None
    ) -> None:
        pass

    def take_events(self) -> list[RemoteTierEvent]:
        return []

    def close(self) -> None:
        pass


class NoRetention:
    """Keeps no block from eviction: no budget, so no retain is ever asked for."""

    budget = 0

    @property
    def num_pinned(self) -> int:
        return 0

    @property
    def num_blocks(self) -> int:
        return 0

    def retain(self, keys: Sequence[BlockKey], tenant: Any, seconds: float) -> None:
        pass

    def stored(self, keys: Sequence[BlockKey], success: bool) -> None:
        pass

    def read(self, keys: Sequence[BlockKey]) -> None:
        pass

    def forget(self, keys: Sequence[BlockKey]) -> None:
        pass

    def expire(self) -> None:
        pass

    def release_all(self) -> None:
        pass


@dataclass(frozen=True)
class RequestHints:
    """A request's hints; every field None or False where the client said nothing."""

    max_offload_tokens: int | None = None
    # Seconds to keep the request's blocks from eviction once it finishes.
    retain_s: float | None = None
    done: bool = False

    @property
    def any(self) -> bool:
        return self != NO_HINTS


NO_HINTS = RequestHints()


def no_hints(request: Any) -> RequestHints:
    """The hints of a tier that reads none."""
    return NO_HINTS
