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
and a block span; a call past its timeout goes on using them (`RemoteCallTimeout`).
The client's registered memory follows `register` and `unregister`: each change, and
every recovery, brings the client in line with the live spans (a span unregistered
first, since a new one may take its address), and a new client registers only the
live ones. The store's thread runs these before any later call. Mooncake over TCP has
no authentication: keep the master and the storage nodes on a private network.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from .bounded_call import BoundedCaller
from .store import RemoteStore, RemoteStoreError, Span
from .url import MOONCAKE_METADATA_PORT, RemoteUrl

logger = logging.getLogger(__name__)

# Mooncake's per-key code that says the master did not answer (RPC_FAIL).
_MASTER_DOWN = frozenset({-900})
_PROBE_KEY = "vllm_cpu_offload/probe"
_PROBE_TIMEOUT_S = 2.0
_LOCAL_BUFFER_BYTES = {"scheduler": 0, "worker": 64 << 20}


class MooncakeRemoteStore(RemoteStore):
    """A Mooncake Store client as the host tier's `RemoteStore` (see the module
    docstring). `role` "scheduler" builds a client without a transfer buffer (it only
    asks `exists`); "worker" registers its host memory through `register`."""

    client_library = "mooncake.store"
    install_extra = "mooncake"

    # The first wait before asking a store that stopped answering again.
    min_backoff_s = 0.2

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
        # Live spans and those unregistered since the client last caught up: written
        # by the caller, read by the store's thread, under `_spans_lock`.
        self._spans_lock = threading.Lock()
        self._spans: list[Span] = []
        self._released: list[Span] = []
        self._client: Any = None
        # What the client has registered now (the store's thread only).
        self._registered: set[Span] = set()
        self._caller = BoundedCaller(
            f"remote store {url}",
            recover=self._recover,
            shutdown=self._close_client,
            min_backoff_s=self.min_backoff_s,
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
        """Registers `span` with the client before any later call (at once if the
        store is up, else when it recovers) and with every client built later."""
        if span.size <= 0:
            raise ValueError(f"cannot register an empty span: {span}")
        with self._spans_lock:
            self._spans.append(span)
        self._caller.submit(self._sync_registrations_or_log)

    def unregister(self, span: Span) -> None:
        """Forgets `span`: the client unregisters it before any later call, and no
        client registers it again."""
        with self._spans_lock:
            if span not in self._spans:
                raise ValueError(f"{span} is not registered")
            self._spans.remove(span)
            self._released.append(span)
        self._caller.submit(self._sync_registrations_or_log)

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
                # Before any call: what changed while down, what failed to register.
                self._sync_registrations_or_log()
                return
            self._close_client()
        self._client = self._new_client()
        self._sync_registrations_or_log()

    def _new_client(self) -> Any:
        """A Mooncake client set up against the master (raises if it cannot be)."""
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
        return client

    def _sync_registrations_or_log(self) -> None:
        try:
            self._sync_registrations()
        except RemoteStoreError as e:
            # Not fatal over TCP; over RDMA the calls on that memory will fail.
            logger.warning(
                "%s: %s (tried again on the next change)", self.description, e
            )

    def _sync_registrations(self) -> None:
        """Makes what the client registered the live spans: unregistered spans go
        first (a span registered since may take a freed one's address)."""
        if self._client is None:
            return
        with self._spans_lock:
            released, self._released = self._released, []
            live = list(self._spans)
        failed: list[str] = []
        for span in released:
            if span in self._registered:
                self._registered.discard(span)
                rc = self._client.unregister_buffer(span.address)
                if rc != 0:
                    failed.append(f"unregister_buffer of {span} returned {rc}")
        for span in live:
            if span not in self._registered:
                rc = self._client.register_buffer(span.address, span.size)
                if rc == 0:
                    self._registered.add(span)
                else:
                    failed.append(f"register_buffer of {span} returned {rc}")
        if failed:
            raise RemoteStoreError("; ".join(failed))

    def _close_client(self) -> None:
        client, self._client = self._client, None
        # A new client knows nothing of the old one's registrations.
        self._registered = set()
        with self._spans_lock:
            self._released = []
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
