"""Host-tier eviction policies, chosen by name."""

from __future__ import annotations

from .base import BlockKey, BlockList, BlockState, EvictionPolicy, HostBlock
from .lru import LRUPolicy
from .prefix_aware import PrefixAwarePolicy

_POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    PrefixAwarePolicy.name: PrefixAwarePolicy,
}

POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str, num_blocks: int) -> EvictionPolicy:
    """Builds the policy registered as `name` for a pool of `num_blocks` blocks.

    Raises:
        ValueError: `name` is not a registered policy; the message lists the allowed names.
    """
    try:
        policy_cls = _POLICIES[name]
    except KeyError:
        allowed = ", ".join(repr(n) for n in POLICY_NAMES)
        raise ValueError(f"unknown eviction policy {name!r}; allowed: {allowed}") from None
    return policy_cls(num_blocks)


__all__ = [
    "POLICY_NAMES",
    "BlockKey",
    "BlockList",
    "BlockState",
    "EvictionPolicy",
    "HostBlock",
    "LRUPolicy",
    "PrefixAwarePolicy",
    "make_policy",
]
