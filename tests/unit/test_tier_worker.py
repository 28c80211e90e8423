"""The worker half on CPU tensors: steps, reports, delayed frees and faults."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.fault_injection import FaultInjector  # noqa: E402
from vllm_cpu_offload.block_transfer import AsyncLoad, RemoteBlocks  # noqa: E402
from vllm_cpu_offload.metadata import BlockTransfer, OffloadStepMetadata  # noqa: E402
from vllm_cpu_offload.testing.held_streams import (  # noqa: E402
    HeldStreams,
    LaunchingCopier,
)
from vllm_cpu_offload.worker.copiers.torch_views import (  # noqa: E402
    TorchBlockCopier,
)
from vllm_cpu_offload.worker.tier_worker import HostTierWorker  # noqa: E402
from vllm_cpu_offload.worker.transfer_engine import TransferEngine  # noqa: E402

LAYERS, BLOCKS, HOST_BLOCKS = 2, 8, 4


def _worker() -> tuple[HostTierWorker, dict[str, torch.Tensor]]:
    # vLLM's CPU layout: [blocks, kv_heads, block_size, 2 * head_dim] per layer.
    caches = {f"l{i}": torch.randn(BLOCKS, 2, 4, 16) for i in range(LAYERS)}
    worker = HostTierWorker(HOST_BLOCKS, BLOCKS)
    worker.register_kv_caches(caches)
    return worker, caches


def _step(worker: HostTierWorker, meta: OffloadStepMetadata) -> set[str] | None:
    worker.begin_step(meta)
    worker.start_loads(meta)
    for i in range(LAYERS):
        worker.wait_for_layer_load(f"l{i}")
        worker.save_layer(f"l{i}")
    worker.finish_step()
    return worker.get_finished()[0]


def test_store_then_load_round_trips_the_bytes_and_reports_both_jobs() -> None:
    # Store device block 5 into host block 2, load it back into device block 1.
    worker, caches = _worker()
    expected = {name: t[5].clone() for name, t in caches.items()}
    _step(worker, OffloadStepMetadata(stores=[BlockTransfer(1, [5], [2], "a")]))
    _step(worker, OffloadStepMetadata(loads=[BlockTransfer(2, [1], [2], "b")]))
    for name, t in caches.items():
        assert torch.equal(t[1], expected[name])
    report = worker.take_report()
    assert (
        report is not None
        and dict(report.finished) == {1: 1, 2: 1}
        and not report.failed
    )
    assert worker.take_report() is None
    stats = worker.take_stats()
    assert stats is not None and stats["store_seconds"] > 0


def test_failed_load_reports_its_device_blocks_for_recompute() -> None:
    # A host id out of range fails its job only; vLLM is told which device
    # blocks to redo.
    worker, _ = _worker()
    meta = OffloadStepMetadata(
        loads=[
            BlockTransfer(7, [3, 4], [0, HOST_BLOCKS + 5], "a"),
            BlockTransfer(8, [6], [1], "b"),
        ]
    )
    _step(worker, meta)
    assert worker.take_load_errors() == {3, 4}
    report = worker.take_report()
    assert (
        report is not None
        and dict(report.failed) == {7: 1}
        and dict(report.finished) == {8: 1}
    )


def test_delayed_free_is_reported_once_the_request_has_no_store_left() -> None:
    # The scheduler held request a's blocks; the worker releases a once its
    # stores are done.
    worker, _ = _worker()
    assert (
        _step(worker, OffloadStepMetadata(stores=[BlockTransfer(1, [2], [0], "a")]))
        is None
    )
    assert _step(worker, OffloadStepMetadata(delayed_free_req_ids=["a"])) == {"a"}
    assert _step(worker, OffloadStepMetadata()) is None


def test_injected_faults_fail_the_chosen_share_uncopied() -> None:
    # A test's injector at share 1: every load and store fails, nothing is copied, the
    # load's device blocks go back to vLLM for recompute, the request is not held.
    worker, caches = _worker()
    worker.faults = FaultInjector(1.0)
    before = {name: t.clone() for name, t in caches.items()}
    meta = OffloadStepMetadata(
        stores=[BlockTransfer(1, [5], [2], "a")],
        loads=[BlockTransfer(2, [1], [3], "b")],
    )
    _step(worker, meta)
    assert all(torch.equal(t, before[name]) for name, t in caches.items())
    assert worker.take_load_errors() == {1}
    report = worker.take_report()
    assert (
        report is not None
        and dict(report.failed) == {1: 1, 2: 1}
        and not report.finished
    )
    assert _step(worker, OffloadStepMetadata(delayed_free_req_ids=["a"])) == {"a"}


def test_an_aborted_requests_blocks_are_freed_only_once_its_held_store_ran() -> None:
    # Request a's store is queued on a held stream (the stand-in of a busy CUDA store
    # stream); vLLM then aborts a, its device blocks held by the scheduler: no step
    # reports a free while the store may still read them, none waits for the stream,
    # and the first step after the store ran reports both.
    worker, caches = _worker()
    assert worker.engine is not None
    streams = HeldStreams()
    copier = LaunchingCopier(
        TorchBlockCopier(caches, worker.engine.host, threads=1), streams
    )
    worker.engine = TransferEngine(
        caches, worker.engine.host, copier=copier, streams=streams
    )
    store_stream = worker.engine._store_stream
    streams.hold(store_stream)
    expected = {name: t[5].clone() for name, t in caches.items()}
    stores = [BlockTransfer(1, [5], [2], "a")]
    assert _step(worker, OffloadStepMetadata(stores=stores)) is None
    assert _step(worker, OffloadStepMetadata(delayed_free_req_ids=["a"])) is None
    assert _step(worker, OffloadStepMetadata()) is None
    assert worker.take_report() is None
    streams.release(store_stream)
    assert _step(worker, OffloadStepMetadata()) == {"a"}
    report = worker.take_report()
    assert report is not None and dict(report.finished) == {1: 1}
    for name in caches:
        host_block = worker.engine.host.layer_view(name)[2]
        assert torch.equal(host_block, expected[name].view(-1).view(torch.uint8))
    assert streams.host_waits == []


def test_loads_planned_before_the_scheduler_heard_of_a_weight_change_are_refused() -> (
    None
):
    # The weights change between steps; the next step was planned before the
    # scheduler half heard of it, from host blocks of the weights before: its load
    # is reported failed and its device block is recomputed, uncopied. A step
    # planned after the scheduler heard loads again.
    worker, caches = _worker()
    _step(worker, OffloadStepMetadata(stores=[BlockTransfer(1, [5], [2], "a")]))
    worker.weights_changed("reload_weights")
    before = {name: t[1].clone() for name, t in caches.items()}
    _step(worker, OffloadStepMetadata(loads=[BlockTransfer(2, [1], [2], "b")]))
    assert all(torch.equal(t[1], before[name]) for name, t in caches.items())
    assert worker.take_load_errors() == {1}
    report = worker.take_report()
    assert report is not None and dict(report.failed) == {2: 1}
    assert report.epochs == {worker.token: 1}
    heard = OffloadStepMetadata(
        loads=[BlockTransfer(3, [1], [2], "b")], epochs_heard={worker.token: 1}
    )
    _step(worker, heard)
    assert all(torch.equal(t[1], t[5]) for t in caches.values())
    report = worker.take_report()
    assert report is not None and dict(report.finished) == {3: 1}


def _streamed_worker() -> tuple[HostTierWorker, dict[str, torch.Tensor], HeldStreams]:
    """A worker whose engine runs the CUDA stream path on held stand-ins."""
    worker, caches = _worker()
    assert worker.engine is not None
    streams = HeldStreams()
    copier = LaunchingCopier(
        TorchBlockCopier(caches, worker.engine.host, threads=1), streams
    )
    worker.engine = TransferEngine(
        caches, worker.engine.host, copier=copier, streams=streams
    )
    return worker, caches, streams


def _host_only_async_load(job_id: int, device: int, host: int) -> AsyncLoad:
    load = BlockTransfer(job_id, [device], [host], "b")
    return AsyncLoad(load, RemoteBlocks(job_id, [], []), fetched_from=1)


def test_an_async_load_whose_copy_runs_when_the_weights_change_is_refused() -> None:
    # A host-only async load starts its copy on the background stream (held: the
    # copy runs across steps, as on CUDA); the weights change before it ends. Its
    # result is of the weights before: the job is reported failed, its device block
    # recomputed, the request reported done so vLLM schedules the recompute.
    worker, caches, streams = _streamed_worker()
    assert worker.engine is not None
    _step(worker, OffloadStepMetadata(stores=[BlockTransfer(1, [5], [2], "a")]))
    background = worker.engine._background_stream
    streams.hold(background)
    _step(worker, OffloadStepMetadata(async_loads=[_host_only_async_load(2, 1, 2)]))
    assert worker.get_finished() == (None, None)
    worker.weights_changed("reload_weights")
    streams.release(background)
    assert worker.get_finished() == (None, {"b"})
    assert worker.take_load_errors() == {1}
    report = worker.take_report()
    assert report is not None and dict(report.failed) == {2: 1}
    assert not report.finished.get(2)
    # Planned once the scheduler half heard of the change, the same load is taken.
    heard = OffloadStepMetadata(
        async_loads=[_host_only_async_load(3, 1, 2)], epochs_heard={worker.token: 1}
    )
    _step(worker, heard)
    report = worker.take_report()
    assert report is not None and dict(report.finished) == {3: 1}
    assert worker.take_load_errors() == set()
    assert all(torch.equal(t[1], t[5]) for t in caches.values())
    assert streams.host_waits == []
