"""An eviction policy written outside the connector's code, as a user would write one.

First in, first out: blocks leave in the order their stores finished, whatever their
use.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_cpu_offload.scheduler.policies import BlockList, EvictionPolicy, HostBlock


class FIFOPolicy(EvictionPolicy):
    """Evicts the evictable block whose store finished first; uses change nothing."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.queue = BlockList()
        self.accesses = 0  # for tests: the pool reported lookups to this policy

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        pass

    def on_ready(self, blocks: Sequence[HostBlock]) -> None:
        # Deepest first: the chain's root ends up first in the queue.
        for block in reversed(blocks):
            self.queue.append(block)

    def on_access(self, blocks: Sequence[HostBlock]) -> None:
        self.accesses += len(blocks)

    def on_pin(self, block: HostBlock) -> None:
        self.queue.remove(block)

    def on_unpin(self, block: HostBlock) -> None:
        self.queue.appendleft(block)  # keeps its age, roughly: next in line again

    def on_remove(self, block: HostBlock) -> None:
        if block.owner is self.queue:
            self.queue.remove(block)

    def pop_victim(self) -> HostBlock | None:
        return self.queue.popleft()


class HalfWrittenPolicy(EvictionPolicy):
    """Forgets most hooks: refused before start."""

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        pass


class NotAPolicy:
    """Has the right name and nothing else."""
