"""Counters of the host tier kept by the scheduler half, read by the metrics layer."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TierStats:
    """Monotonic counters since start; `block_bytes` is one block over all layers."""

    block_bytes: int
    lookup_tokens: int = 0
    hit_tokens: int = 0
    loaded_blocks: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    preempted_requests: int = 0
    # Of hit_tokens, those loaded across steps (`async_load_tokens`, and the host part
    # of a shared-store hit).
    async_hit_tokens: int = 0
    # With a shared store: tokens past the host hit asked of it, tokens it served,
    # blocks fetched into host memory and blocks that did not arrive.
    remote_lookup_tokens: int = 0
    remote_hit_tokens: int = 0
    remote_fetched_blocks: int = 0
    remote_missed_blocks: int = 0
    remote_lookup_failures: int = 0
    # Requests' `retain` hints: blocks kept from eviction now; retained blocks a later
    # request read (hits), counted once per retain; retains whose time passed unread.
    retained_blocks: int = 0
    retained_hit_blocks: int = 0
    retains_expired_unread: int = 0
    # Device blocks stored / loaded per KV cache group (vLLM's hybrid
    # manager has several).
    stored_by_group: Counter[int] = field(default_factory=Counter)
    loaded_by_group: Counter[int] = field(default_factory=Counter)

    @property
    def loaded_bytes(self) -> int:
        return self.loaded_blocks * self.block_bytes

    @property
    def stored_bytes(self) -> int:
        return self.stored_blocks * self.block_bytes
