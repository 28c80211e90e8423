"""The RESP backend: its URLs and client library, then on a real redis-server: ACL
users with the password from the environment or a file, a server down at start or
stopped mid-run, a full server, and a one-node cluster. Calls return or raise within
their timeout (plus slack)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.remote.redis_store import RedisRemoteStore
from vllm_cpu_offload.remote.registry import check_remote_url, open_store
from vllm_cpu_offload.remote.store import RemoteStore, RemoteStoreError
from vllm_cpu_offload.remote.url import PASSWORD_ENV, PASSWORD_FILE_ENV
from vllm_cpu_offload.remote.value_format import CHECKSUM_MODULE
from vllm_cpu_offload.testing.store_servers import RedisServer

from .conftest import HostMemory, requires, wait_until_up, without_module

TIMEOUT_S = 2.0
SLACK_S = 3.0


@pytest.fixture(autouse=True)
def _no_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_FILE_ENV, raising=False)


def _round_trip(store: RemoteStore, memory: HostMemory, key: str) -> None:
    value = [memory.write(0, b"head"), memory.write(4096, b"payload" * 100)]
    assert store.put([key], [value], TIMEOUT_S * 5) == [True]
    into = [memory.span(1 << 20, 4), memory.span(2 << 20, 700)]
    assert store.get([key], [into], TIMEOUT_S * 5) == [True]
    assert memory.read(into[0]) + memory.read(into[1]) == b"head" + b"payload" * 100


def _fails_in_time(store: RemoteStore) -> None:
    start = time.monotonic()
    with pytest.raises(RemoteStoreError):
        store.exists(["k"], TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S


@requires("redis", CHECKSUM_MODULE)
def test_urls_resolve_without_connecting() -> None:
    # Every RESP scheme names the class; checking connects to nothing.
    for scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        assert check_remote_url(f"{scheme}://10.255.0.1:1")[0] is RedisRemoteStore


@requires(CHECKSUM_MODULE)
def test_missing_client_library_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A built-in scheme whose client library is absent: the pip line to fix it.
    without_module(monkeypatch, "redis")
    with pytest.raises(OffloadConfigError, match=r"vllm-cpu-offload\[redis\]"):
        check_remote_url("redis://h:6379")


def test_acl_user_with_password_from_env(
    redis_factory: Callable[..., RedisServer],
    memory: HostMemory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The URL names the user, the env var holds the password: values round-trip.
    server = redis_factory(username="kv", password="pw-from-env")
    monkeypatch.setenv(PASSWORD_ENV, "pw-from-env")
    store = open_store(server.url, role="worker")
    wait_until_up(store)
    _round_trip(store, memory, "acl/env")
    assert "pw-from-env" not in store.description
    store.close()


def test_acl_password_from_file_and_a_wrong_one(
    redis_factory: Callable[..., RedisServer],
    memory: HostMemory,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # A wrong password does not raise at construction: calls fail. The right one,
    # from the file, works.
    server = redis_factory(username="kv", password="pw-in-file")
    monkeypatch.setenv(PASSWORD_ENV, "wrong")
    wrong = open_store(server.url, role="worker")
    _fails_in_time(wrong)
    wrong.close()
    monkeypatch.delenv(PASSWORD_ENV)
    (tmp_path / "pw").write_text("pw-in-file\n")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(tmp_path / "pw"))
    store = open_store(server.url, role="worker")
    wait_until_up(store)
    _round_trip(store, memory, "acl/file")
    store.close()


def test_down_at_start_then_stopped_and_back(
    redis_factory: Callable[..., RedisServer], memory: HostMemory
) -> None:
    # No server at construction: no raise, calls fail in time; it starts: works;
    # it stops mid-run: calls fail in time; it is back: works again.
    server = redis_factory(start=False)
    store = open_store(server.url, role="worker")
    _fails_in_time(store)
    server.start()
    wait_until_up(store)
    _round_trip(store, memory, "late/1")
    server.stop_server()
    for _ in range(3):
        start = time.monotonic()
        with contextlib.suppress(RemoteStoreError):
            store.exists(["late/1"], TIMEOUT_S)
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    server.start()
    wait_until_up(store)
    _round_trip(store, memory, "late/2")  # the server kept nothing (no persistence)
    store.close()


def test_full_server_refuses(
    redis_factory: Callable[..., RedisServer], memory: HostMemory
) -> None:
    # maxmemory with noeviction: some puts of a batch are refused, not the batch.
    server = redis_factory(maxmemory="8mb")
    store = open_store(server.url, role="worker")
    wait_until_up(store)
    value = [memory.span(0, 1 << 20)]
    stored = store.put([f"full/{i}" for i in range(16)], [value] * 16, 30.0)
    assert any(stored) and not all(stored)
    assert store.exists(["full/0"], TIMEOUT_S * 5) == [True]
    store.close()


def test_one_node_cluster(
    redis_factory: Callable[..., RedisServer], memory: HostMemory
) -> None:
    # redis+cluster:// goes through RedisCluster: keys of many slots round-trip.
    server = redis_factory(cluster=True)
    store = open_store(server.url, role="worker")
    wait_until_up(store)
    keys = [f"slot/{i}" for i in range(20)]
    values = [[memory.write(i * 64, bytes([i]) * 64)] for i in range(20)]
    assert store.put(keys, values, TIMEOUT_S * 5) == [True] * 20
    into = [[memory.span((1 << 20) + i * 64, 64)] for i in range(20)]
    assert store.get(keys, into, TIMEOUT_S * 5) == [True] * 20
    assert [memory.read(s[0]) for s in into] == [bytes([i]) * 64 for i in range(20)]
    assert store.exists([*keys[:2], "nope"], TIMEOUT_S * 5) == [True, True, False]
    store.close()


def test_hung_server_times_out_and_recovers(
    redis_factory: Callable[..., RedisServer], memory: HostMemory
) -> None:
    # A server that stops answering: calls raise within their timeout; it answers
    # again: the store works without being rebuilt.
    server = redis_factory()
    store = open_store(server.url, role="worker")
    wait_until_up(store)
    _round_trip(store, memory, "hung/1")
    server.pause()
    try:
        for _ in range(3):
            _fails_in_time(store)
    finally:
        server.resume()
    wait_until_up(store)
    _round_trip(store, memory, "hung/2")
    store.close()


def test_tls_with_acl(
    redis_factory: Callable[..., RedisServer],
    memory: HostMemory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # rediss:// with the server's CA and an ACL user round-trips; without the CA
    # the certificate is refused and calls fail (construction still does not raise).
    server = redis_factory(tls=True, username="kv", password="tls-pw")
    monkeypatch.setenv(PASSWORD_ENV, "tls-pw")
    untrusted = open_store(server.url.partition("?")[0], role="worker")
    _fails_in_time(untrusted)
    untrusted.close()
    store = open_store(server.url, role="worker")
    wait_until_up(store)
    _round_trip(store, memory, "tls/1")
    assert "TLS" in store.description
    store.close()
