"""Which offload key comes before which, learnt from what one request shows a vLLM
`CachePolicy`.

vLLM's policy interface names keys, never a key's parent. What it does give is the
request a call serves (`ReqContext`), and the request knows each of its keys' end-token
position (`get_offload_key_position`): the keys of one KV cache group, sorted by
position, are a chain, each the prefix of the next. So a key's parent is the key this
request showed just before it, at a lower position, in the same group.

`RequestChains` keeps that per request, in the request's own scratch space
(`ReqContext.set_state`): for each group the deepest key seen so far, and for each key
seen after it the key seen before it. A key seen out of order (a sliding-window group's
back-fill) or without a position gets no parent. When the request skipped keys (a
sliding-window gap, a block vLLM never offered) the parent found is the nearest key it
did show, an ancestor: still one that every hit of the child needs.

O(1) per key observed; memory O(keys observed) per live request, freed with the
request. `forget_all` drops every request's record at once (a cache reset), in O(1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, get_offload_group_idx


@dataclass(slots=True)
class _RequestChain:
    """One request's keys as one policy saw them."""

    owner: object
    generation: int
    # KV cache group -> (position, key) of the deepest key seen so far.
    tails: dict[int, tuple[int, OffloadKey]] = field(default_factory=dict)
    # key -> the key seen just before it in its group.
    parents: dict[OffloadKey, OffloadKey] = field(default_factory=dict)


class RequestChains:
    """The parents of offload keys, per request; see the module docstring."""

    def __init__(self) -> None:
        self._generation = 0

    def observe(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """The request shows `keys` (in its order). O(1) per key."""
        chain = self._chain(req_context)
        tails, parents = chain.tails, chain.parents
        position_of = req_context.get_offload_key_position
        for key in keys:
            position = position_of(key)
            if position is None:
                continue
            group = get_offload_group_idx(key)
            tail = tails.get(group)
            if tail is None:
                tails[group] = (position, key)
            elif position > tail[0]:
                parents[key] = tail[1]
                tails[group] = (position, key)

    def parent_of(self, key: OffloadKey, req_context: ReqContext) -> OffloadKey | None:
        """The key the request showed just before `key`, if any. O(1)."""
        chain = req_context.get_state(_RequestChain)
        if chain is None or not self._owns(chain):
            return None
        return chain.parents.get(key)

    def forget_all(self) -> None:
        """Drops what every request showed (their records go stale). O(1)."""
        self._generation += 1

    def _owns(self, chain: _RequestChain) -> bool:
        return chain.owner is self and chain.generation == self._generation

    def _chain(self, req_context: ReqContext) -> _RequestChain:
        chain = req_context.get_state(_RequestChain)
        if chain is None or not self._owns(chain):
            chain = _RequestChain(owner=self, generation=self._generation)
            req_context.set_state(chain)
        return chain
