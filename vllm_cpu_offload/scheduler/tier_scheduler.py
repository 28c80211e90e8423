"""The scheduler half of the connector: decides what to load, what to store, when to
free.

It runs inside every engine step of vLLM's scheduler and forwards bookkeeping to the
`HostBlockPool`. Everything is keyed by vLLM's own block hashes (`request.block_hashes`,
with the KV cache group id), so `cache_salt` isolation and LoRA keys hold for free. With
vLLM's hybrid KV cache manager there is one key per (group, block): a lookup returns the
longest hit that every group can serve (`kv_groups.longest_hit`), a load fills the
device blocks each group allocated (a sliding-window group only those of its window),
and a store copies each group's device blocks that vLLM has not already released.

Invariants (tests in tests/unit/test_tier_scheduler.py and tests/e2e):
- A host block being loaded is pinned from the step that plans the load until every
  worker reported the load; pinned blocks are never evicted or overwritten.
- A device block being stored stays allocated until the store finished: finished
  requests with stores in flight are freed late (`request_finished` returns True) and
  preempted requests make the workers drain their stores before the blocks are reused.
- A finished request's blocks are freed in the step its last store is reported: a store
  that completes in the request's last step (every store on the CPU platform) frees the
  blocks at once, never waiting for a next step that an idle engine would not run. Only
  stores still in flight are handed to the workers, which report them when done.
- Stored blocks become visible to lookups only after every worker reported the store.
- Lookups return a contiguous run of whole blocks that starts right after the device hit
  and leaves at least one prompt token to compute.
A host hit below `async_load_tokens` loads within the step that plans it, so two
requests that share a prefix never both load it: the second one finds the first one's
device blocks in vLLM's prefix cache, which caches them at allocation. A larger hit, and
any hit that reaches into the shared store, loads across steps (vLLM caches its blocks
once the load is reported): a second request that arrives meanwhile loads its own copy.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from vllm_cpu_offload.block_transfer import AsyncLoad, BlockTransfer, RemoteBlocks
from vllm_cpu_offload.metadata import (
    OffloadStepMetadata,
    OffloadWorkerReport,
    and_of,
)
from vllm_cpu_offload.remote.namespace import block_key
from vllm_cpu_offload.scheduler.block_pool import (
    BlockKey,
    BlockState,
    HostBlockPool,
    PoolEvent,
)
from vllm_cpu_offload.scheduler.kv_groups import (
    FULL_ATTENTION_ONLY,
    KVGroup,
    longest_hit,
)
from vllm_cpu_offload.scheduler.remote_lookup import RemoteLookup
from vllm_cpu_offload.scheduler.stored_blocks import StoredBlocks, stored_runs
from vllm_cpu_offload.scheduler.tier_stats import TierStats

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# vLLM's BlockPool hands out block 0 first and keeps it as its null block: the
# placeholder a sliding-window group holds for blocks outside its window.
NULL_BLOCK_ID = 0

# A block the shared store listed but did not serve is not asked for again for this
# long (its storage node may have died; a block written again after that is found
# again), and at most this many such keys are remembered.
UNFETCHABLE_FOR_S = 30.0
UNFETCHABLE_MAX_KEYS = 1 << 16


@dataclass
class _JobInFlight:
    """What the scheduler half settles when every worker has reported a job: the keys
    to unpin (load) or to make visible or free (store)."""

    kind: Literal["load", "store", "async"]
    req_id: str
    # load, async: the host blocks to unpin; store: the blocks to make visible or free
    keys: list[BlockKey]
    stored: list[StoredBlocks] | None = None  # for KV events, when they are on
    # async: the host blocks the workers fill from the shared store, in order
    fetched: list[BlockKey] = field(default_factory=list)
    # Some worker reported it failed.
    failed: bool = False


@dataclass(frozen=True)
class _Writing:
    """A store job whose blocks wait until every worker wrote them through."""

    keys: list[BlockKey]
    stored: list[StoredBlocks] | None  # for KV events
    success: bool  # every worker's store succeeded


@dataclass(frozen=True)
class RemoteTierEvent:
    """Blocks the shared store holds now ("stored": every worker wrote its shard), or
    blocks it listed and did not serve ("missing"), in order; for KV events."""

    kind: Literal["stored", "missing"]
    keys: tuple[BlockKey, ...]
    # "stored", when every block of a store job was written: what its events say
    detail: list[StoredBlocks] | None = None


@dataclass
class _RequestState:
    request: Request
    # Blocks [0, planned_upto) were stored, are being stored, or were skipped.
    planned_upto: int = 0
    # (first block, blocks) of the last lookup, for the load plan after allocation.
    lookup: tuple[int, int] = (0, 0)
    # Of that lookup, with a shared store: (first host block, host blocks) it holds
    # past the host hit. The hit then loads asynchronously, across steps.
    remote_hit: tuple[int, int] | None = None
    # The last question to the store: (first, end host block) -> its answer.
    remote_asked: tuple[int, int, int] | None = None
    # The last lookup's hit is in host memory alone and large enough to load across
    # steps (`async_load_tokens`).
    async_host: bool = False
    # A fetch of this request came back short: vLLM recomputes, and the store is not
    # asked for it again (a store that lists blocks it cannot serve would otherwise
    # send the request round and round).
    remote_failed: bool = False
    # Store jobs in flight: the request's device blocks outlive it until they are
    # done. (An async load needs no such care: vLLM keeps the blocks of a request
    # that waits for remote KV until the workers report the load.)
    store_jobs: set[int] = field(default_factory=set)
    # The load that spans steps, while the request waits for it (vLLM's
    # WAITING_FOR_REMOTE_KVS).
    async_job: int | None = None


class HostTierScheduler:
    """Plans the host tier's transfers; one instance in the engine core process."""

    def __init__(
        self,
        pool: HostBlockPool,
        block_size: int,
        num_workers: int,
        block_bytes: int,
        groups: Sequence[KVGroup] = FULL_ATTENTION_ONLY,
        record_stored_blocks: bool = False,
        blocks_per_host_block: int = 1,
        remote: RemoteLookup | None = None,
        namespace: str = "",
        async_load_tokens: int = 0,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        # k: a host block holds k consecutive device blocks of a request, keyed by the
        # hash of its last one (which covers the whole prefix). Host block h occupies
        # the worker's host slots [h * k, h * k + k). Windowed groups need k = 1.
        # Locals: `k` is this number, `hb` a host block's index in its request, `hbs`
        # a number of host blocks.
        self.blocks_per_host_block = blocks_per_host_block
        assert self.blocks_per_host_block == 1 or all(g.is_full for g in groups), (
            "k > 1 needs full attention"
        )
        self.groups = tuple(groups)
        self._single_full_group = self.groups == FULL_ATTENTION_ONLY
        # Whether stores record what vLLM's BlockStored events say (KV events are on).
        self.record_stored_blocks = record_stored_blocks
        self._null_block_id = NULL_BLOCK_ID
        self.num_workers = num_workers
        self.stats = TierStats(block_bytes=block_bytes)
        self._kv_cache_manager: Any = None
        self._requests: dict[str, _RequestState] = {}
        self._jobs: dict[int, _JobInFlight] = {}
        self._reports: Counter[int] = Counter()
        self._next_job_id = 0
        self._step_loads: list[BlockTransfer] = []
        # With a shared store (single full-attention group only): lookups past the host
        # hit, write-through of every store, fetches that span steps.
        self.remote = remote if self._single_full_group else None
        self.namespace = namespace
        # Host hits of at least this many tokens load across steps while other requests
        # run; 0: none. Only with a single full-attention group, as the shared store's
        # hits.
        self.async_load_tokens = async_load_tokens if self._single_full_group else 0
        # The requests the last step computed: a hit with none of them beside it holds
        # no one back, and loads inside its step (a step sooner).
        self._last_scheduled: frozenset[str] = frozenset()
        self._step_async_loads: list[AsyncLoad] = []
        self._step_writes: list[RemoteBlocks] = []
        # async job -> for each fetched block, whether it arrived on every worker so
        # far, and how many workers reported
        self._fetch_results: dict[int, list[bool]] = {}
        self._fetch_reports: Counter[int] = Counter()
        # store job -> blocks held until every worker wrote them through
        self._writing: dict[int, _Writing] = {}
        self._write_reports: Counter[int] = Counter()
        # store job -> for each block, whether every worker that reported wrote it
        self._write_stored: dict[int, list[bool]] = {}
        self._remote_events: list[RemoteTierEvent] = []
        # key -> until when the store is not asked for it (a fetch of it failed)
        self._unfetchable: OrderedDict[BlockKey, float] = OrderedDict()
        # Finished requests whose device blocks wait for these store jobs, not yet
        # handed to the workers (that happens in the next step's metadata).
        self._awaiting_stores: dict[str, set[int]] = {}

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        null = getattr(
            getattr(kv_cache_manager, "block_pool", None), "null_block", None
        )
        if null is not None:
            self._null_block_id = null.block_id

    # ---- lookups and loads ----

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
            if self.remote is not None:
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

    def _remote_hits(self, state: _RequestState, start: int, end: int) -> int:
        """Host blocks [start, start + n) of the request that the shared store holds
        and the pool does not (a block the pool holds, in any state, ends the run)."""
        assert self.remote is not None
        if state.remote_failed:
            return 0
        if state.remote_asked is not None and state.remote_asked[:2] == (start, end):
            return state.remote_asked[2]
        keys = self._keys(0, state.request.block_hashes, start, end)
        now = time.monotonic()
        for n, key in enumerate(keys):
            if key in self.pool or self._unfetchable.get(key, 0.0) > now:
                keys = keys[:n]
                break
        self.stats.remote_lookup_tokens += (
            len(keys) * self.blocks_per_host_block * self.block_size
        )
        failures = self.remote.failures
        hits = self.remote.count_hits([self._remote_key(key) for key in keys])
        self.stats.remote_lookup_failures += self.remote.failures - failures
        state.remote_asked = (start, end, hits)
        return hits

    def _remote_key(self, key: BlockKey) -> str:
        group_id, block_hash = cast(tuple[int, Any], key)
        return block_key(self.namespace, group_id, block_hash)

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
        null = self._null_block_id
        keys: list[BlockKey] = []
        # Per key: its group, and the blocks it loads.
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

    def _plan_async_load(
        self, state: _RequestState, ids: Sequence[int], num_external_tokens: int
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
        # The fetched part: host blocks allocated now, STORING until the fetch ends. A
        # run cut short (no room, a key held meanwhile) loads what it got; vLLM
        # recomputes the rest.
        wanted = self._keys(0, hashes, remote_start, remote_end)
        parent = (0, hashes[remote_start * k - 1]) if remote_start > 0 else None
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
                fetch=RemoteBlocks(
                    job, [self._remote_key(key) for key in fetched], host_blocks
                ),
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

    # ---- the step's metadata ----

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> OffloadStepMetadata:
        """This step's loads, and stores for the blocks that become full during the
        step."""
        meta = OffloadStepMetadata(
            loads=self._step_loads,
            delayed_free_req_ids=list(self._awaiting_stores),
            preempted_req_ids=sorted(scheduler_output.preempted_req_ids or ()),
            async_loads=self._step_async_loads,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._step_loads, self._awaiting_stores = [], {}
        self._step_async_loads = []
        self._last_scheduled = frozenset(scheduler_output.num_scheduled_tokens)
        self.stats.preempted_requests += len(meta.preempted_req_ids)
        for req_id in meta.preempted_req_ids:
            if (state := self._requests.get(req_id)) is not None:
                # Its device blocks are gone; on resume, the lookup finds
                # what was stored.
                state.planned_upto = 0
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is not None:
                store = self._plan_store(state, num_tokens)
                if store is not None:
                    meta.stores.append(store)
                    if self.remote is not None:
                        meta.writes.append(self._write_through(store))
        return meta

    def _write_through(self, store: BlockTransfer) -> RemoteBlocks:
        """What every worker writes to the shared store once `store` is done there."""
        keys = self._jobs[store.job_id].keys
        k = self.blocks_per_host_block
        host_blocks = [slot // k for slot in store.host_block_ids[::k]]
        return RemoteBlocks(
            store.job_id, [self._remote_key(key) for key in keys], host_blocks
        )

    def _plan_store(
        self, state: _RequestState, num_scheduled: int
    ) -> BlockTransfer | None:
        request = state.request
        k = self.blocks_per_host_block
        full_hbs = (
            min(
                len(request.block_hashes),
                (request.num_computed_tokens + num_scheduled) // self.block_size,
            )
            // k
        )
        first_hb = state.planned_upto // k  # planned_upto is a host block boundary
        if full_hbs <= first_hb:
            return None
        state.planned_upto = full_hbs * k
        hashes = request.block_hashes
        block_ids = self._kv_cache_manager.get_block_ids(request.request_id)
        null = self._null_block_id
        device_ids: list[int] = []
        slots: list[int] = []
        allocated: list[tuple[BlockKey, int]] = []
        stored: list[StoredBlocks] | None = [] if self.record_stored_blocks else None
        for group in self.groups:
            ids = block_ids[group.group_id]
            # Runs of host blocks whose device blocks the group still holds: a window
            # group may have released the oldest ones (its null block) when the request
            # resumed past its window.
            end = first_hb
            while end < full_hbs:
                while end < full_hbs and null in ids[end * k : end * k + k]:
                    end += 1
                start = end
                while end < full_hbs and null not in ids[end * k : end * k + k]:
                    end += 1
                if start == end:
                    continue
                keys = self._keys(group.group_id, hashes, start, end)
                parent = (group.group_id, hashes[start * k - 1]) if start > 0 else None
                got = self.pool.allocate_for_store(keys, parent)
                index = {key: start + n for n, key in enumerate(keys)}
                got_hbs = [index[key] for key, _ in got]
                for hb, (_, host_id) in zip(got_hbs, got, strict=True):
                    device_ids += ids[hb * k : hb * k + k]
                    slots += range(host_id * k, host_id * k + k)
                allocated += got
                if stored is not None and got:
                    stored += stored_runs(
                        request, group.group_id, got_hbs, self.block_size, k
                    )
        if not allocated:
            return None
        job = self._new_job("store", request.request_id, [key for key, _ in allocated])
        self._jobs[job].stored = stored
        state.store_jobs.add(job)
        return BlockTransfer(job, device_ids, slots, req_id=request.request_id)

    # ---- completions ----

    def update_connector_output(self, report: OffloadWorkerReport | None) -> set[str]:
        """Finished stores become visible; finished loads unpin their host blocks.

        Returns the finished requests whose device blocks can be freed now: their last
        stores are in this report and the workers were not yet told to hold them.
        """
        if report is not None:
            for job_id, arrived in report.fetched.items():
                self._fetch_ended(job_id, arrived, report.fetch_reports[job_id])
            for job_id, count in report.failed.items():
                self._job_reported(job_id, count, failed=True)
            for job_id, count in report.finished.items():
                self._job_reported(job_id, count, failed=False)
            for job_id, count in report.written.items():
                self._write_ended(job_id, count, report.write_stored.get(job_id))
        released = {
            req_id for req_id, jobs in self._awaiting_stores.items() if not jobs
        }
        for req_id in released:
            del self._awaiting_stores[req_id]
        return released

    def forget_unloaded_blocks(self, device_block_ids: set[int]) -> None:
        """Device blocks a load did not fill leave vLLM's prefix cache.

        vLLM cached them when it allocated them for the hit, and its recompute
        policy keeps them cached, expecting their request to recompute them. A
        request preempted or aborted before it does leaves them cached with bytes
        nobody computed, and the next request with that prefix (or the same one,
        resumed) would read them as a device hit.
        """
        if self._kv_cache_manager is not None:
            self._kv_cache_manager.evict_blocks(set(device_block_ids))

    def _job_reported(self, job_id: int, count: int, *, failed: bool) -> None:
        """`count` workers reported a job. It ends once every worker has, finished or
        failed: until then another worker may still copy from or into its blocks."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        job.failed |= failed
        self._reports[job_id] += count
        if self._reports[job_id] >= self.num_workers:
            self._complete(job_id, success=not job.failed)

    def _fetch_ended(self, job_id: int, arrived: list[bool], reports: int) -> None:
        """Workers' fetches of an async job ended: blocks that arrived on every worker
        become visible, pinned until the job ends (its loads read them); the rest are
        freed."""
        job = self._jobs.get(job_id)
        if job is None or job.kind != "async":
            return
        both = and_of(self._fetch_results.get(job_id), arrived)
        self._fetch_results[job_id] = both
        self._fetch_reports[job_id] += reports
        if self._fetch_reports[job_id] < self.num_workers:
            return
        del self._fetch_results[job_id], self._fetch_reports[job_id]
        good = [key for key, ok in zip(job.fetched, both, strict=True) if ok]
        bad = [key for key, ok in zip(job.fetched, both, strict=True) if not ok]
        if bad:
            self.pool.complete_store(bad, False)
            self._remember_unfetchable(bad)
            if self.record_stored_blocks:
                self._remote_events.append(RemoteTierEvent("missing", tuple(bad)))
            state = self._requests.get(job.req_id)
            if state is not None:
                state.remote_failed = True
        if good:
            self.pool.complete_store(good, True)
            self.pool.pin(good)
            job.keys = job.keys + good
        self.stats.remote_fetched_blocks += len(good)
        self.stats.remote_missed_blocks += len(bad)
        job.fetched = []

    def _remember_unfetchable(self, keys: list[BlockKey]) -> None:
        """Blocks the store listed but did not serve are not offered again for a
        while: its index may outlive a dead storage node."""
        until = time.monotonic() + UNFETCHABLE_FOR_S
        for key in keys:
            self._unfetchable.pop(key, None)
            self._unfetchable[key] = until
        while len(self._unfetchable) > UNFETCHABLE_MAX_KEYS:
            self._unfetchable.popitem(last=False)

    def _write_ended(self, job_id: int, count: int, stored: list[bool] | None) -> None:
        """`count` workers wrote a store job through (or gave up), `stored` saying
        which blocks they wrote: once every worker did, no worker reads its host blocks
        any more. They may then be evicted (a store that succeeded) or freed (one that
        failed on some worker), and those every worker wrote are the store's (a KV
        event)."""
        if job_id not in self._jobs and job_id not in self._writing:
            return
        self._write_reports[job_id] += count
        if stored is not None:
            self._write_stored[job_id] = and_of(self._write_stored.get(job_id), stored)
        if job_id not in self._writing:
            return
        if self._write_reports[job_id] < self.num_workers:
            return
        writing = self._writing.pop(job_id)
        del self._write_reports[job_id]
        flags = self._write_stored.pop(job_id, None) or [False] * len(writing.keys)
        if not writing.success:
            self.pool.complete_store(writing.keys, False)
            return
        self.pool.unpin(writing.keys)
        if self.record_stored_blocks and any(flags):
            keys = writing.keys
            written = tuple(key for key, ok in zip(keys, flags, strict=True) if ok)
            whole = len(written) == len(keys)
            self._remote_events.append(
                RemoteTierEvent("stored", written, writing.stored if whole else None)
            )

    def _complete(self, job_id: int, success: bool) -> None:
        """Every worker reported the job: no copy of it runs any more."""
        job = self._jobs.pop(job_id)
        self._reports.pop(job_id, None)
        if job.kind == "load":
            self.pool.unpin(job.keys)
            if not success:
                self.stats.failed_loads += 1
            return
        if job.kind == "async":
            if job.fetched:  # no worker reported its fetch: nothing arrived
                self.pool.complete_store(job.fetched, False)
                self._fetch_results.pop(job_id, None)
                self._fetch_reports.pop(job_id, None)
            self.pool.unpin(job.keys)
            if not success:
                self.stats.failed_loads += 1
            return
        if self.remote is None:
            self.pool.complete_store(job.keys, success, job.stored)
        else:
            # A worker whose store succeeded writes its blocks through, reading them,
            # whether or not another worker's store failed: they stay held until every
            # worker's write ended. Those of a store that succeeded are visible
            # meanwhile (pinned); those of a failed one stay STORING, then go.
            if success:
                self.pool.complete_store(job.keys, True, job.stored)
                self.pool.pin(job.keys)
            self._writing[job_id] = _Writing(job.keys, job.stored, success)
            self._write_ended(job_id, 0, None)
        if success:
            self.stats.stored_blocks += len(job.keys) * self.blocks_per_host_block
            stored = self.stats.stored_by_group
            for key in job.keys:
                stored[cast(tuple[int, Any], key)[0]] += self.blocks_per_host_block
        else:
            self.stats.failed_stores += 1
        state = self._requests.get(job.req_id)
        if state is not None:
            state.store_jobs.discard(job_id)
        elif (awaiting := self._awaiting_stores.get(job.req_id)) is not None:
            awaiting.discard(job_id)

    def request_finished(self, request: Request) -> bool:
        """Returns True when the request's device blocks must outlive its stores.

        A request that still waits for a load spanning steps gets False: vLLM itself
        holds the blocks of a request aborted in WAITING_FOR_REMOTE_KVS until the load
        is reported (`finished_recving`), and a second hold would free them twice, the
        second time for a request vLLM no longer knows. Its stores in flight are older
        than these blocks: the request was preempted since, and the workers drained
        them (`handle_preemptions`) before its blocks could be reused.
        """
        state = self._requests.pop(request.request_id, None)
        if state is None or not state.store_jobs:
            return False
        if state.async_job in self._jobs:
            return False
        self._awaiting_stores[request.request_id] = state.store_jobs
        return True

    def reset_cache(self) -> bool:
        self.pool.reset()
        return True

    def take_pool_events(self) -> list[PoolEvent]:
        """The pool's events since the last call; counts evictions on the way."""
        events = self.pool.take_events()
        for event in events:
            if event.kind == "evicted":
                self.stats.evicted_blocks += (
                    len(event.keys) * self.blocks_per_host_block
                )
        return events

    def take_remote_events(self) -> list[RemoteTierEvent]:
        """What the shared store gained or was found to lack since the last call
        (recorded only while KV events are on)."""
        events, self._remote_events = self._remote_events, []
        return events

    # ---- helpers ----

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
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
        self._jobs[job_id] = _JobInFlight(kind, req_id, keys)
        return job_id

    @property
    def num_jobs_in_flight(self) -> int:
        return len(self._jobs)
