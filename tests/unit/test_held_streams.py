"""The held stand-in of CUDA's streams (`testing/held_streams.py`) orders work as CUDA
does: in stream order, after what it waits for, and not past a hold."""

from __future__ import annotations

import threading

import pytest

from vllm_cpu_offload.testing.held_streams import HeldStreams, HostWaitedForHeldStream


def test_held_work_runs_in_order_after_what_it_waits_for() -> None:
    # b waits for a's work so far; a is held: b's later work waits too, an event of a
    # marks a point, and releasing up to it runs a's work before it only.
    streams = HeldStreams()
    a, b = streams.stream(name="a"), streams.stream(name="b")
    ran: list[str] = []
    streams.hold(a)
    with streams.using(a):
        streams.launch(lambda: ran.append("a1"))
        first = streams.event()
        first.record()
        streams.launch(lambda: ran.append("a2"))
    b.wait_stream(a)
    with streams.using(b):
        streams.launch(lambda: ran.append("b1"))
    streams.launch(lambda: ran.append("compute"))  # not held, waits for nothing
    assert ran == ["compute"] and not first.query()
    streams.release(a, until=first)
    assert ran == ["compute", "a1"] and first.query()
    streams.release(a)
    assert ran == ["compute", "a1", "a2", "b1"]


def test_a_step_thread_waiting_for_a_held_stream_is_recorded_and_raises() -> None:
    streams = HeldStreams()
    stream = streams.stream()
    streams.hold(stream)
    with streams.using(stream):
        streams.launch(lambda: None)
    event = streams.event()
    event.record(stream)
    with pytest.raises(HostWaitedForHeldStream):
        event.synchronize()
    assert len(streams.host_waits) == 1
    streams.release(stream)
    event.synchronize()  # ran: no wait


def test_a_helper_thread_waits_until_the_release_and_faults_raise() -> None:
    # A helper thread (a copier's host hop) may wait for a held stream; it returns
    # once the test releases it. Work that raised makes later events raise.
    streams = HeldStreams()
    stream = streams.stream()
    streams.hold(stream)

    def faulting_copy() -> None:
        raise RuntimeError("an illegal address")

    with streams.using(stream):
        streams.launch(lambda: None)
        streams.launch(faulting_copy)
    event = streams.event()
    event.record(stream)
    outcome: list[str] = []

    def helper() -> None:
        try:
            event.synchronize()
            outcome.append("returned")
        except RuntimeError:
            outcome.append("fault")

    thread = threading.Thread(target=helper)
    thread.start()
    streams.release(stream)
    thread.join(timeout=60)
    assert outcome == ["fault"] and streams.host_waits == []
    with pytest.raises(RuntimeError):
        event.query()
