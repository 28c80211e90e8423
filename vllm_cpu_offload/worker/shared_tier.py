"""The shared store as the worker half sees it: fetches that end in host-tier loads,
and write-throughs of stored host blocks.

`SharedTierWorker` hands an async load's fetch to the store's thread (`RemoteIO`) and,
once it ends, cuts the load to what the host tier holds: its pairs up to the first
fetched host block that did not arrive (vLLM recomputes from there). A load of several
KV cache groups (`AsyncLoad.whole`) is not cut: short of any block it loads nothing,
and it says so (`FetchedLoad.failed`: the worker reports the request in vLLM's
`failed_recving`), as
vLLM's hybrid manager takes no load error of single blocks. It writes a store
job's host blocks through once the job's copy is done here. It fills the worker's
`shared` seam (`worker/tier_seams.py`), which holds `NoSharedTierWorker` without a
store.

Every verb returns what ended (`SharedTierDone`); the worker half applies it, loading
what was fetched and reporting the jobs, so the store never touches the copies.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_cpu_offload.block_transfer import AsyncLoad, RemoteBlocks
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
from vllm_cpu_offload.worker.tier_seams import (
    FetchedLoad,
    NoSharedTierWorker,
    SharedTierDone,
)

if TYPE_CHECKING:
    from vllm_cpu_offload.worker.tier_worker import HostTierWorker

# How long a step in which no request computes waits for a fetch to end. Such a step
# would otherwise return at once, and the engine would spin on empty steps, taking the
# cores the store's transfer needs; a request that arrives meanwhile waits at most this.
IDLE_FETCH_WAIT_S = 0.01


@dataclass(frozen=True)
class RemoteSettings:
    """How this worker reaches the shared store (`--swap-space-remote`)."""

    open_store: Callable[[], RemoteStore]
    namespace: str
    # The values this worker reads and writes (`kv_shards.py`).
    shards: WorkerShards
    timeout_s: float
    idle_fetch_wait_s: float = IDLE_FETCH_WAIT_S


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

    def seal(self) -> None:
        self._io.seal()

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


def attach_shared_tier_worker(worker: HostTierWorker, settings: RemoteSettings) -> None:
    """The worker reaches the store `settings` name once its host buffer exists."""
    worker.open_shared_tier = functools.partial(
        open_shared_tier_worker,
        settings,
        num_device_blocks=worker.num_device_blocks,
        blocks_per_host_block=worker.blocks_per_host_block,
    )


def open_shared_tier_worker(
    settings: RemoteSettings,
    host: HostBuffer,
    kv_caches: dict[str, torch.Tensor],
    *,
    num_device_blocks: int,
    blocks_per_host_block: int,
) -> SharedTierWorker:
    """This worker's seam to the store `settings` name, connected to `host` (made for
    `kv_caches`)."""
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
        idle_fetch_wait_s=settings.idle_fetch_wait_s,
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
