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
from vllm_cpu_offload.scheduler.tier_seams import (
    NoRetention,
    NoSharedTier,
    RequestHints,
)
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
    retention: NoRetention
    read_hints: Callable[[Request], RequestHints]
    hashes_hold: Callable[[Request], bool]
    _single_full_group: bool
    hit_to_last_token: bool
    drafter_tail_is_volatile: bool
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
        state, k = self._state(request), self.blocks_per_host_block
        first = num_computed_tokens // self.block_size
        # A host block is looked up by its last device block's hash, so only host
        # blocks that end by `last` count. At least one token must be computed to
        # sample from: with full attention alone a hit may cover the prompt's last
        # block but one token, whose KV the forward writes again; with other groups
        # (a state-space group's state cannot take a token twice) and with a drafter
        # (vLLM's proposers take a one-token prefill for a decode step: measured,
        # acceptance falls) it ends a block earlier, where vLLM's own hit ends.
        end_token = request.num_tokens - (0 if self.hit_to_last_token else 1)
        last = min(len(request.block_hashes), end_token // self.block_size)
        first_hb, last_hb = first // k, last // k
        if self.drafter_tail_is_volatile:
            # The hit's last block is dropped below, so the lookup may take one
            # block more, where the prompt has it: the drafter's KV at the end of
            # the block before was computed from that block's first token.
            last_hb = min(len(request.block_hashes) // k, last_hb + 1)
        hits, state.remote_hit = 0, None
        if last_hb > first_hb and not state.load_failed and self.hashes_hold(request):
            hbs, remote_hbs = self._hits(state, first_hb, last_hb)
            if self.drafter_tail_is_volatile and hbs + remote_hbs:
                # An EAGLE-style drafter's KV at a block's last position was computed
                # from the token after it, which the block's hash does not cover: the
                # hit's last block is recomputed, as vLLM drops it from its own hits.
                if self._single_full_group:  # one run: the same hit, a block shorter
                    hbs, remote_hbs = (
                        (hbs, remote_hbs - 1) if remote_hbs else (hbs - 1, 0)
                    )
                    keys = self._keys(0, request.block_hashes, first_hb, first_hb + hbs)
                    self.pool.touch(keys)
                else:  # looked up again: a window group needs the blocks before it
                    end_hb = first_hb + hbs + remote_hbs - 1
                    hbs, remote_hbs = self._hits(state, first_hb, end_hb)
            if hbs and not self._single_full_group:
                end = (first_hb + hbs) * k
                self.pool.touch(self._needed_keys(request.block_hashes, first, end))
            start = first_hb + hbs
            if hbs:
                hits = start * k - first
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
        # With several KV cache groups every hit loads across steps: vLLM takes the
        # failure of such a load only as a failed request, and only while it waits.
        state.async_host = state.remote_hit is None and (
            len(self.groups) > 1
            or (
                0 < self.async_load_tokens <= tokens
                and len(self._last_scheduled)
                > (request.request_id in self._last_scheduled)
            )
        )
        return tokens

    def _hits(
        self, state: RequestState, first_hb: int, last_hb: int
    ) -> tuple[int, int]:
        """Host blocks from `first_hb` on, before `last_hb`, that host memory serves,
        then those the shared store serves past them. With one full-attention group
        the host hits count as a use (`count_hits`); with several the caller touches
        the blocks of the hit it takes."""
        if last_hb <= first_hb:
            return 0, 0
        hashes, k = state.request.block_hashes, self.blocks_per_host_block
        if self._single_full_group:
            # An EAGLE-style hit's last block is dropped after: the caller touches
            # the blocks it keeps.
            hbs = self.pool.count_hits(
                self._keys(0, hashes, first_hb, last_hb),
                use=not self.drafter_tail_is_volatile,
            )
        else:
            hbs = longest_hit(
                self.groups,
                self.block_size * k,
                first_hb,
                last_hb,
                self._is_ready(hashes),
            )
        return hbs, self._remote_hits(state, first_hb, first_hb + hbs, last_hb)

    def load_is_async(self, request: Request) -> bool:
        """Whether the last lookup's hit loads across steps: it waits for blocks from
        the shared store, it is a host hit of `async_load_tokens` or more, or the
        model has several KV cache groups."""
        state = self._requests.get(request.request_id)
        return state is not None and (state.remote_hit is not None or state.async_host)

    def _remote_hits(
        self, state: RequestState, first: int, start: int, end: int
    ) -> int:
        """Host blocks [start, start + n) of the request past its host hit (which
        spans [first, start)) that the shared store serves; asked once per request
        and range. With one full-attention group the store must hold them all; with
        several groups a block of the hit comes from the pool or the store, wherever
        each group finds it."""
        if state.remote_failed or start >= end:
            return 0
        if not self._single_full_group:
            return self._remote_hits_of_groups(state, first, start, end)
        if state.remote_asked is not None and state.remote_asked[:2] == (start, end):
            return state.remote_asked[2]
        hashes, k = state.request.block_hashes, self.blocks_per_host_block
        hits = self.shared.hits((0, hashes[hb * k + k - 1]) for hb in range(start, end))
        state.remote_asked = (start, end, hits)
        return hits

    def _remote_hits_of_groups(
        self, state: RequestState, first: int, start: int, end: int
    ) -> int:
        """`_remote_hits` with several KV cache groups: the longest hit every group
        can serve (`longest_hit`: a full group needs every block, a window group the
        blocks of its window before the hit's end), each block READY in the pool or
        held by the store, less the host hit. One question to the store per request
        and range, for every group's blocks the pool does not hold."""
        hashes, k = state.request.block_hashes, self.blocks_per_host_block
        asked = state.remote_held
        # A range within the one asked needs no new question (the EAGLE-style drop
        # looks up a shorter hit).
        if asked is None or asked[0] != first or end > asked[1]:
            keys = [
                (group.group_id, hashes[hb * k + k - 1])
                for hb in range(first, end)
                for group in self.groups
            ]
            asked = state.remote_held = (first, end, self.shared.held(keys))
        held = asked[2]
        state_of, ready = self.pool.state_of, BlockState.READY

        def servable(group_id: int, hb: int) -> bool:
            key = (group_id, hashes[hb * k + k - 1])
            block_state = state_of(key)
            return block_state is ready or (block_state is None and key in held)

        hbs = longest_hit(self.groups, self.block_size * k, first, end, servable)
        return max(0, first + hbs - start)

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
            used = self._needed_keys(hashes, 0, first // k * k)
            self.pool.touch(used, by_device=True)
            self.retention.read(used)
        if num_external_tokens == 0:
            return
        if state.remote_hit is not None or state.async_host:
            self._plan_async_load(state, device_block_ids, num_external_tokens)
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
        host_ids = self.pool.pin(keys)
        self.retention.read(keys)  # pinned by the load now
        for host_id, (group_id, span) in zip(host_ids, spans, strict=True):
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
            for hb in range(start // k, -(-end // k)):
                span = [
                    j
                    for j in range(max(hb * k, start), min(hb * k + k, end))
                    if ids[j] != null
                ]
                if span:
                    keys.append((group.group_id, hashes[hb * k + k - 1]))
                    spans.append((group.group_id, span))
        return keys, spans

    def _plan_async_load(
        self,
        state: RequestState,
        device_block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """A hit that loads across steps: pins each group's blocks of it that the
        pool holds, allocates host blocks for the others (from the shared store), and
        plans one job that fetches them, then loads the hit; with several groups,
        whole or not at all (`AsyncLoad.whole`)."""
        request = state.request
        hashes, first = request.block_hashes, state.lookup[0]
        end = first + -(-num_external_tokens // self.block_size)
        keys, spans = self._load_spans(hashes, device_block_ids, first, end)
        state_of, ready = self.pool.state_of, BlockState.READY
        in_pool = [state_of(key) is ready for key in keys]
        host_keys = [key for key, held in zip(keys, in_pool, strict=True) if held]
        host_ids = iter(self.pool.pin(host_keys))
        self.retention.read(host_keys)
        wanted = [
            (key, span)
            for key, span, held in zip(keys, spans, in_pool, strict=True)
            if not held
        ]
        fetched, host_blocks = self._allocate_fetched(hashes, wanted)
        pairs: list[tuple[int, list[int], int]] = [
            (*span, next(host_ids))
            for span, held in zip(spans, in_pool, strict=True)
            if held
        ]
        fetched_from = sum(len(blocks) for _, blocks, _ in pairs)
        # The fetched blocks' pairs: as many as got host blocks (the rest missed).
        pairs += [
            (*span, host_id)
            for (_, span), host_id in zip(wanted, host_blocks, strict=False)
        ]
        device_ids, slots = self._pairs(device_block_ids, pairs)
        missed = [span for _, span in wanted[len(fetched) :]]
        whole = len(self.groups) > 1
        if whole and missed:
            state.remote_failed = True  # the load fails: do not ask again
        else:
            self._count_async_load(state, num_external_tokens, end, pairs, missed)
        job = self._new_job("async", request.request_id, host_keys)
        self._jobs[job].fetched = fetched
        state.async_job = job
        self._step_async_loads.append(
            AsyncLoad(
                load=BlockTransfer(job, device_ids, slots, req_id=request.request_id),
                fetch=self.shared.fetch(job, fetched, host_blocks),
                fetched_from=fetched_from,
                unloadable=[
                    device_block_ids[g][j] for g, blocks in missed for j in blocks
                ],
                whole=whole,
            )
        )
        state.planned_upto = max(state.planned_upto, end)

    def _pairs(
        self,
        device_block_ids: Sequence[Sequence[int]],
        pairs: list[tuple[int, list[int], int]],
    ) -> tuple[list[int], list[int]]:
        """The device blocks and host slots of (group, blocks, host block) triples."""
        k = self.blocks_per_host_block
        device_ids: list[int] = []
        slots: list[int] = []
        for group_id, blocks, host_id in pairs:
            ids = device_block_ids[group_id]
            device_ids += [ids[j] for j in blocks]
            slots += [host_id * k + j % k for j in blocks]
        return device_ids, slots

    def _count_async_load(
        self,
        state: RequestState,
        num_external_tokens: int,
        end: int,
        pairs: list[tuple[int, list[int], int]],
        missed: list[tuple[int, list[int]]],
    ) -> None:
        """Counts the blocks (per group) and hit tokens of an async load that loads
        its `pairs`, up to its first `missed` block. Not called for a load of several
        groups short of a block: that one loads nothing (the worker fails its request
        and vLLM recomputes it), so the blocks of the groups it did get are not loaded
        blocks, nor its tokens hits."""
        loaded = self.stats.loaded_by_group
        for group_id, blocks, _ in pairs:
            loaded[group_id] += len(blocks)
            self.stats.loaded_blocks += len(blocks)
        loaded_to = min((blocks[0] for _, blocks in missed), default=end)
        self._count_async_hit(state, num_external_tokens, end, loaded_to)

    def _count_async_hit(
        self, state: RequestState, num_external_tokens: int, end: int, loaded_to: int
    ) -> None:
        """An async hit of blocks [first, end), loaded up to `loaded_to`, counts its
        tokens (from host memory, from the store), and ends a token short of its
        blocks when it covers the prompt's last block."""
        first, k = state.lookup[0], self.blocks_per_host_block
        host_end = end if state.remote_hit is None else state.remote_hit[0] * k
        host_blocks, loaded_blocks = host_end - first, loaded_to - first
        host_tokens = min(max(0, host_blocks) * self.block_size, num_external_tokens)
        loaded_tokens = min(
            max(0, loaded_blocks) * self.block_size, num_external_tokens
        )
        self.stats.hit_tokens += host_tokens
        self.stats.async_hit_tokens += host_tokens
        self.stats.remote_hit_tokens += max(0, loaded_tokens - host_tokens)

    def _allocate_fetched(
        self,
        hashes: Sequence[Any],
        wanted: list[tuple[BlockKey, tuple[int, list[int]]]],
    ) -> tuple[list[BlockKey], list[int]]:
        """Host blocks for the `wanted` blocks of an async load (key, then group and
        device blocks, each group's in order) that come from the shared store:
        allocated now, STORING until the fetch ends, chain by chain (each run of one
        group's consecutive host blocks). Allocation stops at the first it cannot
        make (no room, a key held meanwhile): the load loads what it got."""
        k = self.blocks_per_host_block
        fetched: list[BlockKey] = []
        host_blocks: list[int] = []
        n = 0
        while n < len(wanted):
            group_id, hb = wanted[n][1][0], wanted[n][1][1][0] // k
            run = n + 1
            while (
                run < len(wanted)
                and wanted[run][1][0] == group_id
                and (wanted[run][1][1][0] // k == hb + run - n)
            ):
                run += 1
            keys = [key for key, _ in wanted[n:run]]
            parent = (group_id, hashes[hb * k - 1]) if hb > 0 else None
            got = self.pool.allocate_for_store(keys, parent)
            matched = 0
            for key, (got_key, host_id) in zip(keys, got, strict=False):
                if key != got_key:
                    break
                fetched.append(key)
                host_blocks.append(host_id)
                matched += 1
            beyond = [key for key, _ in got[matched:]]
            if beyond:
                self.pool.complete_store(beyond, False)
            if matched < len(keys):
                break
            n = run
        return fetched, host_blocks

    # ---- shared with the store planning ----

    def _state(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = RequestState(request, self.read_hints(request))
            self._requests[request.request_id] = state
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
