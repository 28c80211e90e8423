"""Host-tier eviction policies: the interface, LRU, and the registry by name.

The other built-ins (`prefix_aware`, `arc`, `lirs`, `s3fifo`) are each a module of their
own and one line of the registry (`registry.BUILTIN_POLICIES`), imported only when a
tier asks for them by name: taking one away is removing its module and its line.
"""

from __future__ import annotations

from .base import BlockKey, BlockList, BlockState, EvictionPolicy, HostBlock
from .lru import LRUPolicy
from .registry import (
    BUILTIN_POLICIES,
    ENTRY_POINT_GROUP,
    available_policy_names,
    resolve_policy,
)

POLICY_NAMES: tuple[str, ...] = tuple(BUILTIN_POLICIES)


def make_policy(name: str, num_blocks: int) -> EvictionPolicy:
    """Builds the policy `name` (a built-in, an entry point or an import path) for a
    pool of `num_blocks` blocks.

    Raises:
        OffloadConfigError: `name` names no usable policy; the message says what to fix.

    """
    return resolve_policy(name)(num_blocks)


__all__ = [
    "BUILTIN_POLICIES",
    "ENTRY_POINT_GROUP",
    "POLICY_NAMES",
    "BlockKey",
    "BlockList",
    "BlockState",
    "EvictionPolicy",
    "HostBlock",
    "LRUPolicy",
    "available_policy_names",
    "make_policy",
    "resolve_policy",
]
