"""Shares the pieces of one CPU block copy between the calling thread and helper threads.

Why not ATen's OpenMP pool: a parallel region ends in a spinning barrier that waits for its
slowest thread, and on a machine whose cores are busy with anything else (here: another
process on one of 2 cores) a 2 MiB copy took 7 ms with 2 threads and 0.15 ms with 1. Here
each thread copies whole pieces with torch's intra-op pool at 1 thread (`copy_` releases
the GIL); threads pop pieces off one list, so a thread that loses its core just takes fewer,
and the caller blocks (no spinning) only for pieces already started.

Imports torch and the standard library only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

# At most this many threads copy one batch. Only 2 were measured; more mostly add GIL
# hand-offs once memory bandwidth is saturated.
MAX_THREADS = 4

# vLLM's CPU worker replaces `torch.set_num_threads` with a no-op that logs a warning once
# it has bound its OpenMP threads. The setting is per calling thread, so call ATen's.
set_threads = torch._C.set_num_threads

Piece = TypeVar("Piece")


def default_threads() -> int:
    """torch's intra-op thread count, at most the cores this thread may run on (vLLM's OpenMP
    binding pins the worker's main thread to one core, and helpers inherit its mask)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(torch.get_num_threads(), cores or 1, MAX_THREADS))


class CopyThreads:
    """The calling thread plus `threads - 1` long-lived helpers, started once."""

    def __init__(self, threads: int) -> None:
        assert threads >= 2, "one thread needs no helpers"
        self.threads = threads
        self._helpers = ThreadPoolExecutor(
            threads - 1, thread_name_prefix="kv-copy", initializer=set_threads, initargs=(1,)
        )
        pool = torch.get_num_threads()
        started = threading.Barrier(threads)
        for _ in range(threads - 1):  # each blocks until all have started: one thread each
            self._helpers.submit(started.wait)
        started.wait()
        set_threads(pool)  # the helpers' call also set ATen's default for new threads

    def run(self, pieces: list[Piece], copy: Callable[[Piece], None]) -> None:
        """`copy(piece)` for every piece, on all threads. The first error is raised once no
        thread touches the buffers any more. The caller sets its own intra-op pool to 1."""
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
        """Copies pieces until none is left; the first error is kept and stops the rest."""
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
