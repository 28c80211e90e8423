"""TorchBlockCopier on CPU tensors: batches shared with helper threads land byte-exact,
and a copy that raises in any thread raises from `copy` once every thread has
stopped."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_cpu_offload.worker.copiers import copy_threads, torch_views
from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier
from vllm_cpu_offload.worker.host_buffer import HostBuffer

NUM_LAYERS, NUM_BLOCKS, NUM_HOST_BLOCKS = 4, 64, 48
HELPER_WAIT_S = 10.0


def _caches() -> dict[str, torch.Tensor]:
    """The CPU layout of vLLM (LBHNC): all layers in one buffer, [B, H, N, 2 * D] per
    layer."""
    raw = torch.randint(0, 256, (NUM_LAYERS, NUM_BLOCKS, 2, 4, 16), dtype=torch.int16)
    return {f"model.layers.{i}.attn": raw[i] for i in range(NUM_LAYERS)}


def _device_block(t: torch.Tensor, d: int) -> torch.Tensor:
    return t[d].contiguous().view(-1).view(torch.uint8)


@pytest.fixture
def split_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny tensors: share every batch, and cut runs into 2-block pieces.
    monkeypatch.setattr(torch_views, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(torch_views, "PIECE_BYTES", 2 * NUM_LAYERS * 256)


@pytest.fixture
def helper_takes_a_piece(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    # The calling thread copies nothing until a helper has taken a piece:
    # both threads work.
    helper_started = threading.Event()
    copy = torch_views._copy

    def gated_copy(*args: object) -> None:
        if threading.current_thread() is threading.main_thread():
            assert helper_started.wait(HELPER_WAIT_S), "no helper thread took a piece"
        else:
            helper_started.set()
        copy(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_views, "_copy", gated_copy)
    return helper_started


@pytest.mark.usefixtures("split_everything")
@pytest.mark.parametrize("threads", [2, 3])
def test_shared_batch_is_byte_exact(
    threads: int, helper_takes_a_piece: threading.Event
) -> None:
    # 40 scattered blocks and a 6-block run, shared by threads: stored,
    # wiped, loaded back.
    caches = _caches()
    originals = {n: t.clone() for n, t in caches.items()}
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    host.tensor.zero_()
    copier = TorchBlockCopier(caches, host, threads=threads)
    gen = torch.Generator().manual_seed(0)
    device_ids = [*torch.randperm(NUM_BLOCKS - 6, generator=gen)[:40].tolist()]
    device_ids += range(NUM_BLOCKS - 6, NUM_BLOCKS)
    host_ids = torch.randperm(NUM_HOST_BLOCKS, generator=gen)[:46].tolist()
    copier.copy(True, torch.tensor(device_ids), torch.tensor(host_ids))
    assert helper_takes_a_piece.is_set()
    for name, t in caches.items():
        for d, h in zip(device_ids, host_ids, strict=True):
            assert torch.equal(host.layer_view(name)[h], _device_block(t, d))
    for t in caches.values():
        t.zero_()
    copier.copy(False, device_ids, host_ids)
    for name, t in caches.items():
        for d in range(NUM_BLOCKS):
            expected = originals[name][d] if d in device_ids else torch.zeros_like(t[d])
            assert torch.equal(t[d], expected)


@pytest.mark.usefixtures("split_everything")
def test_error_in_a_helper_raises_after_all_threads_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A helper's piece raises: copy raises it, and no thread is still copying by then.
    caches = _caches()
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    copier = TorchBlockCopier(caches, host, threads=2)
    helper_started, active = threading.Event(), [0]
    lock = threading.Lock()
    copy = torch_views._copy

    def failing_copy(*args: object) -> None:
        with lock:
            active[0] += 1
        try:
            if threading.current_thread() is threading.main_thread():
                assert helper_started.wait(HELPER_WAIT_S), (
                    "no helper thread took a piece"
                )
            else:
                helper_started.set()
                raise RuntimeError("injected copy failure")
            copy(*args)  # type: ignore[arg-type]
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(torch_views, "_copy", failing_copy)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        copier.copy(True, list(range(40)), list(range(40)))
    assert active[0] == 0


def test_small_batch_stays_on_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Below SPLIT_MIN_BYTES no helper is handed work (a hand-off costs more
    # than it saves).
    caches = _caches()
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    threads: set[str] = set()
    copy = torch_views._copy

    def recording_copy(*args: object) -> None:
        threads.add(threading.current_thread().name)
        copy(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch_views, "_copy", recording_copy)
    TorchBlockCopier(caches, host, threads=2).copy(True, [3, 9, 1], [0, 5, 7])
    assert threads == {threading.main_thread().name}


def test_helpers_keep_the_torch_thread_count() -> None:
    # Starting helpers (each sets its own intra-op pool to 1) leaves
    # this thread's alone.
    before = torch.get_num_threads()
    caches = _caches()
    TorchBlockCopier(caches, HostBuffer.for_kv_caches(caches, 2), threads=2)
    assert torch.get_num_threads() == before


def _clear_openmp_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES"):
        monkeypatch.delenv(name, raising=False)


def test_a_thread_pinned_to_one_core_without_a_binding_gets_no_helpers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pinned to one core and no OpenMP pool to borrow from: helpers would
    # share that core.
    _clear_openmp_binding(monkeypatch)
    monkeypatch.setattr(
        copy_threads.os, "sched_getaffinity", lambda tid: {0}, raising=False
    )
    assert copy_threads.default_threads() == 1
    assert copy_threads.helper_cores(2) == []


def test_a_pinned_worker_thread_borrows_the_openmp_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM's CPU worker: initial thread pinned to core 0, OpenMP threads bound to
    # 0 and 1.
    _clear_openmp_binding(monkeypatch)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0 1")
    monkeypatch.setattr(
        copy_threads.os, "sched_getaffinity", lambda tid: {0}, raising=False
    )
    monkeypatch.setattr(copy_threads, "_process_cores", lambda: {0, 1})
    monkeypatch.setattr(copy_threads.torch, "get_num_threads", lambda: 2)
    assert copy_threads.copy_cores() == [0, 1]
    assert copy_threads.default_threads() == 2
    assert copy_threads.helper_cores(2) == [1]


def test_a_binding_names_only_cores_this_process_runs_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An inherited binding list for other cores than this process's threads
    # use adds nothing.
    _clear_openmp_binding(monkeypatch)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "4-7")
    monkeypatch.setattr(
        copy_threads.os, "sched_getaffinity", lambda tid: {0}, raising=False
    )
    monkeypatch.setattr(copy_threads, "_process_cores", lambda: {0, 1})
    assert copy_threads.copy_cores() == [0]
    assert copy_threads.default_threads() == 1


@pytest.mark.parametrize(
    ("env", "cores"),
    [
        ({"GOMP_CPU_AFFINITY": "0 2-3"}, {0, 2, 3}),
        ({"GOMP_CPU_AFFINITY": "1,5"}, {1, 5}),
        (
            {"KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5,8-9]"},
            {4, 5, 8, 9},
        ),
        ({"OMP_PLACES": "{6,7}"}, {6, 7}),
        ({"OMP_PLACES": "{0:4}"}, set()),  # lengths and strides: not read, no cores
        ({"GOMP_CPU_AFFINITY": "0-3:2"}, set()),
        ({}, set()),
    ],
)
def test_openmp_binding_forms(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], cores: set[int]
) -> None:
    _clear_openmp_binding(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert copy_threads._openmp_binding() == cores


@pytest.mark.skipif(
    not hasattr(copy_threads.os, "sched_setaffinity")
    or len(copy_threads._affinity(0)) < 2,
    reason="needs two cores and thread affinity",
)
def test_helpers_run_on_their_own_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # A thread pinned to one core (as vLLM pins its worker) starts helpers on the other
    # bound cores, really pinned there by the OS.
    first, second = sorted(copy_threads._affinity(0))[:2]
    _clear_openmp_binding(monkeypatch)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", f"{first},{second}")
    seen: dict[str, object] = {}

    def pinned_caller() -> None:
        copy_threads.os.sched_setaffinity(0, {first})
        cores = copy_threads.helper_cores(2)
        threads = copy_threads.CopyThreads(2, cores)
        seen["cores"] = cores
        seen["helper"] = threads._helpers.submit(
            copy_threads.os.sched_getaffinity, 0
        ).result()
        seen["caller"] = copy_threads.os.sched_getaffinity(0)

    caller = threading.Thread(target=pinned_caller)
    caller.start()
    caller.join(HELPER_WAIT_S)
    assert seen == {"cores": [second], "helper": {second}, "caller": {first}}


def test_copies_ignore_a_replaced_set_num_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op; ours calls ATen's.
    def forbidden(n: int) -> None:
        raise AssertionError("torch.set_num_threads called")

    monkeypatch.setattr(torch, "set_num_threads", forbidden)
    monkeypatch.setattr(torch_views, "SPLIT_MIN_BYTES", 0)
    caches = _caches()
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    TorchBlockCopier(caches, host, threads=2).copy(
        True, list(range(20)), list(range(20))
    )
    for name, t in caches.items():
        assert torch.equal(host.layer_view(name)[19], _device_block(t, 19))


def test_a_core_that_cannot_be_taken_leaves_the_helper_on_the_callers_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The binding names a core this thread may not use: the helper starts
    # anyway and copies.
    def refuse(tid: int, cores: object) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(copy_threads.os, "sched_setaffinity", refuse, raising=False)
    threads = copy_threads.CopyThreads(2, [12345])
    done: list[int] = []
    threads.run([1, 2, 3, 4], done.append)
    assert sorted(done) == [1, 2, 3, 4]


def test_threads_started_beside_the_model_run_off_its_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    allowed = set(copy_threads.os.sched_getaffinity(copy_threads.os.getppid()))
    if len(allowed) < 2:
        pytest.skip("needs a parent process allowed on two cores")
    model = max(allowed)
    _clear_openmp_binding(monkeypatch)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(model))
    assert copy_threads.cores_beside_the_model() == allowed - {model}
    own = set(copy_threads.os.sched_getaffinity(0))
    seen: list[set[int]] = []

    def record() -> None:
        seen.append(set(copy_threads.os.sched_getaffinity(0)))

    with copy_threads.threads_started_beside_the_model() as placed:
        thread = threading.Thread(target=record)
        thread.start()
    thread.join()
    assert seen == [allowed - {model}]
    assert set(copy_threads.os.sched_getaffinity(0)) == own
    assert placed is not None and placed.everywhere == allowed
    # No binding known: nothing changes.
    _clear_openmp_binding(monkeypatch)
    assert copy_threads.cores_beside_the_model() == set()


def test_threads_beside_the_model_spread_while_it_idles_and_gather_before_it_computes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A thread started inside, and one that thread starts later, use every core while
    # spread out and only the cores beside the model once gathered; a thread that
    # existed before, and the caller, are never moved.
    os_ = copy_threads.os
    allowed = set(os_.sched_getaffinity(os_.getppid()))
    if len(allowed) < 2 or set(os_.sched_getaffinity(0)) != allowed:
        pytest.skip("needs this process and its parent allowed on two cores or more")
    model = max(allowed)
    _clear_openmp_binding(monkeypatch)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(model))
    stop = threading.Event()
    tids: dict[str, int] = {}

    def park(name: str) -> None:
        tids[name] = threading.get_native_id()
        stop.wait()

    def start_child_later(go: threading.Event) -> None:
        tids["parent"] = threading.get_native_id()
        go.wait()
        threading.Thread(target=park, args=("child",)).start()
        stop.wait()

    older = threading.Thread(target=park, args=("older",))
    older.start()
    go = threading.Event()
    with copy_threads.threads_started_beside_the_model() as placed:
        parent = threading.Thread(target=start_child_later, args=(go,))
        parent.start()
    assert placed is not None
    beside = allowed - {model}
    try:
        while "parent" not in tids or "older" not in tids:
            stop.wait(0.001)

        def masks() -> dict[str, set[int]]:
            return {name: set(os_.sched_getaffinity(t)) for name, t in tids.items()}

        placed.spread()
        assert masks() == {"older": allowed, "parent": allowed}
        go.set()  # started while spread out
        while "child" not in tids:
            stop.wait(0.001)
        placed.gather()
        assert masks() == {"older": allowed, "parent": beside, "child": beside}
        placed.spread()
        assert masks() == {"older": allowed, "parent": allowed, "child": allowed}
        placed.gather()
        assert masks() == {"older": allowed, "parent": beside, "child": beside}
        assert set(os_.sched_getaffinity(0)) == allowed
    finally:
        stop.set()
        parent.join()
        older.join()
