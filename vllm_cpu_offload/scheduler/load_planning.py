"""The scheduler half's lookups and load plans: how much of a request's prefix the
host tier (and past it, the shared store) holds, and which host blocks load into
which device blocks once vLLM allocated them.

A mixin of `HostTierScheduler`, which owns the state named below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from vllm_cpu_offload.block_transfer import AsyncLoad, BlockTransfer
from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState
from vllm_cpu_offload.scheduler.kv_groups import KVGroup, longest_hit
from vllm_cpu_offload.scheduler.manager import HostTierManager
from vllm_cpu_offload.scheduler.request_state import JobInFlight, RequestState
from vllm_cpu_offload.scheduler.shared_tier import NoSharedTier
from vllm_cpu_offload.scheduler.tier_stats import TierStats

if TYPE_CHECKING:
    from vllm.v1.request import Request


class LoadPlanning:
    """Lookups and load plans (see the module docstring)."""

    pool: HostTierManager
    shared: NoSharedTier
    stats: TierStats
    block_size: int
    blocks_per_host_block: int
    groups: tuple[KVGroup, ...]
    async_load_tokens: int
    _single_full_group: bool
    _null_block_id: int
    _requests: dict[str, RequestState]
    _jobs: dict[int, JobInFlight]
    _next_job_id: int
    _step_loads: list[BlockTransfer]
    _step_async_loads: list[AsyncLoad]
    _last_scheduled: frozenset[str]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> int:
        """Tokens past the device hit that the host tier holds, in whole blocks."""
        state = self._state(request)
        k = self.blocks_per_host_block
        first = num_computed_tokens // self.block_size
        # A host block is looked up by its last device block's hash, so only host
        # blocks that end by `last` count. At least one token must be computed to
        # sample from: with full attention alone a hit may cover the prompt's last
        # block but one token, whose KV the forward writes again; with other groups
        # (a state-space group's state cannot take a token twice) it ends a block
        # earlier.
        end_token = (
            request.num_tokens if self._single_full_group else (request.num_tokens - 1)
        )
        last = min(len(request.block_hashes), end_token // self.block_size)
        first_hb, last_hb = first // k, last // k
        hits = 0
        state.remote_hit = None
        if last_hb > first_hb:
            hashes = request.block_hashes
            if self._single_full_group:
                hbs = self.pool.count_hits(self._keys(0, hashes, first_hb, last_hb))
            else:
                hbs = longest_hit(
                    self.groups,
                    self.block_size * k,
                    first_hb,
                    last_hb,
                    self._is_ready(hashes),
                )
                if hbs:
                    end = (first_hb + hbs) * k
                    self.pool.touch(self._needed_keys(hashes, first, end))
            if hbs:
                hits = (first_hb + hbs) * k - first
            start = first_hb + hbs
            remote_hbs = self._remote_hits(state, start, last_hb)
            if remote_hbs:
                state.remote_hit = (start, remote_hbs)
                hits = (start + remote_hbs) * k - first
        state.lookup = (first, hits)
        self.stats.lookup_tokens += max(0, request.num_tokens - num_computed_tokens)
        if not hits:
            state.async_host = False
            return 0
        tokens = min(
            hits * self.block_size, request.num_tokens - 1 - num_computed_tokens
        )
        state.async_host = (
            state.remote_hit is None
            and 0 < self.async_load_tokens <= tokens
            and len(self._last_scheduled) > (request.request_id in self._last_scheduled)
        )
        return tokens

    def load_is_async(self, request: Request) -> bool:
        """Whether the last lookup's hit loads across steps: it waits for blocks from
        the shared store, or it is a host hit of `async_load_tokens` or more."""
        state = self._requests.get(request.request_id)
        return state is not None and (state.remote_hit is not None or state.async_host)

    def _remote_hits(self, state: RequestState, start: int, end: int) -> int:
        """Host blocks [start, start + n) of the request that the shared store holds
        and the pool does not; asked once per request and range."""
        if state.remote_failed or start >= end:
            return 0
        if state.remote_asked is not None and state.remote_asked[:2] == (start, end):
            return state.remote_asked[2]
        hashes, k = state.request.block_hashes, self.blocks_per_host_block
        hits = self.shared.hits((0, hashes[hb * k + k - 1]) for hb in range(start, end))
        state.remote_asked = (start, end, hits)
        return hits

    def _is_ready(self, hashes: Sequence[Any]) -> Callable[[int, int], bool]:
        state_of = self.pool.state_of
        ready = BlockState.READY
        k = self.blocks_per_host_block
        return lambda group_id, hb: (
            state_of((group_id, hashes[(hb + 1) * k - 1])) is ready
        )

    def _needed_keys(
        self, hashes: Sequence[Any], first: int, end: int
    ) -> list[BlockKey]:
        """Each group's keys that a prefix of `end` blocks needs from block `first` on
        (k = 1 when a group is windowed, so blocks and host blocks coincide there)."""
        keys: list[BlockKey] = []
        for group in self.groups:
            start = max(first, group.first_needed_block(end, self.block_size))
            keys += self._keys(
                group.group_id,
                hashes,
                start // self.blocks_per_host_block,
                end // self.blocks_per_host_block,
            )
        return keys

    def update_state_after_alloc(
        self,
        request: Request,
        device_block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """Plans the load of the host hit into the device blocks vLLM just allocated.

        `device_block_ids[g]` are group g's device blocks of the request.
        """
        state = self._state(request)
        first, hits = state.lookup
        hashes = request.block_hashes
        k = self.blocks_per_host_block
        if first:
            # Device hits are uses of the host copies too: the policy keeps
            # the chain warm.
            self.pool.touch(
                self._needed_keys(hashes, 0, first // k * k), by_device=True
            )
        if num_external_tokens == 0:
            return
        if state.remote_hit is not None or state.async_host:
            self._plan_async_load(state, device_block_ids[0], num_external_tokens)
            return
        # Whole blocks, or the prompt's last block but its last token.
        count = -(-num_external_tokens // self.block_size)
        assert count <= hits and (
            count * self.block_size == num_external_tokens
            or (first * self.block_size + num_external_tokens == request.num_tokens - 1)
        )
        end = first + count
        assert end % k == 0, "a host hit ends at a host block's end"
        keys, spans = self._load_spans(hashes, device_block_ids, first, end)
        device_ids: list[int] = []
        slots: list[int] = []
        loaded = self.stats.loaded_by_group
        for host_id, (group_id, span) in zip(self.pool.pin(keys), spans, strict=True):
            loaded[group_id] += len(span)
            ids = device_block_ids[group_id]
            device_ids += [ids[j] for j in span]
            slots += [host_id * k + j % k for j in span]
        job = self._new_job("load", request.request_id, keys)
        self._step_loads.append(
            BlockTransfer(job, device_ids, slots, req_id=request.request_id)
        )
        # The loaded blocks are in the host tier already: never store them again.
        state.planned_upto = max(state.planned_upto, end)
        self.stats.hit_tokens += num_external_tokens
        self.stats.loaded_blocks += len(device_ids)

    def _load_spans(
        self,
        hashes: Sequence[Any],
        device_block_ids: Sequence[Sequence[int]],
        first: int,
        end: int,
    ) -> tuple[list[BlockKey], list[tuple[int, list[int]]]]:
        """The host blocks a load of blocks [first, end) reads, and per host block
        its group and the blocks it fills: each group's from its first needed block
        on, skipping the null blocks a window group holds outside its window."""
        k, null = self.blocks_per_host_block, self._null_block_id
        keys: list[BlockKey] = []
        spans: list[tuple[int, list[int]]] = []
        for group in self.groups:
            ids = device_block_ids[group.group_id]
            start = max(first, group.first_needed_block(end, self.block_size))
            for hb in range(start // k, end // k):
                span = [
                    j for j in range(max(hb * k, start), hb * k + k) if ids[j] != null
                ]
                if span:
                    keys.append((group.group_id, hashes[hb * k + k - 1]))
                    spans.append((group.group_id, span))
        return keys, spans

    def _plan_async_load(
        self, state: RequestState, ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """A hit that loads across steps (single full-attention group): pins its host
        blocks, allocates host blocks for those it fetches from the shared store (none
        for a host hit alone), and plans one job that fetches them, then loads every
        block of the hit into `ids`."""
        request = state.request
        hashes = request.block_hashes
        k = self.blocks_per_host_block
        first = state.lookup[0]
        end = first + -(-num_external_tokens // self.block_size)
        end_hb = -(-end // k)  # the host block after the hit's last one
        remote_start = end_hb if state.remote_hit is None else state.remote_hit[0]
        remote_end = max(remote_start, end_hb)
        # The host part: blocks [first, remote_start * k), pinned as for a sync load.
        host_keys = self._keys(0, hashes, first // k, remote_start)
        device_ids: list[int] = []
        slots: list[int] = []
        for host_id, hb in zip(
            self.pool.pin(host_keys), range(first // k, remote_start), strict=True
        ):
            for j in range(max(hb * k, first), min(hb * k + k, end)):
                device_ids.append(ids[j])
                slots.append(host_id * k + j % k)
        fetched_from = len(device_ids)
        fetched, host_blocks = self._allocate_fetched(hashes, remote_start, remote_end)
        for n, host_id in enumerate(host_blocks):
            hb = remote_start + n
            for j in range(max(hb * k, first), min(hb * k + k, end)):
                device_ids.append(ids[j])
                slots.append(host_id * k + j % k)
        loaded_to = first + len(device_ids)
        unloadable = [ids[j] for j in range(loaded_to, end)]
        job = self._new_job("async", request.request_id, host_keys)
        self._jobs[job].fetched = fetched
        state.async_job = job
        self._step_async_loads.append(
            AsyncLoad(
                load=BlockTransfer(job, device_ids, slots, req_id=request.request_id),
                fetch=self.shared.fetch(job, fetched, host_blocks),
                fetched_from=fetched_from,
                unloadable=unloadable,
            )
        )
        state.planned_upto = max(state.planned_upto, end)
        # A hit counts its tokens, and ends a token short of its blocks when it covers
        # the prompt's last block.
        host_tokens = min(fetched_from * self.block_size, num_external_tokens)
        loaded_tokens = min(len(device_ids) * self.block_size, num_external_tokens)
        self.stats.hit_tokens += host_tokens
        self.stats.async_hit_tokens += host_tokens
        self.stats.remote_hit_tokens += loaded_tokens - host_tokens
        self.stats.loaded_blocks += len(device_ids)

    def _allocate_fetched(
        self, hashes: Sequence[Any], start_hb: int, end_hb: int
    ) -> tuple[list[BlockKey], list[int]]:
        """Host blocks [start_hb, end_hb) of an async load that come from the shared
        store: allocated now, STORING until the fetch ends. A run cut short (no room,
        a key held meanwhile) loads what it got; vLLM recomputes the rest."""
        k = self.blocks_per_host_block
        wanted = self._keys(0, hashes, start_hb, end_hb)
        parent = (0, hashes[start_hb * k - 1]) if start_hb > 0 else None
        got = self.pool.allocate_for_store(wanted, parent) if wanted else []
        fetched: list[BlockKey] = []
        host_blocks: list[int] = []
        for key, (got_key, host_id) in zip(wanted, got, strict=False):
            if key != got_key:
                break
            fetched.append(key)
            host_blocks.append(host_id)
        beyond = [key for key, _ in got[len(fetched) :]]
        if beyond:
            self.pool.complete_store(beyond, False)
        return fetched, host_blocks

    # ---- shared with the store planning ----

    def _state(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = RequestState(request)
        return state

    def _keys(
        self,
        group_id: int,
        block_hashes: Sequence[Any],
        first_hb: int,
        last_hb: int,
    ) -> list[BlockKey]:
        """The keys of host blocks [first_hb, last_hb): each one's last device
        block."""
        k = self.blocks_per_host_block
        return [
            (group_id, block_hashes[hb * k + k - 1]) for hb in range(first_hb, last_hb)
        ]

    def _new_job(
        self,
        kind: Literal["load", "store", "async"],
        req_id: str,
        keys: list[BlockKey],
    ) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = JobInFlight(kind, req_id, keys)
        return job_id
