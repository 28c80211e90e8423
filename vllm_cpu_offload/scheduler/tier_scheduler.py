"""The scheduler half of the connector: decides what to load, what to store, when to
free.

It runs inside every engine step of vLLM's scheduler and forwards bookkeeping to the
medium the host blocks live on (`HostTierManager`: the `HostBlockPool`), and to what
layers plug into its seams (`tier_seams.py`: a shared store, retention, hints).
Everything is keyed by vLLM's own block
hashes (`request.block_hashes`, with the KV cache group id), so `cache_salt` isolation
and LoRA keys hold for free. With vLLM's hybrid KV cache manager there is one key per
(group, block): a lookup returns the longest hit that every group can serve
(`kv_groups.longest_hit`), a load fills the device blocks each group allocated (a
sliding-window group only those of its window), and a store copies each group's device
blocks that vLLM has not already released.

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

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from vllm_cpu_offload.block_transfer import AsyncLoad, BlockTransfer
from vllm_cpu_offload.metadata import (
    OffloadStepMetadata,
    OffloadWorkerReport,
)
from vllm_cpu_offload.scheduler.block_pool import (
    BlockKey,
    PoolEvent,
)
from vllm_cpu_offload.scheduler.kv_groups import (
    FULL_ATTENTION_ONLY,
    KVGroup,
)
from vllm_cpu_offload.scheduler.load_planning import LoadPlanning
from vllm_cpu_offload.scheduler.manager import HostTierManager
from vllm_cpu_offload.scheduler.request_state import JobInFlight, RequestState
from vllm_cpu_offload.scheduler.stored_blocks import StoredBlocks, stored_runs
from vllm_cpu_offload.scheduler.tier_seams import (
    NoRetention,
    NoSharedTier,
    RemoteTierEvent,
    RequestHints,
    no_hints,
)
from vllm_cpu_offload.scheduler.tier_stats import TierStats

logger = logging.getLogger("vllm.cpu_offload")

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Why the identity may have changed when vLLM resets the connector's cache.
CACHE_RESET = "vLLM reset the connector's cache (a weight update or sleep may follow)"


def _always(request: Request) -> bool:
    return True


# vLLM's BlockPool hands out block 0 first and keeps it as its null block: the
# placeholder a sliding-window group holds for blocks outside its window.
NULL_BLOCK_ID = 0


class HostTierScheduler(LoadPlanning):
    """Plans the host tier's transfers; one instance in the engine core process."""

    def __init__(
        self,
        pool: HostTierManager,
        block_size: int,
        num_workers: int,
        block_bytes: int,
        groups: Sequence[KVGroup] = FULL_ATTENTION_ONLY,
        record_stored_blocks: bool = False,
        blocks_per_host_block: int = 1,
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
        # Seams of speculative decoding (`drafter_layer.py`): whether a hit may
        # cover a prompt's last block but one token (see `get_num_new_matched_tokens`)
        # and whether its last block is recomputed.
        self.hit_to_last_token = self._single_full_group
        self.drafter_tail_is_volatile = False
        # Whether stores record what vLLM's BlockStored events say (KV events are on).
        self.record_stored_blocks = record_stored_blocks
        self._null_block_id = NULL_BLOCK_ID
        self.num_workers = num_workers
        self.stats = TierStats(block_bytes=block_bytes)
        self._kv_cache_manager: Any = None
        self._requests: dict[str, RequestState] = {}
        self._jobs: dict[int, JobInFlight] = {}
        self._reports: Counter[int] = Counter()
        self._next_job_id = 0
        self._step_loads: list[BlockTransfer] = []
        # The seams a layer fills (`tier_seams.py`, `layers.py`). A shared store:
        # lookups past the host hit, write-through of every store (every group's
        # blocks), fetches that span steps.
        self.shared: NoSharedTier = NoSharedTier(pool)
        # Blocks kept from eviction for clients that will read them again.
        self.retention: NoRetention = NoRetention()
        # What a client says of a request's KV.
        self.read_hints: Callable[[Request], RequestHints] = no_hints
        # Whether what computes a request's KV is still what its block hashes name
        # (an adapter rewritten since it was hashed is not): a request that is not
        # neither loads nor stores.
        self.hashes_hold: Callable[[Request], bool] = _always
        # Told when the weights may have changed at run time (`identity_changed`).
        self.on_identity_change: list[Callable[[str], None]] = []
        # Each worker's epoch heard of (`OffloadWorkerReport.epochs`): each step's
        # metadata carries them, and a worker whose epoch moved on since refuses the
        # step's loads (planned from KV of the weights or adapter before).
        self._epochs_heard: dict[str, int] = {}
        # Host hits of at least this many tokens load across steps while other requests
        # run; 0: none. (With several groups every hit does: `get_num_new_matched_...`.)
        self.async_load_tokens = async_load_tokens if self._single_full_group else 0
        # The requests the last step computed: a hit with none of them beside it holds
        # no one back, and loads inside its step (a step sooner).
        self._last_scheduled: frozenset[str] = frozenset()
        self._step_async_loads: list[AsyncLoad] = []
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

    # ---- the step's metadata ----

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> OffloadStepMetadata:
        """This step's loads, and stores for the blocks that become full during the
        step."""
        self.retention.expire()
        meta = OffloadStepMetadata(
            loads=self._step_loads,
            delayed_free_req_ids=list(self._awaiting_stores),
            preempted_req_ids=sorted(scheduler_output.preempted_req_ids or ()),
            async_loads=self._step_async_loads,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            epochs_heard=dict(self._epochs_heard),
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
                    keys = self._jobs[store.job_id].keys
                    first = state.hints.retain_s is not None
                    meta.writes += self.shared.write_through(store, keys, first=first)
        return meta

    def _plan_store(
        self, state: RequestState, num_scheduled: int
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
        limit = state.hints.max_offload_tokens
        if limit is not None:  # the client's cap: the first `limit` tokens at most
            full_hbs = min(full_hbs, limit // self.block_size // k)
        # vLLM rewinds a request whose load failed, and recomputes from there: those
        # blocks are stored anew (the tier may have dropped them). A host block
        # boundary, as planned_upto is.
        redone = request.num_computed_tokens // self.block_size // k * k
        if redone < state.planned_upto:
            state.planned_upto = redone
        first_hb = state.planned_upto // k
        if full_hbs <= first_hb or not self.hashes_hold(request):
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
            self._epochs_heard |= report.epochs
            if report.weights_changed:
                # First: this report's stores may hold KV of the weights before.
                self.identity_changed(report.weights_changed)
            for job_id, arrived in report.fetched.items():
                self._fetch_ended(job_id, arrived, report.fetch_reports[job_id])
            for job_id, count in report.failed.items():
                self._job_reported(job_id, count, failed=True)
            for job_id, count in report.finished.items():
                self._job_reported(job_id, count, failed=False)
            for job_id, count in report.written.items():
                self.shared.write_reported(
                    job_id, count, report.write_stored.get(job_id)
                )
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
        """Workers' fetches of an async job ended: once every worker has reported,
        the blocks that arrived are pinned until the job ends (its loads read them)."""
        job = self._jobs.get(job_id)
        if job is None or job.kind != "async":
            return
        ended = self.shared.fetch_reported(job_id, job.fetched, arrived, reports)
        if ended is None:
            return
        good, bad = ended
        if bad and (state := self._requests.get(job.req_id)) is not None:
            state.remote_failed = True
        if good:
            self.pool.pin(good)
            job.keys = job.keys + good
        job.fetched = []

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
                self.shared.fetch_abandoned(job_id, job.fetched)
            self.pool.unpin(job.keys)
            if not success:
                self.stats.failed_loads += 1
                if (state := self._requests.get(job.req_id)) is not None:
                    state.load_failed = True
            return
        self.shared.store_completed(job_id, job.keys, job.stored, success)
        self.retention.stored(job.keys, success)
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
        if state is not None and state.hints.any:
            self._finish_hints(state)
        if state is None or not state.store_jobs:
            return False
        if state.async_job in self._jobs:
            return False
        self._awaiting_stores[request.request_id] = state.store_jobs
        return True

    def _finish_hints(self, state: RequestState) -> None:
        """A finished request's `done` or `retain`, over its blocks the pool holds,
        block by block in prefix order (every group's key of a block together)."""
        request, hints = state.request, state.hints
        hashes = request.block_hashes
        keys = [
            key
            for hb in range(len(hashes) // self.blocks_per_host_block)
            for group in self.groups
            for key in self._keys(group.group_id, hashes, hb, hb + 1)
        ]
        if hints.done:
            self.retention.forget(keys)
            self.pool.demote(keys)
        elif hints.retain_s is not None and self.retention.budget:
            tenant = getattr(request, "cache_salt", None)
            self.retention.retain(keys, tenant, hints.retain_s)

    def reset_cache(self) -> bool:
        # vLLM resets connectors' caches around weight updates and sleep
        # (`pause_generation(clear_cache=True)`): the weights may change next.
        self.identity_changed(CACHE_RESET)
        return True

    def identity_changed(self, why: str) -> None:
        """What computes this engine's KV may no longer be what its start loaded
        (`why`): the host tier drops every block (those still being stored never
        become visible), and the layers that share or keep blocks beyond this start
        stop doing so (`on_identity_change`).

        vLLM's prefix cache may still hold KV of the weights before (a reload
        without a reset); the host tier holds none, so a caller that reset vLLM's
        prefix cache alone, then changed the weights, is served none."""
        self.retention.release_all()
        self.pool.reset()
        for listener in self.on_identity_change:
            try:
                listener(why)
            except Exception:  # noqa: BLE001 - the others must still hear of it
                # A tier that failed to go private makes itself unusable (e.g.
                # `BlockIndex.make_private`); the engine keeps serving.
                logger.exception("CPU offload: a tier failed to hear %r", why)

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
        return self.shared.take_events()

    @property
    def num_jobs_in_flight(self) -> int:
        return len(self._jobs)
