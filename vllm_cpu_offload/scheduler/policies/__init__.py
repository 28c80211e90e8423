"""Host-tier eviction policies: the interface, the built-ins, and the registry by
name."""

from __future__ import annotations

from .arc import ARCPolicy
from .base import BlockKey, BlockList, BlockState, EvictionPolicy, HostBlock
from .lirs import LIRSPolicy
from .lru import LRUPolicy
from .prefix_aware import PrefixAwarePolicy
from .registry import (
    BUILTIN_POLICIES,
    ENTRY_POINT_GROUP,
    available_policy_names,
    resolve_policy,
)
from .s3fifo import S3FIFOPolicy

POLICY_NAMES: tuple[str, ...] = tuple(BUILTIN_POLICIES)


def make_policy(name: str, num_blocks: int) -> EvictionPolicy:
    """Builds the policy `name` (a built-in, an entry point or an import path) for a
    pool of `num_blocks` blocks.

    Raises:
        OffloadConfigError: `name` names no usable policy; the message says what to fix.

    """
    return resolve_policy(name)(num_blocks)


__all__ = [
    "ARCPolicy",
    "BUILTIN_POLICIES",
    "ENTRY_POINT_GROUP",
    "POLICY_NAMES",
    "BlockKey",
    "BlockList",
    "BlockState",
    "EvictionPolicy",
    "HostBlock",
    "LIRSPolicy",
    "LRUPolicy",
    "PrefixAwarePolicy",
    "S3FIFOPolicy",
    "available_policy_names",
    "make_policy",
    "resolve_policy",
]
