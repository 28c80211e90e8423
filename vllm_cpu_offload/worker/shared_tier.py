"""The shared store as the worker half sees it: fetches that end in host-tier loads,
and write-throughs of stored host blocks.

`SharedTierWorker` hands an async load's fetch to the store's thread (`RemoteIO`) and,
once it ends, cuts the load to what the host tier holds: its pairs up to the first
fetched host block that did not arrive (vLLM recomputes from there). A load of several
KV cache groups (`AsyncLoad.whole`) is not cut: short of any block it loads nothing,
and it says so (`FetchedLoad.failed`: the worker reports the request in vLLM's
`failed_recving`), as
vLLM's hybrid manager takes no load error of single blocks. It writes a store
job's host blocks through once the job's copy is done here. `NoSharedTierWorker` is the
same seam without a store: a fetch ends at once with nothing arrived, and no write is
ever planned (the scheduler's `NoSharedTier` plans none).

Every verb returns what ended (`SharedTierDone`); the worker half applies it, loading
what was fetched and reporting the jobs, so the store never touches the copies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vllm_cpu_offload.block_transfer import AsyncLoad, BlockTransfer, RemoteBlocks
from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.kv_shards import WorkerShards
from vllm_cpu_offload.remote.store import RemoteStore
from vllm_cpu_offload.worker.block_values import BlockValues
from vllm_cpu_offload.worker.copiers.copy_threads import (
    ThreadsBesideTheModel,
    threads_started_beside_the_model,
)
from vllm_cpu_offload.worker.head_slices import HeadSliceError, HeadSlices
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.remote_io import RemoteIO


@dataclass(frozen=True)
class RemoteSettings:
    """How this worker reaches the shared store (`--swap-space-remote`)."""

    open_store: Callable[[], RemoteStore]
    namespace: str
    # The values this worker reads and writes (`kv_shards.py`).
    shards: WorkerShards
    timeout_s: float


@dataclass(frozen=True)
class FetchedLoad:
    """An async load whose fetch ended, cut to what the host tier holds now.

    Attributes:
        arrived: for each fetched host block, whether it is in host memory now.
        load: the load's pairs before the cut; no pair when nothing is loadable.
        unloaded: the device blocks it leaves unfilled, for vLLM to recompute.
        failed: a whole load (several KV cache groups) short of a block: it loads
            nothing and vLLM recomputes its request.

    """

    arrived: list[bool]
    load: BlockTransfer
    unloaded: list[int]
    failed: bool = False

    @property
    def job_id(self) -> int:
        return self.load.job_id


@dataclass
class SharedTierDone:
    """What the shared tier finished, in the order the worker applies it."""

    fetched: list[FetchedLoad] = field(default_factory=list)
    # store job -> for each of its blocks, whether the store holds it now
    written: dict[int, list[bool]] = field(default_factory=dict)


def _cut(async_load: AsyncLoad, cut: int, arrived: list[bool]) -> FetchedLoad:
    load = async_load.load
    return FetchedLoad(
        arrived=arrived,
        load=BlockTransfer(
            load.job_id,
            load.device_block_ids[:cut],
            load.host_block_ids[:cut],
            req_id=load.req_id,
        ),
        unloaded=[*load.device_block_ids[cut:], *async_load.unloadable],
    )


class NoSharedTierWorker:
    """No store: a fetch ends at once with nothing arrived; nothing is written."""

    @property
    def remote_io(self) -> RemoteIO | None:
        """The store's thread (tests wait for it and read what it registered)."""
        return None

    @property
    def num_jobs_in_flight(self) -> int:
        """Fetches and write-throughs planned and not reported yet."""
        return 0

    def plan_writes(self, writes: Sequence[RemoteBlocks]) -> None:
        """Takes a step's write-throughs; each starts once its store job is done."""
        assert not writes, "write-throughs planned without a shared store"

    def fetch(self, async_load: AsyncLoad) -> SharedTierDone:
        """Starts fetching the hit's missing blocks; returns what ended at once."""
        nothing = [False] * len(async_load.fetch.keys)
        return SharedTierDone(
            fetched=[self._ended(async_load, async_load.fetched_from, nothing)]
        )

    def _ended(
        self, async_load: AsyncLoad, cut: int, arrived: list[bool]
    ) -> FetchedLoad:
        """The load cut at pair `cut`; a whole load short of any block loads
        nothing, and its request is failed."""
        load = async_load.load
        if async_load.whole and (
            cut < len(load.device_block_ids) or len(async_load.unloadable) > 0
        ):
            return FetchedLoad(
                arrived=arrived,
                load=BlockTransfer(load.job_id, [], [], req_id=load.req_id),
                unloaded=[],
                failed=True,
            )
        return _cut(async_load, cut, arrived)

    def place_threads(self, *, idle: bool) -> None:
        """Lends the store's threads the model's cores in an `idle` step that waits
        for fetches; takes them back otherwise."""

    def copy_ended(self, job_id: int, *, stored: bool) -> SharedTierDone:
        """Copy job `job_id` ended here (`stored`: it succeeded); a store job's host
        blocks are now what its write-through reads. Returns what ended at once."""
        return SharedTierDone()

    def poll(self, *, idle: bool) -> SharedTierDone:
        """What ended since the last poll. An `idle` step first waits a bounded while
        for a fetch: it would otherwise return at once and the engine would spin."""
        return SharedTierDone()

    def take_stats(self) -> dict[str, float]:
        """The store's counters since the last call, each named `remote_*`."""
        return {}

    def close(self) -> None:
        """Gives queued writes a bounded while to land, then closes the store."""


class SharedTierWorker(NoSharedTierWorker):
    """One worker's seam to a store every engine of the fleet shares (see the module
    docstring). Every verb is O(blocks of its job)."""

    def __init__(
        self,
        io: RemoteIO,
        store_threads: ThreadsBesideTheModel | None,
        *,
        blocks_per_host_block: int,
        idle_fetch_wait_s: float,
        writes_through: bool = True,
    ) -> None:
        self._io = io
        self.writes_through = writes_through
        # None where the model has no cores beside it.
        self._store_threads = store_threads
        self.blocks_per_host_block = blocks_per_host_block
        self.idle_fetch_wait_s = idle_fetch_wait_s
        # async load -> its plan, until its fetch ends
        self._async_loads: dict[int, AsyncLoad] = {}
        # store job -> what to write through once it is done here
        self._writes: dict[int, RemoteBlocks] = {}
        self._stats: Counter[str] = Counter()

    @property
    def remote_io(self) -> RemoteIO:
        return self._io

    @property
    def num_jobs_in_flight(self) -> int:
        return len(self._async_loads) + len(self._writes)

    def plan_writes(self, writes: Sequence[RemoteBlocks]) -> None:
        for write in writes:
            self._writes[write.job_id] = write

    def fetch(self, async_load: AsyncLoad) -> SharedTierDone:
        if not async_load.fetch.keys:
            return super().fetch(async_load)
        self._async_loads[async_load.load.job_id] = async_load
        self._io.fetch(async_load.fetch)
        return SharedTierDone()

    def place_threads(self, *, idle: bool) -> None:
        if self._store_threads is None:
            return
        if idle and self._async_loads:
            self._store_threads.spread()
        else:
            self._store_threads.gather()

    def copy_ended(self, job_id: int, *, stored: bool) -> SharedTierDone:
        write = self._writes.pop(job_id, None)
        if write is None:
            return SharedTierDone()
        if not stored:
            # Its host blocks hold no good copy: nothing to write.
            return SharedTierDone(written={job_id: [False] * len(write.keys)})
        if not self.writes_through:
            # Another rank writes the one value these replicated blocks have.
            return SharedTierDone(written={job_id: [True] * len(write.keys)})
        # `poll` reports it, even when the queue is full and it is dropped.
        self._io.write(write)
        return SharedTierDone()

    def poll(self, *, idle: bool) -> SharedTierDone:
        if idle and self._async_loads:
            self._io.wait_for_fetch(self.idle_fetch_wait_s)
        results = self._io.poll()
        done = SharedTierDone(written=results.written)
        for job_id, arrived in results.fetched.items():
            async_load = self._async_loads.pop(job_id, None)
            if async_load is not None:
                done.fetched.append(self._fetched(async_load, arrived))
        self._stats.update(results.stats)
        return done

    def _fetched(self, async_load: AsyncLoad, arrived: list[bool]) -> FetchedLoad:
        """Cuts the load at its first pair whose host block, or a fetched one before
        it, did not arrive: vLLM recomputes from there."""
        k = self.blocks_per_host_block
        arrived_blocks = set()
        for host_block, ok in zip(async_load.fetch.host_blocks, arrived, strict=True):
            if not ok:
                break
            arrived_blocks.add(host_block)
        load, cut = async_load.load, async_load.fetched_from
        while (
            cut < len(load.device_block_ids)
            and load.host_block_ids[cut] // k in arrived_blocks
        ):
            cut += 1
        return self._ended(async_load, cut, arrived)

    def take_stats(self) -> dict[str, float]:
        stats: dict[str, float] = {
            f"remote_{name}": value for name, value in self._stats.items()
        }
        self._stats = Counter()
        return stats

    def close(self) -> None:
        # Other engines may read the writes soon; past the wait they are dropped,
        # as the store is a cache.
        self._io.wait_idle(2 * self._io.timeout_s)
        self._io.close()


def open_shared_tier_worker(
    settings: RemoteSettings | None,
    host: HostBuffer,
    kv_caches: dict[str, torch.Tensor],
    *,
    num_device_blocks: int,
    blocks_per_host_block: int,
    idle_fetch_wait_s: float,
) -> NoSharedTierWorker:
    """This worker's seam to the store `settings` name (none: `NoSharedTierWorker`),
    connected to `host` (made for `kv_caches`)."""
    if settings is None:
        return NoSharedTierWorker()
    k = blocks_per_host_block
    values = block_values_of(
        settings.shards,
        host,
        kv_caches,
        num_device_blocks=num_device_blocks,
        blocks_per_host_block=k,
    )
    # The store's threads (and its client's) write through while the model computes:
    # off the model's cores where the machine has others.
    with threads_started_beside_the_model() as store_threads:
        io = RemoteIO(
            settings.open_store(),
            host,
            values,
            namespace=settings.namespace,
            timeout_s=settings.timeout_s,
            # Queued writes pin their host blocks: at most a quarter of the tier.
            max_queued_writes=max(1, host.num_slots // k // 4),
        )
    return SharedTierWorker(
        io,
        store_threads,
        blocks_per_host_block=k,
        idle_fetch_wait_s=idle_fetch_wait_s,
        writes_through=settings.shards.writes,
    )


def block_values_of(
    shards: WorkerShards,
    host: HostBuffer,
    kv_caches: dict[str, torch.Tensor],
    *,
    num_device_blocks: int,
    blocks_per_host_block: int,
) -> BlockValues:
    """How this worker's host blocks are cut into `shards`' values.

    Raises:
        OffloadConfigError: values are per KV head, and a layer's cache cannot be cut
            so (its head count differs from the model's).

    """
    slices = None
    if shards.per_head:
        try:
            slices = HeadSlices.for_kv_caches(
                host,
                kv_caches,
                num_heads=len(shards.names),
                num_blocks=num_device_blocks,
                blocks_per_host_block=blocks_per_host_block,
            )
        except HeadSliceError as e:
            raise OffloadConfigError(
                f"--swap-space-remote stores one value per KV head, but {e}; drop "
                "--swap-space-remote for this model"
            ) from e
    return BlockValues(
        host, shards.names, blocks_per_host_block=blocks_per_host_block, slices=slices
    )
