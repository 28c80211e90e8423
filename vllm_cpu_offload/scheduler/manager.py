"""`HostTierManager`: what the scheduler half asks of the medium its host blocks live
on, and nothing more: lookups, the two halves of a load and of a store, events, sizes.

`HostBlockPool` (host memory, optionally backed by files) is the one medium today. A
medium that stores host blocks in another form (compressed, or in an object store)
implements this seam and the scheduler half is unchanged; the shared store sits
beside it (`shared_tier.py`), not behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState, PoolEvent


class HostTierManager(Protocol):
    """See the module docstring; `HostBlockPool` documents each call."""

    # ---- lookups ----

    def __contains__(self, key: BlockKey) -> bool: ...

    def state_of(self, key: BlockKey) -> BlockState | None: ...

    def count_hits(self, keys: Sequence[BlockKey], *, use: bool = True) -> int: ...

    def touch(self, keys: Sequence[BlockKey], *, by_device: bool = False) -> None: ...

    def demote(self, keys: Sequence[BlockKey]) -> None: ...

    # ---- loads: pinned from the plan until every worker reported ----

    def pin(self, keys: Sequence[BlockKey]) -> list[int]: ...

    def unpin(self, keys: Sequence[BlockKey]) -> None: ...

    # ---- stores: allocated STORING, then visible or freed ----

    def allocate_for_store(
        self, keys: Sequence[BlockKey], parent: BlockKey | None
    ) -> list[tuple[BlockKey, int]]: ...

    def complete_store(
        self, keys: Sequence[BlockKey], success: bool, detail: object = None
    ) -> None: ...

    # ---- the rest ----

    def take_events(self) -> list[PoolEvent]: ...

    def reset(self) -> int: ...

    # ---- sizes: usage, and what a quiesced tier holds (no pin, no store) ----

    @property
    def usage(self) -> float: ...

    def __len__(self) -> int: ...

    @property
    def num_used(self) -> int: ...

    @property
    def num_pinned(self) -> int: ...

    @property
    def num_storing(self) -> int: ...
