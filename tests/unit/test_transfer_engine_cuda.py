"""TransferEngine's CUDA stream path, with each CUDA copier (skipped without CUDA)."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from tests.unit.test_transfer_engine import (
    NUM_HOST_BLOCKS,
    FailingCopier,
    _caches,
    _device_block,
    _host_block,
    _store_step,
    fails_at_layer,
    fails_on_block,
)
from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.worker.copiers.base import BlockCopier
from vllm_cpu_offload.worker.copiers.device_streams import Stream
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.transfer_engine import FinishedJobs, TransferEngine


class _StreamGate:
    """Holds a CUDA stream at the point it is made until `open()`: the stream waits
    (`cuStreamWaitValue32`) for a word of pinned host memory that only the host sets,
    so what is queued behind it cannot run, however long the host takes. A host call
    that waits for the stream would hang on it; a watchdog opens the gate after two
    minutes so that such a call fails the test instead (`opened_by_watchdog`)."""

    _GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ

    def __init__(self, stream: Stream) -> None:
        self._word = torch.zeros(1, dtype=torch.int32).pin_memory()
        self.opened_by_watchdog = False
        libcuda = ctypes.CDLL("libcuda.so.1")
        wait = getattr(libcuda, "cuStreamWaitValue32_v2", None)
        if wait is None:
            wait = libcuda.cuStreamWaitValue32
        wait.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_uint32,
            ctypes.c_uint,
        ]
        code = wait(stream.cuda_stream, self._word.data_ptr(), 1, self._GEQ)
        if code != 0:
            pytest.skip(f"cuStreamWaitValue32 is unavailable (CUresult {code})")
        self._watchdog = threading.Timer(120, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        self.opened_by_watchdog = True
        self._word[0] = 1

    def open(self) -> None:
        self._watchdog.cancel()
        self._word[0] = 1


# ---- the stream path (needs CUDA) ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_copier(
    kind: str, caches: dict[str, torch.Tensor], host: HostBuffer
) -> BlockCopier:
    if kind == "triton":
        from vllm_cpu_offload.worker.copiers.triton_kernels import TritonBlockCopier

        return TritonBlockCopier(caches, host)
    from vllm_cpu_offload.worker.copiers.cuda_runtime import cuda_runtime
    from vllm_cpu_offload.worker.copiers.dma import DmaBlockCopier
    from vllm_cpu_offload.worker.copiers.staged import StagedBlockCopier

    if not cuda_runtime().available:
        pytest.skip(cuda_runtime().why_unavailable)
    if kind == "staged":
        return StagedBlockCopier(caches, host, chunk_blocks=1)
    return DmaBlockCopier(caches, host)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["triton", "dma", "staged"])
def test_cuda_step_loads_layer_by_layer_and_stores_async(kind: str) -> None:
    # One step on streams: loads land before compute reads them; stores finish later.
    caches = _caches("cuda")
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    host.tensor.zero_()
    engine = TransferEngine(caches, host, copier=_cuda_copier(kind, caches, host))
    engine.host.tensor.copy_(
        torch.randint(0, 256, engine.host.tensor.shape, dtype=torch.uint8)
    )
    engine.start_loads([BlockTransfer(1, [5, 1], [2, 4])])
    stores = [BlockTransfer(2, [3], [0])]
    for name, t in caches.items():
        engine.wait_for_layer_load(name)
        t[3].add_(1)  # "compute" writes this layer's KV, then its store is queued
        engine.store_layer(name, stores)
        assert torch.equal(_device_block(t, 5), _host_block(engine, name, 2))
    engine.finish_step()
    engine.wait_all()
    assert engine.poll_finished() == FinishedJobs(stores={2}, loads={1})
    for name, t in caches.items():
        assert torch.equal(_host_block(engine, name, 0), _device_block(t, 3))


@pytest.mark.cuda
@cuda
def test_cuda_background_loads_hold_back_no_step() -> None:
    # A background load whose stream is held (a gate queued before it, opened only by
    # the test) is not waited for by the host, the step's own loads, compute or
    # finish_step: the step ends on the device while the load cannot have run; it is
    # reported once the gate opens and it has.
    caches = _caches("cuda")
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    host.tensor.copy_(torch.randint(0, 256, host.tensor.shape, dtype=torch.uint8))
    engine = TransferEngine(caches, host, copier=_cuda_copier("triton", caches, host))

    def step(background_job: int, step_job: int) -> None:
        engine.start_background_loads([BlockTransfer(background_job, [6], [0])])
        engine.start_loads([BlockTransfer(step_job, [5], [2])])
        for name, t in caches.items():
            engine.wait_for_layer_load(name)
            t[3].add_(1)
        engine.finish_step()

    # The same step once ungated: a kernel's first launch loads its module, which
    # waits for the device (the gate included); serving starts with them loaded.
    step(3, 4)
    engine.wait_all()
    assert engine.poll_finished() == FinishedJobs(loads={3, 4})
    gate = _StreamGate(engine._background_stream)
    try:
        step(1, 2)
        torch.cuda.current_stream().synchronize()  # the step, not the background load
        assert not gate.opened_by_watchdog, "a call waited for the background stream"
        assert engine.poll_finished().loads == {2}
    finally:
        gate.open()
    engine.wait_all()
    assert engine.poll_finished() == FinishedJobs(loads={1})
    for name, t in caches.items():
        assert torch.equal(_device_block(t, 6), _host_block(engine, name, 0))
        assert torch.equal(_device_block(t, 5), _host_block(engine, name, 2))


@pytest.mark.cuda
@cuda
def test_cuda_failed_launch_is_reported() -> None:
    caches = _caches("cuda")
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    from vllm_cpu_offload.worker.copiers.triton_kernels import TritonBlockCopier

    engine = TransferEngine(
        caches,
        host,
        copier=FailingCopier(TritonBlockCopier(caches, host), fails_on_block(4)),
    )
    engine.start_loads([BlockTransfer(1, [4], [0])])
    _store_step(engine, list(caches), [BlockTransfer(2, [1], [1])])
    engine.wait_all()
    assert engine.poll_finished() == FinishedJobs(stores={2}, failed={1}, broken={1})


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("direction", ["load", "store"])
def test_cuda_a_launch_failing_at_a_layer_fails_its_job_after_the_queued_ones(
    direction: str,
) -> None:
    # The copy of the last layer raises after the first layers' copies were queued on
    # a held stream: the job is broken at once (this step must not trust its loaded
    # blocks) but reported failed, releasing its blocks, only once those copies ran.
    # No host call waits for the held stream. (On CPU, for every copier:
    # test_transfer_engine_ordering.py.)
    caches = _caches("cuda")
    names = list(caches)
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    from vllm_cpu_offload.worker.copiers.triton_kernels import TritonBlockCopier

    # Once armed, the last layer's copy raises. The copier never reads the block ids
    # on the host: they are on the device, behind the held stream.
    armed: list[bool] = []
    last_layer = fails_at_layer(names[-1])
    copier = FailingCopier(
        TritonBlockCopier(caches, host),
        lambda device_ids, layers: bool(armed) and last_layer(device_ids, layers),
    )
    engine = TransferEngine(caches, host, copier=copier)
    stream = engine._load_stream if direction == "load" else engine._store_stream

    def step(job_id: int) -> None:
        if direction == "load":
            engine.start_loads([BlockTransfer(job_id, [4], [0])])
            for name in names:
                engine.wait_for_layer_load(name)
            engine.finish_step()
        else:
            _store_step(engine, names, [BlockTransfer(job_id, [4], [0])])

    # The same step ungated first: a kernel's first launch loads its module, which
    # waits for the device (the gate included), and the ids' pinned memory is cached.
    step(9)
    engine.wait_all()
    assert engine.poll_finished() in (
        FinishedJobs(loads={9}),
        FinishedJobs(stores={9}),
    )
    armed.append(True)
    gate = _StreamGate(stream)
    try:
        step(1)
        first = engine.poll_finished()
        assert not gate.opened_by_watchdog, "a host call waited for the held stream"
        assert first == FinishedJobs(broken={1}), first
    finally:
        gate.open()
    engine.wait_all()
    assert engine.poll_finished() == FinishedJobs(failed={1})


@pytest.mark.cuda
@cuda
def test_cuda_backend_choice() -> None:
    # "auto": loads on the kernels; stores on the copy engines once runs reach 64 KiB.
    from vllm_cpu_offload.worker.copiers.cuda_runtime import cuda_runtime
    from vllm_cpu_offload.worker.copiers.dma import DmaBlockCopier
    from vllm_cpu_offload.worker.copiers.triton_kernels import TritonBlockCopier

    dma = DmaBlockCopier if cuda_runtime().available else TritonBlockCopier
    caches = _caches("cuda")
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    auto = TransferEngine(caches, host)
    assert isinstance(auto.copiers.loads, TritonBlockCopier)
    assert isinstance(auto.copiers.stores, TritonBlockCopier)
    triton = TransferEngine(caches, host, backend="triton")
    assert isinstance(triton.copiers.stores, TritonBlockCopier)
    forced = TransferEngine(caches, host, backend="dma")
    assert isinstance(forced.copiers.loads, dma) and isinstance(
        forced.copiers.stores, dma
    )
    # Loads never queue behind stores.
    assert forced.copiers.loads is not forced.copiers.stores
    if cuda_runtime().available:
        from vllm_cpu_offload.worker.copiers.staged import StagedBlockCopier

        staged = TransferEngine(caches, host, backend="staged")
        assert isinstance(staged.copiers.loads, StagedBlockCopier)
        assert staged.copiers.stores is staged.copiers.loads
    # 64 KiB per layer-block (8 heads x 16 tokens x 256 bf16 values).
    raw = torch.randn(2, 4, 8, 16, 256, device="cuda").to(torch.bfloat16)
    big = {f"layer.{i}": raw[i] for i in range(2)}
    big_host = HostBuffer.for_kv_caches(big, 3)
    auto = TransferEngine(big, big_host)
    assert isinstance(auto.copiers.loads, TritonBlockCopier)
    assert isinstance(auto.copiers.stores, dma)


@pytest.mark.cuda
@cuda
def test_cuda_dma_stores_wait_for_the_step_and_land() -> None:
    # Auto backend with 64 KiB runs: stores defer to finish_step and copy
    # what compute wrote.
    raw = torch.randn(3, 6, 8, 16, 256, device="cuda").to(torch.bfloat16)
    caches = {f"layer.{i}": raw[i] for i in range(3)}
    host = HostBuffer.for_kv_caches(caches, 4)
    engine = TransferEngine(caches, host)
    stores = [BlockTransfer(5, [4, 1], [2, 0])]
    for name, t in caches.items():
        t[4].mul_(3)  # "compute" writes the layer's KV, then the layer's save hook runs
        engine.store_layer(name, stores)
    engine.finish_step()
    engine.wait_all()
    assert engine.poll_finished() == FinishedJobs(stores={5})
    for name, t in caches.items():
        assert torch.equal(_host_block(engine, name, 2), _device_block(t, 4))
        assert torch.equal(_host_block(engine, name, 0), _device_block(t, 1))


@pytest.mark.cuda
@cuda
def test_cuda_shared_tensor_is_stored_after_its_last_writer() -> None:
    # vLLM's hybrid manager: layer i of the full group and layer i of the window group
    # share one tensor, each writing the blocks its group owns. A store of that tensor
    # is queued only once both layers ran; the copy then holds both layers' writes.
    caches = _caches("cuda")
    names = list(caches)
    shared = {**caches, **{f"{n}.window": caches[n] for n in names}}
    host = HostBuffer.for_kv_caches(shared, NUM_HOST_BLOCKS)
    host.tensor.zero_()
    engine = TransferEngine(shared, host, copier=_cuda_copier("triton", caches, host))
    stores = [BlockTransfer(2, [3, 6], [0, 1])]
    for name in names:
        caches[name][3].add_(1)  # the full group's layer writes block 3
        engine.store_layer(name, stores)
    for name in names:
        caches[name][6].add_(2)  # then the window group's layer writes block 6
        engine.store_layer(f"{name}.window", stores)
    engine.finish_step()
    engine.wait_all()
    assert engine.poll_finished() == FinishedJobs(stores={2})
    for name, t in caches.items():
        assert torch.equal(_host_block(engine, name, 0), _device_block(t, 3))
        assert torch.equal(_host_block(engine, name, 1), _device_block(t, 6))


@pytest.mark.cuda
@cuda
def test_cuda_fenced_step_waits_for_the_stores_still_running() -> None:
    # With fence_stores, the next step's compute may overwrite a block a store still
    # reads (a window group released it), so it starts only once the store stream is
    # done: here the store stream is held ~50 ms, and the next step's first compute has
    # not run 5 ms in.
    caches = _caches("cuda")
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    host.tensor.zero_()
    engine = TransferEngine(
        caches, host, copier=_cuda_copier("triton", caches, host), fence_stores=True
    )
    before = {name: _device_block(t, 4) for name, t in caches.items()}
    # Load the kernels used below now: CUDA loads a module lazily at its first launch,
    # and that launch waits for the device to be idle, the store stream included.
    torch.cuda._sleep(1)
    torch.empty_like(caches[next(iter(caches))][4]).zero_()
    torch.cuda.synchronize()
    stores = [BlockTransfer(7, [4], [2])]
    for name in caches:
        engine.store_layer(name, stores)
    engine.finish_step()
    with engine.streams.using(engine._store_stream):
        torch.cuda._sleep(100_000_000)  # the store stream is still busy
    engine.begin_step()  # the next step: its compute reuses block 4 at once
    first_compute = torch.cuda.Event()
    first_compute.record()
    for t in caches.values():
        t[4].zero_()
    time.sleep(0.005)
    assert not first_compute.query(), (
        "the next step's compute did not wait for the stores"
    )
    engine.wait_all()
    for name in caches:
        assert torch.equal(_host_block(engine, name, 2), before[name])
