"""`BoundedCaller`: one thread per store backend that runs its blocking calls, each
waited for at most its timeout, and reconnects the backend when it is down.

A call past its timeout cannot be stopped (the client blocks in C or in a socket): the
caller gets `RemoteCallTimeout` at once while the call goes on on the thread, and the
exception's `in_flight` future is done when the call has really returned (the thread
holds it until then). Calls run one at a time in submission order, so a job submitted
before a call (a backend's registration of memory, say) runs before it.

Imports the standard library only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from .store import RemoteCallTimeout, RemoteStoreError

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Job = tuple[Callable[[], Any], Future[Any]]
# Queued to make the thread look at the store's state again; not run.
_RECHECK: _Job = (lambda: None, Future())


class BoundedCaller:
    """One thread that runs a backend's blocking calls, each waited for at most its
    timeout, and that reconnects the backend when it is down.

    `recover` (run on the thread) makes the backend usable or raises; it runs first,
    and again after every failure once the back-off (doubling from `min_backoff_s` to
    `max_backoff_s`) has passed. While the backend is down `call` raises at once, so
    no call queues behind a stuck one. `shutdown` runs on the thread when it exits.
    """

    def __init__(
        self,
        name: str,
        recover: Callable[[], None],
        shutdown: Callable[[], None],
        min_backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
    ) -> None:
        self._name = name
        self._recover = recover
        self._shutdown = shutdown
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._up = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._strikes = 0
        self._retry_at = 0.0
        self._reason = "connecting"
        self._ever_up = False
        self._down_logged = False  # one line per outage, one when it ends
        self._outstanding = 0  # calls and jobs queued or running
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def is_up(self) -> bool:
        return self._up.is_set()

    @property
    def is_idle(self) -> bool:
        """Up, with no call or job queued or running (tests wait for this)."""
        return self._up.is_set() and self._outstanding == 0

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        """`fn()` on the thread, waited for at most `timeout_s`; any failure raises
        `RemoteStoreError` and marks the backend down. Past the timeout, a call that
        has started raises `RemoteCallTimeout` (it goes on: see the module docstring);
        one still queued is cancelled."""
        if self._closed:
            raise RemoteStoreError(f"{self._name}: closed")
        if not self._up.is_set():
            raise RemoteStoreError(f"{self._name} is down ({self._reason})")
        future: Future[T] = Future()
        self._queue((fn, future))
        try:
            result = future.result(timeout=timeout_s)
        except FutureTimeout:
            reason = f"{what} timed out after {timeout_s:g} s"
            self.mark_down(reason)
            if future.cancel():  # it had not started: it never will
                raise RemoteStoreError(f"{self._name}: {reason}") from None
            raise RemoteCallTimeout(f"{self._name}: {reason}", future) from None
        except RemoteStoreError as e:
            self.mark_down(str(e))
            raise
        except Exception as e:  # noqa: BLE001 - any client failure is a store fault
            reason = f"{what} failed ({type(e).__name__}: {e})"
            self.mark_down(reason)
            raise RemoteStoreError(f"{self._name}: {reason}") from e
        with self._lock:
            self._strikes = 0
        return result

    def submit(self, fn: Callable[[], object]) -> None:
        """`fn()` on the thread without waiting, before any later call; while the
        backend is down, once it is up again (a job dropped then could be lost to a
        recovery that had already looked)."""
        if not self._closed:
            self._queue((fn, Future()))

    def _queue(self, job: _Job) -> None:
        with self._lock:
            self._outstanding += 1
        self._jobs.put(job)

    def mark_down(self, reason: str) -> None:
        with self._lock:
            self._up.clear()
            self._strikes += 1
            backoff = self._min_backoff_s * 2 ** min(self._strikes - 1, 16)
            self._retry_at = time.monotonic() + min(backoff, self._max_backoff_s)
            self._reason = reason
            log, self._down_logged = not self._down_logged, True
        # The thread may be waiting for a job with the store marked up: wake it to
        # start the back-off.
        self._jobs.put(_RECHECK)
        if log and self._ever_up:
            logger.warning("%s: %s; calls fail until it answers", self._name, reason)
        elif log:
            logger.warning(
                "%s is unreachable (%s); running without it and connecting when it "
                "answers",
                self._name,
                reason,
            )

    def close(self, wait_s: float = 2.0) -> None:
        """Stops the thread; waits at most `wait_s` (a stuck call keeps it longer)."""
        self._closed = True
        self._wake.set()
        self._jobs.put(None)
        self._thread.join(wait_s)

    def _run(self) -> None:
        while not self._closed:
            if not self._up.is_set():
                delay = self._retry_at - time.monotonic()
                if delay > 0:
                    self._wake.wait(delay)
                    self._wake.clear()
                    continue
                try:
                    self._recover()
                except Exception as e:  # noqa: BLE001 - retried after a back-off
                    self.mark_down(f"{type(e).__name__}: {e}")
                    continue
                with self._lock:
                    if self._down_logged:
                        logger.info("%s answers", self._name)
                    self._down_logged = False
                    self._ever_up = True
                    self._up.set()
            job = self._jobs.get()
            if job is None:
                break
            if job is _RECHECK:
                continue
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
            with self._lock:
                self._outstanding -= 1
        try:
            self._shutdown()
        except Exception:  # noqa: BLE001 - closing a broken client may fail too
            logger.debug("%s: close failed", self._name, exc_info=True)
