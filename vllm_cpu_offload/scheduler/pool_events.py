"""What the host block pool tells others: events of keys that became visible or left,
and what a persisted index hears."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from .policies.base import BlockKey


@dataclass(frozen=True, slots=True)
class PoolEvent:
    """Keys that became visible ("stored") or left the pool ("evicted"), in order.

    `detail` is what the caller of `complete_store` passed along for the event,
    untouched.
    """

    kind: Literal["stored", "evicted"]
    keys: tuple[BlockKey, ...]
    detail: object = None


class PersistenceListener(Protocol):
    """What a persisted index (persist/block_index.py) hears of the pool: blocks that
    became visible, in chain order, and blocks about to be reused."""

    def record(
        self, entries: Sequence[tuple[int, BlockKey, BlockKey | None]]
    ) -> None: ...

    def clear(self, host_id: int) -> None: ...
