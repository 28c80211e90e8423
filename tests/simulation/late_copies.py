"""A worker's copies as a GPU runs them, on the CPU: later, and failing on command.

On the CPU platform the transfer engine copies synchronously. On CUDA a store runs on
its stream after the step, and a background load whenever its stream gets to it: the
device blocks are read or written later, and the job is reported only then. This
wrapper gives the engine that timing: store batches and background loads run at a later
tick chosen by the world (or when the worker waits for every copy, as `wait_all`
does), and a copy may raise part-way through its layers. A block freed too early then
shows: its late copy reads or writes another request's KV, which the oracle catches.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.remote.store import Span
from vllm_cpu_offload.worker.copiers.select import Copiers
from vllm_cpu_offload.worker.transfer_engine import FinishedJobs, TransferEngine


class CopyFaults:
    """Which copies fail now: set by the world each step for each rank."""

    def __init__(self) -> None:
        self.fail_loads = False
        self.fail_stores = False
        self.at_layer = 0  # layers before it are copied, then the copy raises


class _FaultyCopier:
    def __init__(self, inner: Any, faults: CopyFaults, layers: list[str]) -> None:
        self.inner, self.faults, self.layers = inner, faults, layers
        for name in ("ids_on_host", "loads_whole_blocks"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> Any:
        fail = self.faults.fail_stores if to_host else self.faults.fail_loads
        if not fail:
            return self.inner.copy(to_host, device_ids, host_ids, layers)
        names = list(layers) if layers is not None else self.layers
        done = names[: self.faults.at_layer]
        if done:
            self.inner.copy(to_host, device_ids, host_ids, done)
        raise RuntimeError("injected copy failure")


@dataclass
class _Late:
    due: int
    run: Callable[[], None]
    is_load: bool = False


class LateCopies:
    """Wraps one worker's `TransferEngine` (see the module docstring)."""

    def __init__(
        self,
        engine: TransferEngine,
        rng: random.Random,
        faults: CopyFaults,
        spans_in_use: Callable[[], list[Span]],
        violation: Callable[[str], None],
    ) -> None:
        self.engine = engine
        self.rng = rng
        self.tick = 0
        self.max_delay = 3
        self._late: list[_Late] = []
        self._held_stores: set[int] = set()  # reported only once their copy ran
        # Held stores the engine already called done: reported once they ran.
        self._engine_done_later: set[int] = set()
        self._spans_in_use = spans_in_use
        self._violation = violation
        layers = list(engine._layers)
        engine.copiers = Copiers(
            _FaultyCopier(engine.copiers.loads, faults, layers),
            _FaultyCopier(engine.copiers.stores, faults, layers),
        )
        self._run_sync = engine._run_sync
        self._start_background_loads = engine.start_background_loads
        self._poll_finished = engine.poll_finished
        self._wait_all = engine.wait_all
        engine._run_sync = self._deferred_run_sync  # type: ignore[method-assign]
        engine.start_background_loads = self._deferred_background  # type: ignore[method-assign]
        engine.poll_finished = self._poll  # type: ignore[method-assign]
        engine.wait_all = self._wait_everything  # type: ignore[method-assign]

    @property
    def num_late(self) -> int:
        return len(self._late)

    @property
    def num_late_loads(self) -> int:
        """Background loads started (as a CUDA launch queues them) and not yet run."""
        return sum(late.is_load for late in self._late)

    def advance(self, tick: int) -> None:
        self.tick = tick
        due = [late for late in self._late if late.due <= tick]
        self._late = [late for late in self._late if late.due > tick]
        for late in due:
            late.run()

    def _delay(self) -> int:
        return self.tick + self.rng.randint(0, self.max_delay)

    def _deferred_run_sync(self, to_host: bool, batch: Any) -> None:
        if not to_host:
            self._run_sync(to_host, batch)
            return
        jobs = list(batch.job_ids)
        self._held_stores.update(jobs)

        def run() -> None:
            self._check_host_blocks(batch.host_ids)
            self._run_sync(to_host, batch)
            # `_run_sync` drops the jobs that failed from the batch: those are in the
            # engine's failed set already.
            self._held_stores.difference_update(jobs)

        self._late.append(_Late(self._delay(), run))

    def _deferred_background(self, jobs: Sequence[BlockTransfer]) -> None:
        jobs = list(jobs)
        self._late.append(
            _Late(self._delay(), lambda: self._start_background_loads(jobs), True)
        )

    def _poll(self) -> FinishedJobs:
        finished = self._poll_finished()
        held = finished.stores & self._held_stores
        if held:
            # Not run yet: the engine counted them as done at `finish_step`.
            finished.stores -= held
            self._engine_done_later |= held
        ready = self._engine_done_later - self._held_stores
        if ready:
            finished.stores |= ready - finished.failed
            self._engine_done_later -= ready
        return finished

    def _wait_everything(self) -> None:
        late, self._late = self._late, []
        for entry in late:
            entry.run()
        self._wait_all()

    def _check_host_blocks(self, host_ids: torch.Tensor) -> None:
        """No store copy may write a host block that a store call still reads or
        writes."""
        host = self.engine.host
        base, size = host.tensor.data_ptr(), host.block_bytes
        used = self._spans_in_use()
        if not used:
            return
        for h in host_ids.tolist():
            start = base + h * size
            for span in used:
                if span.address < start + size and start < span.address + span.size:
                    self._violation(
                        f"host block {h} rewritten while a store call uses it"
                    )
                    return
