"""`redis://`, `rediss://` and their `+cluster` forms: the remote tier on Redis or
Valkey (RESP), through redis-py.

Each batch is one round trip: a pipeline of `SET key value NX` for `put` (a key held
already counts as stored: a key names its bytes), `MGET` for `get` (a cluster splits it
per slot), a pipeline of `EXISTS` for `exists`. Values are bytes: `put` copies the spans
out before the call and `get` copies into them after it, both on the caller's thread, so
no span is touched once a call has returned, timed out or not: a call past its timeout
raises a plain `RemoteStoreError` (its late reply is dropped), never
`RemoteCallTimeout`, and nothing needs registering.

The calls run on the store's own thread (`BoundedCaller`), with the socket timeouts set
from the call's timeout (one client per distinct timeout; a caller uses a few), and the
caller waits at most that timeout. A server down at construction, a timeout, or a lost
connection all mark the store down: calls fail at once with `RemoteStoreError` until a
`PING` answers again. ACL user from the URL, password from the environment or its file
(`url.remote_password`); TLS for `rediss`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .bounded_call import BoundedCaller
from .store import RemoteCallTimeout, RemoteStore, RemoteStoreError, Span
from .url import RemoteUrl, remote_password

# The timeout of the client the thread's reconnect probe uses.
_PROBE_TIMEOUT_S = 2.0
# Clients kept, one per distinct call timeout; past this the oldest is closed.
_MAX_CLIENTS = 4

T = TypeVar("T")


class RedisRemoteStore(RemoteStore):
    """A Redis, Valkey or Redis cluster client as the host tier's `RemoteStore` (see
    the module docstring). The role does not matter here."""

    client_library = "redis"
    install_extra = "redis"

    def __init__(self, url: RemoteUrl, *, role: str = "worker") -> None:
        self._url = url
        self._password = remote_password()
        self._clients: dict[float, Any] = {}
        self._caller = BoundedCaller(
            f"remote store {url}", recover=self._recover, shutdown=self._close_clients
        )

    @property
    def description(self) -> str:
        kind = "Redis cluster" if self._url.is_cluster else "Redis"
        tls = ", TLS" if self._url.is_tls else ""
        user = f" as {self._url.username}" if self._url.username else ""
        return f"{kind} at {self._url.host}:{self._url.port}{user}{tls}"

    @property
    def is_up(self) -> bool:
        """Whether calls go to the store now (False: they fail at once)."""
        return self._caller.is_up

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        if not keys:
            return []
        key_list = list(keys)

        def run() -> list[Any]:
            pipe = self._client(timeout_s).pipeline(transaction=False)
            for key in key_list:
                pipe.exists(key)
            return list(pipe.execute())

        return [n == 1 for n in self._call(run, timeout_s, "exists")]

    def put(
        self, keys: Sequence[str], values: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        items = [
            (key, b"".join(ctypes.string_at(s.address, s.size) for s in spans))
            for key, spans in zip(keys, values, strict=True)
        ]

        def run() -> list[Any]:
            pipe = self._client(timeout_s).pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, nx=True)
            # A refused SET (out of memory) is that key's failure, not the batch's.
            return list(pipe.execute(raise_on_error=False))

        replies = self._call(run, timeout_s, "put")
        # True: stored; None: held already (NX); an exception: refused.
        return [r is True or r is None for r in replies]

    def get(
        self, keys: Sequence[str], into: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        if len(keys) != len(into):
            raise ValueError(f"{len(keys)} keys but {len(into)} values")
        if not keys:
            return []
        key_list = list(keys)

        def run() -> list[bytes | None]:
            client = self._client(timeout_s)
            if self._url.is_cluster:
                return list(client.mget_nonatomic(key_list))
            return list(client.mget(key_list))

        found = self._call(run, timeout_s, "get")
        return [_fill(value, spans) for value, spans in zip(found, into, strict=True)]

    def close(self) -> None:
        self._caller.close()

    def _call(self, run: Callable[[], T], timeout_s: float, what: str) -> T:
        try:
            return self._caller.call(run, timeout_s, what)
        except RemoteCallTimeout as e:
            # The call goes on with bytes of its own, not the caller's spans.
            raise RemoteStoreError(str(e)) from None

    # -- on the store's thread -------------------------------------------------

    def _recover(self) -> None:
        if not self._client(_PROBE_TIMEOUT_S).ping():
            raise RemoteStoreError("PING was not answered")

    def _client(self, timeout_s: float) -> Any:
        client = self._clients.get(timeout_s)
        if client is None:
            if len(self._clients) >= _MAX_CLIENTS:
                oldest = next(iter(self._clients))
                self._clients.pop(oldest).close()
            client = self._clients[timeout_s] = self._new_client(timeout_s)
        return client

    def _new_client(self, timeout_s: float) -> Any:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kwargs: dict[str, Any] = {
            "host": self._url.host,
            "port": self._url.port,
            "username": self._url.username,
            "password": self._password,
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            # The caller's timeout is the whole budget: no retry inside redis-py.
            "retry": Retry(NoBackoff(), 0),
        }
        if self._url.is_tls:
            kwargs["ssl"] = True
            kwargs["ssl_ca_certs"] = self._url.option("ssl_ca_certs")
        if self._url.is_cluster:
            from redis.cluster import RedisCluster

            return RedisCluster(**kwargs)
        from redis import Redis

        return Redis(**kwargs, db=self._url.db)

    def _close_clients(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            client.close()


def _fill(value: bytes | None, spans: Sequence[Span]) -> bool:
    """Copies `value` into `spans` in order; False (nothing written) when the value is
    missing or not exactly as long as the spans."""
    if value is None or len(value) != sum(s.size for s in spans):
        return False
    # The bytes object's own buffer, so no slice is copied on the way.
    source = ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value or 0
    for span in spans:
        ctypes.memmove(span.address, source, span.size)
        source += span.size
    return True
