"""`mooncake://`: the remote tier on a Mooncake Store master (kvcache-ai/Mooncake).

Mooncake's Python client blocks in C++ (a dead master costs about 4 s a call, a dead
storage node about 1 s, a failed `setup` 90 s), so every call runs on one thread of the
store's own (`BoundedCaller`) and the caller waits at most its timeout. A call past its
timeout, or one the master refuses as a whole, marks the store down: later calls fail
at once with `RemoteStoreError` until the thread, after a back-off, finds the master
answering again (or builds a new client). A master that is down when the store is made
is the same state: construction never raises nor blocks.

Values move without a copy: `put` sends the spans of host memory as they are and `get`
writes into them (Mooncake's `*_multi_buffers` calls), so a value may be a header span
and a block span. Memory named by `register` is registered with every client this store
builds. Mooncake over TCP has no authentication: keep the master and the storage nodes
on a private network.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar
from urllib.parse import urlsplit

from .store import RemoteStore, RemoteStoreError, Span
from .url import MOONCAKE_METADATA_PORT, RemoteUrl

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Job = tuple[Callable[[], Any], Future[Any]]
# Queued to make the thread look at the store's state again; not run.
_RECHECK: _Job = (lambda: None, Future())

# Mooncake's per-key code that says the master did not answer (RPC_FAIL).
_MASTER_DOWN = frozenset({-900})
_PROBE_KEY = "vllm_cpu_offload/probe"
_PROBE_TIMEOUT_S = 2.0
_LOCAL_BUFFER_BYTES = {"scheduler": 0, "worker": 64 << 20}


class RemoteCallTimeout(RemoteStoreError):
    """A call ran past its timeout; it still runs on the store's thread until
    `in_flight` is done. Until then a `get`'s spans may still be written (and a
    `put`'s read): keep that host memory from other use until `in_flight.done()`."""

    def __init__(self, message: str, in_flight: Future[Any]) -> None:
        super().__init__(message)
        self.in_flight = in_flight


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
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def is_up(self) -> bool:
        return self._up.is_set()

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        """`fn()` on the thread, waited for at most `timeout_s`; any failure raises
        `RemoteStoreError` and marks the backend down."""
        if self._closed:
            raise RemoteStoreError(f"{self._name}: closed")
        if not self._up.is_set():
            raise RemoteStoreError(f"{self._name} is down ({self._reason})")
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        try:
            result = future.result(timeout=timeout_s)
        except FutureTimeout:
            reason = f"{what} timed out after {timeout_s:g} s"
            self.mark_down(reason)
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
        """`fn()` on the thread without waiting (it runs before any later call)."""
        if self._up.is_set() and not self._closed:
            self._jobs.put((fn, Future()))

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
        try:
            self._shutdown()
        except Exception:  # noqa: BLE001 - closing a broken client may fail too
            logger.debug("%s: close failed", self._name, exc_info=True)


class MooncakeRemoteStore(RemoteStore):
    """A Mooncake Store client as the host tier's `RemoteStore` (see the module
    docstring). `role` "scheduler" builds a client without a transfer buffer (it only
    asks `exists`); "worker" registers its host memory through `register`."""

    def __init__(self, url: RemoteUrl, *, role: str = "worker") -> None:
        if role not in _LOCAL_BUFFER_BYTES:
            raise ValueError(f"role must be one of {sorted(_LOCAL_BUFFER_BYTES)}")
        self._url = url
        self._role = role
        self._master = f"{url.host}:{url.port}"
        self._metadata = url.option("metadata") or (
            f"http://{url.host}:{MOONCAKE_METADATA_PORT}/metadata"
        )
        self._protocol = url.option("protocol", "tcp") or "tcp"
        self._device = url.option("device", "") or ""
        self._spans: list[Span] = []
        self._client: Any = None
        self._registered: set[Span] = set()
        self._caller = BoundedCaller(
            f"remote store {url}", recover=self._recover, shutdown=self._close_client
        )

    @property
    def description(self) -> str:
        return f"Mooncake Store at {self._master} ({self._protocol})"

    @property
    def is_up(self) -> bool:
        """Whether calls go to the store now (False: they fail at once)."""
        return self._caller.is_up

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        if not keys:
            return []
        key_list = list(keys)
        codes = self._caller.call(
            lambda: self._answered(self._client.batch_is_exist(key_list), "exists"),
            timeout_s,
            "exists",
        )
        return [c == 1 for c in codes]

    def put(
        self, keys: Sequence[str], values: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        if not keys:
            return []
        key_list, ptrs, sizes = _buffers(keys, values)
        codes = self._caller.call(
            lambda: self._answered(
                self._client.batch_put_from_multi_buffers(key_list, ptrs, sizes), "put"
            ),
            timeout_s,
            "put",
        )
        # 0 also for a key the store holds already (values are immutable by key).
        return [c == 0 for c in codes]

    def get(
        self, keys: Sequence[str], into: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        if not keys:
            return []
        key_list, ptrs, sizes = _buffers(keys, into)
        codes = self._caller.call(
            lambda: self._answered(
                self._client.batch_get_into_multi_buffers(key_list, ptrs, sizes), "get"
            ),
            timeout_s,
            "get",
        )
        # A value of another length fails in Mooncake (negative) or reads short.
        return [c == sum(s) for c, s in zip(codes, sizes, strict=True)]

    def register(self, span: Span) -> None:
        """Remembers `span` and registers it with the client now (without waiting)
        and with every client built after a reconnect."""
        if span.size <= 0:
            raise ValueError(f"cannot register an empty span: {span}")
        self._spans.append(span)
        self._caller.submit(self._register_spans_or_log)

    def close(self) -> None:
        self._caller.close()

    def _answered(self, codes: list[int], what: str) -> list[int]:
        """`codes`, unless they say the master did not answer the call at all (which
        marks the store down: its thread then probes the master after a back-off)."""
        if codes and all(c in _MASTER_DOWN for c in codes):
            raise RemoteStoreError(f"{what}: the master did not answer ({codes[0]})")
        return codes

    # -- on the store's thread -------------------------------------------------

    def _recover(self) -> None:
        if self._client is not None:
            codes = self._client.batch_is_exist([_PROBE_KEY])
            if codes and codes[0] >= 0:
                return
            self._close_client()
        # A failed `setup` holds the GIL for 90 s (20 retries inside Mooncake), so
        # it is only tried once the master and its metadata server take connections.
        _probe_tcp(self._url.host, self._url.port or 0)
        meta = urlsplit(self._metadata)
        _probe_tcp(meta.hostname or "", meta.port or 80)
        from mooncake.store import MooncakeDistributedStore

        hostname = _local_hostname(self._url)
        # Else Mooncake's TCP transport advertises the machine's first non-loopback
        # address, which a master on loopback cannot reach.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)
        client = MooncakeDistributedStore()
        rc = client.setup(
            hostname,
            self._metadata,
            0,  # a pure client: the storage nodes hold the values
            _LOCAL_BUFFER_BYTES[self._role],
            self._protocol,
            self._device,
            self._master,
        )
        if rc != 0:
            raise RemoteStoreError(f"setup returned {rc}")
        self._client = client
        self._registered = set()
        self._register_spans()

    def _register_spans_or_log(self) -> None:
        try:
            self._register_spans()
        except RemoteStoreError as e:
            # Not fatal over TCP; over RDMA the calls on that memory will fail.
            logger.warning("%s: %s (tried again on a reconnect)", self.description, e)

    def _register_spans(self) -> None:
        for span in self._spans:
            if span in self._registered or self._client is None:
                continue
            rc = self._client.register_buffer(span.address, span.size)
            if rc != 0:
                raise RemoteStoreError(f"register_buffer of {span} returned {rc}")
            self._registered.add(span)

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


def _buffers(
    keys: Sequence[str], values: Sequence[Sequence[Span]]
) -> tuple[list[str], list[list[int]], list[list[int]]]:
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    ptrs = [[s.address for s in spans] for spans in values]
    sizes = [[s.size for s in spans] for spans in values]
    return list(keys), ptrs, sizes


def _probe_tcp(host: str, port: int) -> None:
    with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S):
        pass


def _local_hostname(url: RemoteUrl) -> str:
    """The address storage nodes reach this engine at: the URL's `local_hostname`,
    or the local address of the route to the master."""
    given = url.option("local_hostname")
    if given:
        return given
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((url.host, url.port or 9))  # no packet is sent: it picks a route
        return str(s.getsockname()[0])
