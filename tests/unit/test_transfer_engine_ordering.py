"""The transfer engine's stream path on the CPU platform: the engine and copier code
that runs on CUDA, ordered by stand-in streams whose queued copies run only when a test
releases them (`vllm_cpu_offload/testing/held_streams.py`). A host wait for a held
stream fails a test (`HostWaitedForHeldStream`, `host_waits`).

Backends: "kernel" launches one copy per call on the current stream, as the Triton
kernels do (their ordering is all the engine's); "dma" and "staged" are the copy-engine
copiers over stand-in copy calls; "bounce" is the bounce copier over kernel launches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pytest
import torch

from tests.unit.test_transfer_engine import (
    NUM_HOST_BLOCKS,
    FailingCopier,
    _caches,
    _device_block,
    _host_block,
    fails_on_block,
)
from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.testing.held_streams import (
    HeldCopyEngines,
    HeldStream,
    HeldStreams,
    LaunchingCopier,
)
from vllm_cpu_offload.worker.copiers.base import BlockCopier
from vllm_cpu_offload.worker.copiers.bounce import BounceBlockCopier
from vllm_cpu_offload.worker.copiers.dma import DmaBlockCopier
from vllm_cpu_offload.worker.copiers.staged import StagedBlockCopier
from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.transfer_engine import FinishedJobs, TransferEngine

BACKENDS = ("kernel", "dma", "staged", "bounce")
# Two blocks, so that a whole-block copier's job spans two chunks (staged, 1 per chunk).
DEVICE_IDS, HOST_IDS = [4, 1], [0, 2]


@dataclass
class Rig:
    """An engine on held streams, and what makes its launches (and fails one)."""

    streams: HeldStreams
    engine: TransferEngine
    caches: dict[str, torch.Tensor]
    launcher: LaunchingCopier | HeldCopyEngines

    @property
    def first(self) -> str:
        return next(iter(self.caches))

    def stream(self, direction: str) -> HeldStream:
        engine = self.engine
        stream = engine._load_stream if direction == "load" else engine._store_stream
        assert isinstance(stream, HeldStream)
        return stream


def _rig(
    backend: str,
    *,
    wrap: Callable[[BlockCopier], BlockCopier] | None = None,
    fence_stores: bool = False,
) -> Rig:
    """An engine on held streams whose copies go through `backend`; `wrap` wraps the
    CPU copier a launch runs."""
    caches = _caches()
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS, pin=False)
    host.tensor.copy_(torch.randint(0, 256, host.tensor.shape, dtype=torch.uint8))
    streams = HeldStreams()
    engines = HeldCopyEngines(streams)
    launchers: list[LaunchingCopier] = []

    def kernels(c: Mapping[str, torch.Tensor], buffer: HostBuffer) -> BlockCopier:
        inner: BlockCopier = TorchBlockCopier(c, buffer, threads=1)
        launchers.append(LaunchingCopier(wrap(inner) if wrap else inner, streams))
        return launchers[-1]

    copier: BlockCopier
    if backend == "kernel":
        copier = kernels(caches, host)
    elif backend == "dma":
        copier = DmaBlockCopier(caches, host, runtime=engines, streams=streams)
    elif backend == "staged":
        copier = StagedBlockCopier(
            caches, host, chunk_blocks=1, runtime=engines, streams=streams
        )
    else:
        copier = BounceBlockCopier(caches, host, kernels, pin=False, streams=streams)
    engine = TransferEngine(
        caches, host, copier=copier, streams=streams, fence_stores=fence_stores
    )
    return Rig(streams, engine, caches, launchers[0] if launchers else engines)


def _step(rig: Rig, direction: str, jobs: list[BlockTransfer]) -> None:
    """One engine step: loads waited for layer by layer, or every layer's store."""
    engine = rig.engine
    if direction == "load":
        engine.start_loads(jobs)
    for name in rig.caches:
        if direction == "load":
            engine.wait_for_layer_load(name)
        else:
            engine.store_layer(name, jobs)
    engine.finish_step()


def _finished(direction: str, jobs: set[int]) -> FinishedJobs:
    return (
        FinishedJobs(loads=jobs) if direction == "load" else FinishedJobs(stores=jobs)
    )


def _first_pair(rig: Rig, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the job's first copy writes, what it copies there): the first layer of
    device block 4 and host block 0."""
    device = _device_block(rig.caches[rig.first], 4)
    host = _host_block(rig.engine, rig.first, 0).clone()
    return (device, host) if direction == "load" else (host, device)


def _new_sources(rig: Rig, direction: str) -> None:
    """New bytes where the next copies read, so that a copy that ran shows."""
    if direction == "load":
        host = rig.engine.host.tensor
        host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
    else:
        for t in rig.caches.values():
            t.copy_(torch.randn_like(t))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", ["load", "store"])
def test_a_launch_failing_mid_job_fails_it_after_the_queued_copies(
    direction: str, backend: str
) -> None:
    # The job's last launch raises after its first copies were queued behind a held
    # stream: the job is broken at once (the step must not trust what it loads),
    # reported failed, releasing its blocks, only once those copies ran; the host
    # never waits for the held stream.
    rig = _rig(backend)
    engine, streams, stream = rig.engine, rig.streams, rig.stream(direction)
    # Unheld, the same step copies and ends at once; it counts one job's launches.
    _step(rig, direction, [BlockTransfer(9, DEVICE_IDS, HOST_IDS)])
    engine.wait_all()
    assert engine.poll_finished() == _finished(direction, {9})
    rig.launcher.fail_call = 2 * rig.launcher.calls - 1
    _new_sources(rig, direction)
    streams.hold(stream)
    _step(rig, direction, [BlockTransfer(1, DEVICE_IDS, HOST_IDS)])
    assert engine.poll_finished() == FinishedJobs(broken={1})
    assert rig.launcher.calls == rig.launcher.fail_call + 1, "the last launch raised"
    assert stream.waiting, "the step's copies wait behind the held stream"
    written, source = _first_pair(rig, direction)
    assert not torch.equal(written, source)
    # Still held: the job's blocks may still be read or written; it is not failed.
    engine.begin_step()
    assert engine.poll_finished() == FinishedJobs()
    streams.release(stream)
    assert engine.poll_finished() == FinishedJobs(failed={1})
    assert streams.host_waits == []
    if backend != "bounce":  # its one launch was the failed one: nothing was queued
        written, source = _first_pair(rig, direction)
        assert torch.equal(written, source), "a copy queued before the failure ran"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", ["load", "store"])
def test_copies_that_run_late_end_their_job_only_once_they_ran(
    direction: str, backend: str
) -> None:
    # A job's copies are held over several steps (its request may be aborted meanwhile):
    # no poll reports it, so its blocks stay taken, until the copies ran; then it
    # finishes with its bytes in place. No call of the steps waited for them.
    rig = _rig(backend)
    engine, streams, stream = rig.engine, rig.streams, rig.stream(direction)
    streams.hold(stream)
    _step(rig, direction, [BlockTransfer(1, DEVICE_IDS, HOST_IDS)])
    for _ in range(3):
        assert engine.poll_finished() == FinishedJobs()
        engine.begin_step()
        _step(rig, direction, [])
    written, source = _first_pair(rig, direction)
    assert not torch.equal(written, source)
    streams.release(stream)
    engine.wait_all()  # the bounce copier's host hop runs on a thread of its own
    assert engine.poll_finished() == _finished(direction, {1})
    assert streams.host_waits == []
    for name, t in rig.caches.items():
        for d, h in zip(DEVICE_IDS, HOST_IDS, strict=True):
            assert torch.equal(_device_block(t, d), _host_block(engine, name, h))


@pytest.mark.parametrize("backend", ["kernel", "dma"])
def test_each_layer_of_the_forward_waits_for_its_own_load_only(backend: str) -> None:
    # Loads held, the forward queued behind its per-layer waits: releasing the loads
    # layer by layer runs the forward's layers one by one, each after its own load;
    # the job ends with the last.
    rig = _rig(backend)
    engine, streams = rig.engine, rig.streams
    names = list(rig.caches)
    stream = rig.stream("load")
    streams.hold(stream)
    engine.start_loads([BlockTransfer(1, DEVICE_IDS, HOST_IDS)])
    seen: dict[str, torch.Tensor] = {}
    for name, t in rig.caches.items():
        engine.wait_for_layer_load(name)

        def compute(name: str = name, t: torch.Tensor = t) -> None:
            seen[name] = _device_block(t, 4)

        streams.launch(compute)  # the layer's attention reads its loaded block
    engine.finish_step()
    assert seen == {}
    for i, name in enumerate(names):
        assert engine.poll_finished() == FinishedJobs()
        event = engine._load_events[name]
        streams.release(stream, until=event)  # type: ignore[arg-type]
        assert list(seen) == names[: i + 1]
        assert torch.equal(seen[name], _host_block(engine, name, 0))
    assert engine.poll_finished() == FinishedJobs(loads={1})
    assert streams.host_waits == []


def test_a_background_load_held_holds_back_no_step() -> None:
    # A background load whose stream is held: the step's own load and the whole
    # forward run, the step's job is reported; the background one once released.
    rig = _rig("kernel")
    engine, streams = rig.engine, rig.streams
    background = engine._background_stream
    streams.hold(background)
    engine.start_background_loads([BlockTransfer(1, [6], [3])])
    engine.start_loads([BlockTransfer(2, [5], [2])])
    ran: list[str] = []
    for name in rig.caches:
        engine.wait_for_layer_load(name)

        def compute(name: str = name) -> None:
            ran.append(name)

        streams.launch(compute)
    engine.finish_step()
    assert ran == list(rig.caches), "the forward waited for the background load"
    assert engine.poll_finished() == FinishedJobs(loads={2})
    streams.release(background)
    assert engine.poll_finished() == FinishedJobs(loads={1})
    assert streams.host_waits == []


@pytest.mark.parametrize("fence", [False, True])
def test_fenced_steps_start_after_the_stores_still_running(fence: bool) -> None:
    # A store held on its stream: with fence_stores the next step's compute waits for
    # it (a window group may reuse the block it reads); without, it runs at once.
    rig = _rig("kernel", fence_stores=fence)
    streams, stream = rig.streams, rig.stream("store")
    streams.hold(stream)
    _step(rig, "store", [BlockTransfer(1, [4], [0])])
    rig.engine.begin_step()
    ran: list[str] = []
    streams.launch(lambda: ran.append("compute"))  # the next step's first compute
    assert ran == ([] if fence else ["compute"])
    streams.release(stream)
    assert ran == ["compute"]
    assert rig.engine.poll_finished() == FinishedJobs(stores={1})


@pytest.mark.parametrize("direction", ["load", "store"])
def test_a_copy_that_faults_on_the_device_fails_its_job_at_the_poll(
    direction: str,
) -> None:
    # The launch succeeds, the copy itself fails when the stream runs it (CUDA reports
    # such an error at the next query): the job fails then, the step never raised.
    rig = _rig("kernel", wrap=lambda inner: FailingCopier(inner, fails_on_block(4)))
    stream = rig.stream(direction)
    rig.streams.hold(stream)
    _step(rig, direction, [BlockTransfer(1, DEVICE_IDS, HOST_IDS)])
    assert rig.engine.poll_finished() == FinishedJobs()
    rig.streams.release(stream)
    assert rig.engine.poll_finished() == FinishedJobs(failed={1})
    assert rig.streams.host_waits == []
