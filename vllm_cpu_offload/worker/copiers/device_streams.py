"""The streams and events that order the transfer engine's copies: a small protocol.

The transfer engine and the CUDA copiers queue copies on streams and order them with
events; this protocol is all they use of CUDA's streams:

    Streams.stream(priority)   a new stream (lower priority value: served first)
    Streams.event()            a new event, not recorded yet
    Streams.current()          the calling thread's current stream (compute's)
    Streams.using(stream)      makes `stream` current for the body (launches go there)
    stream.wait_stream(other)  what `stream` queues next waits for `other`'s work so far
    stream.wait_event(event)   ... for the work before `event`'s last record
    event.record(stream)       marks `stream`'s work so far (default: current stream)
    event.query()              whether that work has run; never blocks
    event.synchronize()        blocks the host until it has run

`CudaStreams` is torch's CUDA streams, the only implementation in service. Tests drive
the same engine and copier code with a stand-in (`testing/held_streams.py`) whose
queued work runs only when the test lets it, on the CPU platform: the ordering of
every step (per-layer waits, failed launches, late completions) is checked without a
GPU, and a host call that would wait for a held stream fails the test.

Imports torch only.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class Event(Protocol):
    """Marks a point of a stream's work (`torch.cuda.Event`)."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Stream(Protocol):
    """A queue of device work (`torch.cuda.Stream`). `cuda_stream` is the handle the
    CUDA runtime's calls take (`cuda_runtime.py`)."""

    @property
    def cuda_stream(self) -> int: ...

    def wait_stream(self, stream: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...


class Streams(Protocol):
    """Makes the streams and events of one device; see the module docstring."""

    def stream(self, priority: int = 0) -> Stream: ...

    def event(self) -> Event: ...

    def current(self) -> Stream: ...

    def using(self, stream: Stream) -> AbstractContextManager[Any]: ...


class CudaStreams:
    """`Streams` of one CUDA device: torch's streams and events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self, priority: int = 0) -> Stream:
        return torch.cuda.Stream(self.device, priority=priority)

    def event(self) -> Event:
        return torch.cuda.Event()

    def current(self) -> Stream:
        return torch.cuda.current_stream(self.device)

    def using(self, stream: Stream) -> AbstractContextManager[Any]:
        assert isinstance(stream, torch.cuda.Stream)
        return torch.cuda.stream(stream)
