"""Host-tier eviction policies: the interface and LRU.

The registry (`registry.py`: `make_policy`, policies by name) and the other built-ins
(`prefix_aware` among them) are modules of their own; each built-in is one line of the
registry (`registry.BUILTIN_POLICIES`), imported only when a tier asks for it by name:
taking one away is removing its module and its line.
"""

from __future__ import annotations

from .base import BlockKey, BlockList, BlockState, EvictionPolicy, HostBlock
from .lru import LRUPolicy

__all__ = [
    "BlockKey",
    "BlockList",
    "BlockState",
    "EvictionPolicy",
    "HostBlock",
    "LRUPolicy",
]
