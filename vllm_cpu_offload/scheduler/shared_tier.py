"""The shared store as the scheduler half sees it: block keys in, pool states out.

`SharedTier` asks the store how much of a prefix it holds past the host hit (with
several KV cache groups, which of each group's blocks it holds), names the blocks an
async load fetches and the blocks every store writes through, and settles
both once every worker reported: fetched blocks become visible (or are freed and not
asked for again for a while), and a store's host blocks stay held until every
worker's write-through has read them. It fills the scheduler's `shared` seam
(`tier_seams.py`), which holds `NoSharedTier` without a store.

It never sees a request: the scheduler half keeps what it asked per request.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from vllm_cpu_offload.block_transfer import BlockTransfer, RemoteBlocks
from vllm_cpu_offload.metadata import and_of
from vllm_cpu_offload.remote.namespace import block_key
from vllm_cpu_offload.scheduler.block_pool import BlockKey
from vllm_cpu_offload.scheduler.manager import HostTierManager
from vllm_cpu_offload.scheduler.remote_lookup import RemoteLookup
from vllm_cpu_offload.scheduler.stored_blocks import StoredBlocks
from vllm_cpu_offload.scheduler.tier_seams import NoSharedTier, RemoteTierEvent
from vllm_cpu_offload.scheduler.tier_stats import TierStats

if TYPE_CHECKING:
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler

# A block the shared store listed but did not serve is not asked for again for this
# long (its storage node may have died; a block written again after that is found
# again), and at most this many such keys are remembered.
UNFETCHABLE_FOR_S = 30.0
UNFETCHABLE_MAX_KEYS = 1 << 16


@dataclass(frozen=True)
class _Writing:
    """A store job whose blocks wait until every worker wrote them through."""

    keys: list[BlockKey]
    stored: list[StoredBlocks] | None  # for KV events
    success: bool  # every worker's store succeeded


class SharedTier(NoSharedTier):
    """A store every engine of the fleet shares (see the module docstring)."""

    def __init__(
        self,
        pool: HostTierManager,
        lookup: RemoteLookup,
        namespace: str,
        *,
        num_workers: int,
        stats: TierStats,
        blocks_per_host_block: int,
        block_size: int,
        record_events: bool,
    ) -> None:
        super().__init__(pool)
        self.lookup = lookup
        self.namespace = namespace
        self.num_workers = num_workers
        self.stats = stats
        self.blocks_per_host_block = blocks_per_host_block
        self.tokens_per_key = blocks_per_host_block * block_size
        self.record_events = record_events
        # async job -> for each fetched block, whether it arrived on every worker so
        # far, and how many workers reported
        self._fetch_results: dict[int, list[bool]] = {}
        self._fetch_reports: Counter[int] = Counter()
        # store jobs whose write-through was planned and has not ended everywhere
        self._writes_planned: set[int] = set()
        # store job -> blocks held until every worker wrote them through
        self._writing: dict[int, _Writing] = {}
        self._write_reports: Counter[int] = Counter()
        # store job -> for each block, whether every worker that reported wrote it
        self._write_stored: dict[int, list[bool]] = {}
        self._events: list[RemoteTierEvent] = []
        # key -> until when the store is not asked for it (a fetch of it failed)
        self._unfetchable: OrderedDict[BlockKey, float] = OrderedDict()
        # Set once the weights may have changed at run time (`seal`).
        self.sealed = False

    @property
    def num_held_writes(self) -> int:
        return len(self._writing)

    def seal(self, why: str) -> None:
        """What computes this engine's KV may no longer be what the namespace names
        (`why`): from now on the store is neither asked nor written. Jobs already
        planned settle as usual (the workers refuse their calls)."""
        self.sealed = True

    def remote_key(self, key: BlockKey) -> str:
        group_id, block_hash = cast(tuple[int, Any], key)
        return block_key(self.namespace, group_id, block_hash)

    # ---- lookups and fetches ----

    def hits(self, keys: Iterable[BlockKey]) -> int:
        """How many of `keys` (a prefix's next host blocks, in order) the store holds
        on every rank; a block the pool holds, in any state, or one that failed to
        arrive lately ends the run."""
        if self.sealed:
            return 0
        now = self.lookup.clock()
        asked: list[BlockKey] = []
        for key in keys:
            if key in self.pool or self._unfetchable.get(key, 0.0) > now:
                break
            asked.append(key)
        self.stats.remote_lookup_tokens += len(asked) * self.tokens_per_key
        held = self._ask(asked)
        return next((i for i, ok in enumerate(held) if not ok), len(held))

    def held(self, keys: Iterable[BlockKey]) -> frozenset[BlockKey]:
        """Which of `keys` (any groups' blocks, in any order) the store holds on every
        rank; a key the pool holds, in any state, or one that failed to arrive lately
        is not asked for. Its tokens are counted once per block, whatever the number
        of groups asking for it."""
        if self.sealed:
            return frozenset()
        now = self.lookup.clock()
        asked = [
            key
            for key in keys
            if key not in self.pool and self._unfetchable.get(key, 0.0) <= now
        ]
        blocks = {cast(tuple[int, Any], key)[1] for key in asked}
        self.stats.remote_lookup_tokens += len(blocks) * self.tokens_per_key
        found = self._ask(asked)
        return frozenset(key for key, ok in zip(asked, found, strict=True) if ok)

    def _ask(self, keys: list[BlockKey]) -> list[bool]:
        """For each of `keys`, whether the store holds it on every rank; the
        lookup's failures counted."""
        failures = self.lookup.failures
        found = self.lookup.held([self.remote_key(key) for key in keys])
        self.stats.remote_lookup_failures += self.lookup.failures - failures
        return found

    def fetch(
        self, job_id: int, keys: list[BlockKey], host_blocks: list[int]
    ) -> RemoteBlocks:
        return RemoteBlocks(job_id, [self.remote_key(k) for k in keys], host_blocks)

    def fetch_reported(
        self, job_id: int, fetched: list[BlockKey], arrived: list[bool], reports: int
    ) -> tuple[list[BlockKey], list[BlockKey]] | None:
        """Workers' fetches of `fetched` ended. Once every worker has reported: the
        blocks that arrived on every worker become visible, the rest are freed and not
        asked for again for a while; returns (arrived, missing), else None."""
        both = and_of(self._fetch_results.get(job_id), arrived)
        self._fetch_results[job_id] = both
        self._fetch_reports[job_id] += reports
        if self._fetch_reports[job_id] < self.num_workers:
            return None
        del self._fetch_results[job_id], self._fetch_reports[job_id]
        good = [key for key, ok in zip(fetched, both, strict=True) if ok]
        bad = [key for key, ok in zip(fetched, both, strict=True) if not ok]
        if bad:
            self.pool.complete_store(bad, False)
            self._remember_unfetchable(bad)
            if self.record_events:
                self._events.append(RemoteTierEvent("missing", tuple(bad)))
        if good:
            self.pool.complete_store(good, True)
        self.stats.remote_fetched_blocks += len(good)
        self.stats.remote_missed_blocks += len(bad)
        return good, bad

    def fetch_abandoned(self, job_id: int, fetched: list[BlockKey]) -> None:
        """The job ended before every worker reported its fetch: nothing arrived."""
        super().fetch_abandoned(job_id, fetched)
        self._fetch_results.pop(job_id, None)
        self._fetch_reports.pop(job_id, None)

    def _remember_unfetchable(self, keys: list[BlockKey]) -> None:
        """Blocks the store listed but did not serve are not offered again for a
        while: its index may outlive a dead storage node."""
        until = self.lookup.clock() + UNFETCHABLE_FOR_S
        for key in keys:
            self._unfetchable.pop(key, None)
            self._unfetchable[key] = until
        while len(self._unfetchable) > UNFETCHABLE_MAX_KEYS:
            self._unfetchable.popitem(last=False)

    # ---- write-through ----

    def write_through(
        self, store: BlockTransfer, keys: list[BlockKey], *, first: bool = False
    ) -> list[RemoteBlocks]:
        """What every worker writes to the store once its copy of `store` (of host
        blocks `keys`) is done; `first`: before the writes queued earlier."""
        if self.sealed:
            return []
        self._writes_planned.add(store.job_id)
        k = self.blocks_per_host_block
        host_blocks = [slot // k for slot in store.host_block_ids[::k]]
        remote_keys = [self.remote_key(key) for key in keys]
        return [RemoteBlocks(store.job_id, remote_keys, host_blocks, first)]

    def store_completed(
        self,
        job_id: int,
        keys: list[BlockKey],
        stored: list[StoredBlocks] | None,
        success: bool,
    ) -> None:
        """Every worker's copy of a store ended. A worker whose store succeeded writes
        its blocks through, reading them, whether or not another worker's failed: they
        stay held until every worker's write ended. Those of a store that succeeded
        are visible meanwhile (pinned); those of a failed one stay STORING, then go.
        A store planned without write-through (the store was sealed) settles at once."""
        if job_id not in self._writes_planned:
            super().store_completed(job_id, keys, stored, success)
            return
        if success:
            self.pool.complete_store(keys, True, stored)
            self.pool.pin(keys)
        self._writing[job_id] = _Writing(keys, stored, success)
        self.write_reported(job_id, 0, None)

    def write_reported(
        self, job_id: int, count: int, stored: list[bool] | None
    ) -> None:
        """`count` workers wrote a store job through (or gave up), `stored` saying
        which blocks they wrote: once every worker did, and its copy ended, no worker
        reads its host blocks any more. They may then be evicted (a store that
        succeeded) or freed (one that failed on some worker), and those every worker
        wrote are the store's (a KV event)."""
        if job_id not in self._writes_planned:
            return
        self._write_reports[job_id] += count
        if stored is not None:
            self._write_stored[job_id] = and_of(self._write_stored.get(job_id), stored)
        if job_id not in self._writing:
            return
        if self._write_reports[job_id] < self.num_workers:
            return
        writing = self._writing.pop(job_id)
        self._writes_planned.discard(job_id)
        del self._write_reports[job_id]
        flags = self._write_stored.pop(job_id, None) or [False] * len(writing.keys)
        if not writing.success:
            self.pool.complete_store(writing.keys, False)
            return
        self.pool.unpin(writing.keys)
        if self.record_events and any(flags):
            keys = writing.keys
            written = tuple(key for key, ok in zip(keys, flags, strict=True) if ok)
            whole = len(written) == len(keys)
            self._events.append(
                RemoteTierEvent("stored", written, writing.stored if whole else None)
            )

    def take_events(self) -> list[RemoteTierEvent]:
        """What the store gained or was found to lack since the last call (recorded
        only while KV events are on)."""
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        self.lookup.close()


def attach_shared_tier(
    scheduler: HostTierScheduler, lookup: RemoteLookup, namespace: str
) -> SharedTier:
    """Plugs the store `lookup` asks into the scheduler's `shared` seam."""
    shared = SharedTier(
        scheduler.pool,
        lookup,
        namespace,
        num_workers=scheduler.num_workers,
        stats=scheduler.stats,
        blocks_per_host_block=scheduler.blocks_per_host_block,
        block_size=scheduler.block_size,
        record_events=scheduler.record_stored_blocks,
    )
    scheduler.shared = shared
    return shared
