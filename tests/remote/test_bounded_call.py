"""`BoundedCaller.is_idle`: what tests wait on before they look at a store's state."""

from __future__ import annotations

import threading
import time

from vllm_cpu_offload.remote.bounded_call import BoundedCaller


def _eventually(condition: object, wait_s: float = 120.0) -> bool:
    """Whether `condition` came to hold within `wait_s` (a hang's bound)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


def test_a_caller_is_idle_only_with_nothing_queued_or_running() -> None:
    caller = BoundedCaller("test", recover=lambda: None, shutdown=lambda: None)
    try:
        assert _eventually(lambda: caller.is_idle)
        gate = threading.Event()
        caller.submit(gate.wait)
        caller.submit(lambda: None)  # queued behind the running job
        assert not caller.is_idle
        gate.set()
        assert _eventually(lambda: caller.is_idle)
    finally:
        caller.close()


def test_a_caller_that_is_down_is_not_idle() -> None:
    def refuse() -> None:
        raise ConnectionError("no store")

    caller = BoundedCaller(
        "test", recover=refuse, shutdown=lambda: None, min_backoff_s=60.0
    )
    try:
        time.sleep(0.05)
        assert not caller.is_up and not caller.is_idle
    finally:
        caller.close()
