"""A stand-in for CUDA's streams and events whose queued work runs when a test says.

`HeldStreams` implements `worker/copiers/device_streams.py`'s `Streams` on the CPU
platform, so that the transfer engine and the CUDA copiers run their stream code (the
same code as on a GPU, not a copy of it) without one:

- a stream is a queue of work (callables) and waits (`wait_stream`, `wait_event`);
  what is ready runs at once, in order, on the thread that queued or released it;
- `hold(stream)` stops the stream where it stands, like a gate queued on it: nothing
  queued after it runs until `release(stream)` (or `release(stream, until=event)`:
  up to that event only); a held stream is how a test makes a copy run late;
- an event marks a stream's work so far; `query()` is True once that work has run;
- `synchronize()` on the step's thread (the one that built the stand-in) while the
  event's work cannot run is the host waiting for a held stream: it is recorded in
  `host_waits` and raises `HostWaitedForHeldStream`. On other threads (a copier's
  helper thread) it waits until the test releases the stream;
- work that raises is a fault on the device: the stream carries on, and every event
  recorded after it raises RuntimeError from `query()` and `synchronize()`, as CUDA
  reports an asynchronous error.

`LaunchingCopier` makes a CPU copier launch like a kernel: its copy is queued on the
current stream. `HeldCopyEngines` is the copy engines of `copiers/cuda_runtime.py`
(`cudaMemcpyBatchAsync`, `cudaMemcpy2DAsync`) as `memmove`s queued on the stream
whose `cuda_stream` handle a call names. Both count their calls (`calls`) and raise at
the one `fail_call` names, as a launch the runtime refuses does. Imports torch only.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vllm_cpu_offload.worker.copiers.base import BlockCopier, HostWork
from vllm_cpu_offload.worker.copiers.device_streams import Stream

# How long a helper thread waits for a held stream before the wait counts as a
# hang (a step thread that waits on that helper, which nothing would release).
HELPER_WAIT_SECONDS = 60.0


class HostWaitedForHeldStream(AssertionError):
    """The step's thread waited for work that a held stream keeps from running."""


@dataclass
class _Op:
    after: tuple[HeldStream, int] | None  # (stream, its ops) that must have run first
    work: Callable[[], None] | None


class HeldStream:
    """One queue of the stand-in; see the module docstring."""

    def __init__(self, streams: HeldStreams, handle: int, name: str) -> None:
        self._streams = streams
        self.cuda_stream = handle
        self.name = name
        self.queued = 0  # ops queued so far
        self.ran = 0  # ops run so far (they run in order)
        self.hold_at: int | None = None  # ops past this count wait for a release
        self.faults: list[int] = []  # positions of the ops that raised
        self._ops: deque[_Op] = deque()

    def __repr__(self) -> str:
        return f"HeldStream({self.name!r}, ran={self.ran}/{self.queued})"

    def wait_stream(self, stream: Any) -> None:
        assert isinstance(stream, HeldStream)
        self._push(_Op((stream, stream.queued), None))

    def wait_event(self, event: Any) -> None:
        assert isinstance(event, HeldEvent)
        if event.mark is not None:  # an event never recorded is no wait (CUDA)
            self._push(_Op(event.mark, None))

    @property
    def waiting(self) -> int:
        """Ops queued that have not run."""
        return self.queued - self.ran

    def queue(self, work: Callable[[], None]) -> None:
        """Queues `work` (a copy, a kernel) on this stream."""
        self._push(_Op(None, work))

    def _push(self, op: _Op) -> None:
        with self._streams.lock:
            self._ops.append(op)
            self.queued += 1
            self._streams.run_ready()

    def _run_ready(self) -> bool:
        """Runs the ops at the head that may run; whether any did."""
        ran = False
        while self._ops and (self.hold_at is None or self.ran < self.hold_at):
            op = self._ops[0]
            if op.after is not None and op.after[0].ran < op.after[1]:
                break
            self._ops.popleft()
            if op.work is not None:
                try:
                    op.work()
                except Exception:
                    self.faults.append(self.ran)
            self.ran += 1
            ran = True
        return ran


class HeldEvent:
    """An event of the stand-in: marks a stream's ops so far."""

    def __init__(self, streams: HeldStreams) -> None:
        self._streams = streams
        self.mark: tuple[HeldStream, int] | None = None

    def record(self, stream: Any = None) -> None:
        stream = stream if stream is not None else self._streams.current()
        assert isinstance(stream, HeldStream)
        self.mark = (stream, stream.queued)

    def query(self) -> bool:
        with self._streams.lock:
            return self._done()

    def synchronize(self) -> None:
        with self._streams.lock:
            if self._done():
                return
            assert self.mark is not None
            what = f"an event of {self.mark[0]!r}"
            if threading.get_ident() == self._streams.step_thread:
                self._streams.host_waits.append(what)
                raise HostWaitedForHeldStream(f"the step's thread waited for {what}")
            if not self._streams.lock.wait_for(self._ran, HELPER_WAIT_SECONDS):
                self._streams.host_waits.append(f"a helper thread for {what}")
                raise HostWaitedForHeldStream(f"a helper thread hung on {what}")
            self._done()

    def _ran(self) -> bool:
        return self.mark is None or self.mark[0].ran >= self.mark[1]

    def _done(self) -> bool:
        """Whether the marked work has run; raises if any of it faulted."""
        if not self._ran():
            return False
        if self.mark is not None:
            stream, position = self.mark
            if any(f < position for f in stream.faults):
                raise RuntimeError(f"a copy queued on {stream!r} failed on the device")
        return True


class HeldStreams:
    """`Streams` whose work runs when the test lets it; see the module docstring.

    `compute` is the current stream of every thread until `using` changes it.
    """

    def __init__(self) -> None:
        self.lock = threading.Condition(threading.RLock())
        self.step_thread = threading.get_ident()
        self.host_waits: list[str] = []
        self._streams: list[HeldStream] = []
        self._handles = itertools.count(1)
        self._current = threading.local()
        self.compute = self.stream(name="compute")

    # ---- Streams ----

    def stream(self, priority: int = 0, *, name: str = "") -> HeldStream:
        handle = next(self._handles)
        stream = HeldStream(self, handle, name or f"stream {handle}")
        self._streams.append(stream)
        return stream

    def event(self) -> HeldEvent:
        return HeldEvent(self)

    def current(self) -> HeldStream:
        stack: list[HeldStream] = getattr(self._current, "stack", [])
        return stack[-1] if stack else self.compute

    @contextmanager
    def using(self, stream: Stream) -> Iterator[None]:
        assert isinstance(stream, HeldStream)
        stack = self._current.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    # ---- what a test does ----

    def launch(self, work: Callable[[], None]) -> None:
        """Queues `work` on the current stream, as a kernel launch does."""
        self.current().queue(work)

    def by_handle(self, handle: int) -> HeldStream:
        return next(s for s in self._streams if s.cuda_stream == handle)

    def hold(self, *streams: Stream) -> None:
        """What each stream queues from now on waits for `release`."""
        with self.lock:
            for stream in streams:
                assert isinstance(stream, HeldStream)
                stream.hold_at = stream.queued

    def release(self, *streams: Stream, until: HeldEvent | None = None) -> None:
        """Lets the streams run on: everything, or the work before `until`."""
        with self.lock:
            for stream in streams:
                assert isinstance(stream, HeldStream)
                if until is None:
                    stream.hold_at = None
                elif stream.hold_at is not None:
                    assert until.mark is not None and until.mark[0] is stream
                    stream.hold_at = max(stream.hold_at, until.mark[1])
            self.run_ready()

    def run_ready(self) -> None:
        """Runs every op that may run, on the calling thread; wakes the waiters."""
        with self.lock:
            while any([s._run_ready() for s in self._streams]):
                pass
            self.lock.notify_all()


class LaunchingCopier:
    """`inner` (a CPU copier) as a kernel: each copy is queued on the current stream
    of `streams`, and runs when that stream gets there. Block ids are read where
    `inner` reads them; a copy has no host part."""

    def __init__(self, inner: BlockCopier, streams: HeldStreams) -> None:
        self.inner = inner
        self.streams = streams
        self.calls = 0
        self.fail_call: int | None = None  # this call (0: the first) raises

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> HostWork | None:
        names = None if layers is None else list(layers)
        _count_call(self)
        self.streams.launch(
            lambda: _no_host_work(self.inner.copy(to_host, device_ids, host_ids, names))
        )
        return None


def _no_host_work(work: HostWork | None) -> None:
    assert work is None, "a launched copy has no host part"


def _count_call(launcher: LaunchingCopier | HeldCopyEngines) -> None:
    """Counts a call; raises if it is the one to fail (nothing of it is queued)."""
    call = launcher.calls
    launcher.calls += 1
    if call == launcher.fail_call:
        raise RuntimeError(f"injected failure of launch {call}")


class HeldCopyEngines:
    """`CudaRuntime`'s copy calls on the stand-in: each queues its `memmove`s on the
    stream whose handle it names. Addresses are host addresses (the CPU platform's
    caches and buffers)."""

    available = True
    why_unavailable = ""

    def __init__(self, streams: HeldStreams) -> None:
        self.streams = streams
        self.calls = 0
        self.fail_call: int | None = None  # this call (0: the first) raises

    def memcpy_batch(
        self,
        dsts: torch.Tensor,
        srcs: torch.Tensor,
        sizes: torch.Tensor,
        attrs: object,
        stream: int,
    ) -> None:
        _count_call(self)
        runs = list(zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True))

        def copy() -> None:
            for dst, src, size in runs:
                ctypes.memmove(dst, src, size)

        self.streams.by_handle(stream).queue(copy)

    def memcpy_2d(
        self,
        dst: int,
        dpitch: int,
        src: int,
        spitch: int,
        width: int,
        height: int,
        stream: int,
    ) -> None:
        _count_call(self)

        def copy() -> None:
            for row in range(height):
                ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

        self.streams.by_handle(stream).queue(copy)

    def max_pitch(self, device: int) -> int:
        return 1 << 31
