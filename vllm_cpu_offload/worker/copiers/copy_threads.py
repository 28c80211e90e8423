"""Shares the pieces of one CPU block copy between the calling thread and helper
threads.

Why not ATen's OpenMP pool: a parallel region ends in a spinning barrier that waits for
its slowest thread, and on a machine whose cores are busy with anything else (here:
another process on one of 2 cores) a 2 MiB copy took 7 ms with 2 threads and 0.15 ms
with 1. Here each thread copies whole pieces with torch's intra-op pool at 1 thread
(`copy_` releases the GIL); threads pop pieces off one list, so a thread that loses its
core just takes fewer, and the caller blocks (no spinning) only for pieces already
started.

Imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

# At most this many threads copy one batch. Only 2 were measured; more mostly add GIL
# hand-offs once memory bandwidth is saturated.
MAX_THREADS = 4

# vLLM's CPU worker replaces `torch.set_num_threads` with a no-op that logs a
# warning once it has bound its OpenMP threads. The setting is per calling thread,
# so call ATen's.
set_threads = torch._C.set_num_threads

Piece = TypeVar("Piece")


def default_threads() -> int:
    """The intra-op thread count of torch, at most the cores the copy threads may use
    (`copy_cores`), at most `MAX_THREADS`."""
    return max(1, min(torch.get_num_threads(), len(copy_cores()), MAX_THREADS))


def copy_cores() -> list[int]:
    """The cores that one copy may run on: the calling thread's own, or, where the
    calling thread may run on one core only, those of this process's OpenMP pool.

    vLLM's CPU worker binds its OpenMP threads one to a core (`GOMP_CPU_AFFINITY`,
    `KMP_AFFINITY` or `OMP_PLACES`, set before the worker starts) and that pins the
    initial thread, which runs the connector, to the first of them. Between forward
    passes the pool idles, so its cores are the ones a copy can borrow (measured inside
    a vLLM worker in docs/transfer.md: about 30% more GB/s for scattered 8B blocks).
    Cores are kept only where some thread of this process may run, so a binding list
    from another process's environment adds none.
    """
    own = _affinity(0)
    if len(own) != 1:
        return sorted(own)
    bound = _openmp_binding() & _process_cores()
    return sorted(bound | own)


def helper_cores(threads: int) -> list[int]:
    """One core for each of `threads - 1` helpers, none of them the caller's, when the
    caller is pinned to one core; empty (helpers inherit the caller's mask)
    otherwise."""
    # several cores: `copy_cores` is exactly these, so no helper core
    own = _affinity(0)
    return [core for core in copy_cores() if core not in own][: threads - 1]


def cores_beside_the_model() -> set[int]:
    """Cores this process may use that the model's OpenMP threads are not bound to;
    empty when there are none or the binding is unknown.

    A vLLM worker's initial thread is pinned to the first OpenMP core, and every thread
    it starts inherits that core. A thread that works while the forward pass runs (the
    shared store's traffic) would take that core from the model. The cores the worker's
    parent (the engine core, or the API server) may use stand for the machine's.
    """
    model = _openmp_binding()
    if not model or not hasattr(os, "sched_getaffinity"):
        return set()
    try:
        allowed = set(os.sched_getaffinity(os.getppid()))
    except OSError:
        return set()
    return allowed - model


class ThreadsBesideTheModel:
    """The threads started inside `threads_started_beside_the_model`, and those they
    start: beside the model's cores while it computes, on every core of the process
    while it idles.

    A step in which no request computes only waits for the store, and the store's
    transfer is CPU work on both ends: on 2 cores, 124 blocks of 256 KiB came in 40 ms
    with the client's threads on the one core beside the model and in 28 ms with them on
    both (inside the engine). `spread` lets them use the model's cores for such steps;
    `gather` brings them back before a forward. Threads are found again by their mask
    (a thread started by one of them inherits it), never among those that existed
    before, so vLLM's threads are never moved.
    """

    def __init__(self, beside: set[int], everywhere: set[int], before: set[int]):
        self.beside = beside
        self.everywhere = everywhere
        self._before = before
        self._moved: set[int] = set()
        self.spread_out = False

    def spread(self) -> None:
        if self.spread_out or self.everywhere == self.beside:
            return
        self._moved = self._threads_with(self.beside)
        self._move(self._moved, self.everywhere)
        self.spread_out = True

    def gather(self) -> None:
        if not self.spread_out:
            return
        # Threads started while spread out carry the wider mask.
        self._move(self._moved | self._threads_with(self.everywhere), self.beside)
        self._moved = set()
        self.spread_out = False

    def _threads_with(self, mask: set[int]) -> set[int]:
        found: set[int] = set()
        for tid in _thread_ids() - self._before:
            try:
                if _affinity(tid) == mask:
                    found.add(tid)
            except OSError:  # the thread ended meanwhile
                continue
        return found

    @staticmethod
    def _move(tids: set[int], cores: set[int]) -> None:
        for tid in tids:
            with contextlib.suppress(OSError):  # ended meanwhile
                os.sched_setaffinity(tid, cores)


@contextlib.contextmanager
def threads_started_beside_the_model() -> Iterator[ThreadsBesideTheModel | None]:
    """Threads the calling thread starts inside run on `cores_beside_the_model()`
    (they inherit its mask); its own mask is restored after. Yields their handle, or
    None where the model has no cores beside it."""
    own, cores = _affinity(0), cores_beside_the_model()
    before = _thread_ids()
    try:
        if cores:
            os.sched_setaffinity(0, cores)  # this thread only
    except OSError:  # a core taken away since: threads keep the caller's mask
        cores = set()
    try:
        yield (
            ThreadsBesideTheModel(
                cores, cores | (_openmp_binding() & _process_cores()), before
            )
            if cores
            else None
        )
    finally:
        if cores:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, own)


def _thread_ids() -> set[int]:
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _affinity(tid: int) -> set[int]:
    if not hasattr(os, "sched_getaffinity"):
        return set(range(os.cpu_count() or 1))
    return set(os.sched_getaffinity(tid))


def _process_cores() -> set[int]:
    """The union of the masks of this process's threads (the initial thread alone is
    pinned to one core in a vLLM worker; its OpenMP threads are pinned to the
    others)."""
    cores: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return _affinity(0)
    for tid in tids:
        try:
            cores |= _affinity(int(tid))
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return cores


def _openmp_binding() -> set[int]:
    """Cores named by the OpenMP binding in the environment; empty when there is none or
    it has a form this does not read (a place list with lengths or strides, for
    instance)."""
    env = os.environ
    text = env.get("GOMP_CPU_AFFINITY", "")
    kmp = env.get("KMP_AFFINITY", "")
    if "proclist=[" in kmp:
        text += "," + kmp.split("proclist=[", 1)[1].split("]", 1)[0]
    places = env.get("OMP_PLACES", "")
    if places.startswith("{") and ":" not in places:
        text += "," + places.replace("{", "").replace("}", "")
    cores: set[int] = set()
    for item in text.replace(" ", ",").split(","):
        first, _, last = item.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if last else low
        except ValueError:
            if item.strip():
                return set()
            continue
        if 0 <= low <= high:
            cores.update(range(low, high + 1))
    return cores


class CopyThreads:
    """The calling thread plus `threads - 1` long-lived helpers, started once."""

    def __init__(self, threads: int, cores: Sequence[int] = ()) -> None:
        """`cores`: one core per helper to pin it to (`helper_cores`); none keeps the
        caller's mask."""
        assert threads >= 2, "one thread needs no helpers"
        self.threads = threads
        unclaimed = list(cores)
        claim = threading.Lock()

        def start_helper() -> None:
            set_threads(1)
            with claim:
                core = unclaimed.pop() if unclaimed else None
            if core is not None:
                # A failed initializer would break the pool and leave the start-up
                # barrier waiting: a core taken away since is only a slower copy.
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, {core})  # this thread only

        self._helpers = ThreadPoolExecutor(
            threads - 1, thread_name_prefix="kv-copy", initializer=start_helper
        )
        pool = torch.get_num_threads()
        started = threading.Barrier(threads)
        # Each blocks until all have started: one thread each.
        for _ in range(threads - 1):
            self._helpers.submit(started.wait)
        started.wait()
        set_threads(pool)  # the helpers' call also set ATen's default for new threads

    def run(self, pieces: list[Piece], copy: Callable[[Piece], None]) -> None:
        """`copy(piece)` for every piece, on all threads. The first error is raised once
        no thread touches the buffers any more. The caller sets its own intra-op pool to
        1."""
        work = _Work(pieces, copy)
        for _ in range(self.threads - 1):
            self._helpers.submit(work.drain)
        work.drain()
        work.wait_idle()
        if work.error is not None:
            raise work.error


class _Work(Generic[Piece]):
    """The pieces of one call, taken one at a time by whichever thread is running.

    Invariant: once `pieces` is empty and `busy` is 0 no thread copies again, so
    `wait_idle` never waits for a helper that has not started (it may still be waiting
    for a core): the calling thread copies what the helpers did not take.
    """

    def __init__(self, pieces: list[Piece], copy: Callable[[Piece], None]) -> None:
        self.pieces = pieces
        self.copy = copy
        self.busy = 0
        self.error: BaseException | None = None
        self._changed = threading.Condition(threading.Lock())

    def drain(self) -> None:
        """Copies pieces until none is left; the first error is kept and stops the
        rest."""
        with self._changed:
            piece = self._take()
        while piece is not None:
            try:
                self.copy(piece)
            except BaseException as e:
                with self._changed:
                    self.error = self.error or e
                    self.pieces.clear()
            with self._changed:
                self.busy -= 1
                piece = self._take()
                if not self.busy:
                    self._changed.notify_all()

    def _take(self) -> Piece | None:
        if not self.pieces:
            return None
        self.busy += 1
        return self.pieces.pop()

    def wait_idle(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: not self.busy)
