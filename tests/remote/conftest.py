"""Real store servers on loopback for the remote tier's tests, and host memory to move
values through. A server or client library that is not installed skips its tests with
the install line."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import time
from collections.abc import Callable, Iterator

import pytest

from vllm_cpu_offload.remote.store import RemoteStore, RemoteStoreError, Span
from vllm_cpu_offload.remote.value_format import CHECKSUM_MODULE
from vllm_cpu_offload.testing.store_servers import (
    MooncakeServers,
    RedisServer,
    ServerUnavailable,
)

# Bounds of a hang, not of a start's or a call's time (two cores at load 7): the
# tests assert outcomes, not durations.
UP_WITHIN_S = 300.0
HANG_S = 300.0

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


class HostMemory:
    """A zeroed host buffer handed out as spans."""

    def __init__(self, size: int) -> None:
        self._buffer = ctypes.create_string_buffer(size)
        self.address = ctypes.addressof(self._buffer)
        self.size = size

    def span(self, offset: int, size: int) -> Span:
        assert offset + size <= self.size
        return Span(self.address + offset, size)

    def write(self, offset: int, data: bytes) -> Span:
        ctypes.memmove(self.address + offset, data, len(data))
        return self.span(offset, len(data))

    def read(self, span: Span) -> bytes:
        return ctypes.string_at(span.address, span.size)


def requires(*modules: str) -> pytest.MarkDecorator:
    """Skips a test where one of `modules` is not installed: a store's client library,
    or the checksum library every store's values go through."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f"not installed: {', '.join(missing)}"
    )


def without_module(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    """`importlib.util.find_spec` finds no `missing` from now on."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name: None if name == missing else real(name),
    )


def _checksums_or_skip() -> None:
    """Every store checks its values with CRC-32C: without it none opens."""
    if importlib.util.find_spec(CHECKSUM_MODULE) is None:
        pytest.skip(f"{CHECKSUM_MODULE} is not installed; pip install google-crc32c")


def wait_until_up(store: RemoteStore, timeout_s: float = UP_WITHIN_S) -> None:
    """Until a call succeeds; fails the test past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            store.exists(["probe"], timeout_s=5.0)
            return
        except RemoteStoreError as e:
            last = e
            time.sleep(0.1)
    pytest.fail(f"{store.description} did not come up in {timeout_s} s: {last}")


@pytest.fixture
def memory() -> HostMemory:
    return HostMemory(16 << 20)


@pytest.fixture
def mooncake_factory() -> Iterator[Callable[..., MooncakeServers]]:
    """Makes `MooncakeServers` (started unless start=False), stopped at the end."""
    made: list[MooncakeServers] = []

    def make(global_segment_size: str = "256MB", start: bool = True) -> MooncakeServers:
        _checksums_or_skip()
        try:
            servers = MooncakeServers(global_segment_size)
        except ServerUnavailable as e:
            pytest.skip(str(e))
        made.append(servers)
        return servers.start() if start else servers

    yield make
    for servers in made:
        servers.stop()


@pytest.fixture(scope="module")
def mooncake() -> Iterator[MooncakeServers]:
    _checksums_or_skip()
    try:
        servers = MooncakeServers("256MB")
    except ServerUnavailable as e:
        pytest.skip(str(e))
    with servers:
        yield servers


@pytest.fixture
def redis_factory() -> Iterator[Callable[..., RedisServer]]:
    """Makes `RedisServer`s (started unless start=False), stopped at the end."""
    made: list[RedisServer] = []

    def make(start: bool = True, **kwargs: object) -> RedisServer:
        _checksums_or_skip()
        try:
            server = RedisServer(**kwargs)  # type: ignore[arg-type]
        except ServerUnavailable as e:
            pytest.skip(str(e))
        made.append(server)
        return server.start() if start else server

    yield make
    for server in made:
        server.stop()


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """One redis-server for a module's tests (their keys are apart by name)."""
    _checksums_or_skip()
    try:
        server = RedisServer()
    except ServerUnavailable as e:
        pytest.skip(str(e))
    with server:
        yield server.url
