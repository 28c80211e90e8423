"""The worker half's seam to a tier beyond host memory, and what fills it where no
layer plugs one in.

`HostTierWorker.shared` is the worker's view of a shared store
(`worker/shared_tier.py`): it fetches an async load's missing blocks and writes
stored host blocks through. `NoSharedTierWorker` is the seam without a store: a fetch
ends at once with nothing arrived, and no write is ever planned (the scheduler's
`NoSharedTier` plans none). Every verb returns what ended (`SharedTierDone`); the
worker half applies it, loading what was fetched and reporting the jobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_cpu_offload.block_transfer import AsyncLoad, BlockTransfer, RemoteBlocks


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
    def remote_io(self) -> Any:
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

    def seal(self) -> None:
        """This worker's weights may no longer be those the store's namespace names:
        nothing is written to or fetched from it from now on."""

    def close(self) -> None:
        """Gives queued writes a bounded while to land, then closes the store."""
