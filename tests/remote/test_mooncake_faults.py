"""Mooncake Store: its URLs and client library, then its faults on real processes: a
full pool, a storage node that dies and comes back, a master that is not up yet. Every
call returns or raises within its timeout (plus slack for two busy cores); durations are
not asserted otherwise."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.remote.mooncake_store import MooncakeRemoteStore
from vllm_cpu_offload.remote.registry import check_remote_url, open_store
from vllm_cpu_offload.remote.store import (
    RemoteCallTimeout,
    RemoteStore,
    RemoteStoreError,
    Span,
)
from vllm_cpu_offload.remote.value_format import CHECKSUM_MODULE
from vllm_cpu_offload.testing.store_servers import MooncakeServers

from .conftest import HostMemory, requires, wait_until_up, without_module

TIMEOUT_S = 2.0
SLACK_S = 3.0  # a busy machine's scheduling, not the store's
VALUE = 1 << 20


def _bounded(fn: Callable[[], object], timeout_s: float = TIMEOUT_S) -> object:
    """`fn()`'s result or its RemoteStoreError, after checking it came back in time."""
    start = time.monotonic()
    try:
        result: object = fn()
    except RemoteStoreError as e:
        result = e
    assert time.monotonic() - start < timeout_s + SLACK_S
    return result


def _open(servers: MooncakeServers, memory: HostMemory) -> RemoteStore:
    store = open_store(servers.url, role="worker")
    store.register(memory.span(0, memory.size))
    return store


@requires("mooncake", CHECKSUM_MODULE)
def test_url_resolves_without_connecting() -> None:
    # The scheme names the class; checking connects to nothing.
    url = "mooncake://10.255.0.1:1?protocol=rdma&device=mlx5_0"
    assert check_remote_url(url)[0] is MooncakeRemoteStore


@requires(CHECKSUM_MODULE)
def test_missing_client_library_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without Mooncake's client: the pip line to fix it.
    without_module(monkeypatch, "mooncake")
    with pytest.raises(OffloadConfigError, match=r"vllm-cpu-offload\[mooncake\]"):
        check_remote_url("mooncake://h:50051")


def test_full_pool_refuses(
    mooncake_factory: Callable[..., MooncakeServers], memory: HostMemory
) -> None:
    # A 16 MB pool takes some 1 MiB values of a batch of 40 and refuses the rest.
    servers = mooncake_factory("16MB")
    store = _open(servers, memory)
    wait_until_up(store)
    keys = [f"full/{i}" for i in range(40)]
    values = [[memory.span(0, VALUE)] for _ in keys]
    stored = store.put(keys, values, timeout_s=30.0)
    assert any(stored) and not all(stored)
    store.close()


def test_killed_storage_node_fails_in_time_and_recovers(
    mooncake_factory: Callable[..., MooncakeServers], memory: HostMemory
) -> None:
    # Values on a killed node: calls answer within the timeout (a miss or an error)
    # and the store works again once a node is back.
    servers = mooncake_factory()
    store = _open(servers, memory)
    wait_until_up(store)
    keys = [f"node/{i}" for i in range(4)]
    values = [[memory.span(i * VALUE, VALUE)] for i in range(4)]
    assert store.put(keys, values, TIMEOUT_S * 5) == [True] * 4
    servers.kill_storage_node()
    into: list[list[Span]] = [[memory.span((8 + i) * VALUE, VALUE)] for i in range(4)]
    for _ in range(5):
        got = _bounded(lambda: store.get(keys, into, TIMEOUT_S))
        assert isinstance(got, RemoteStoreError) or got == [False] * 4
        _bounded(lambda: store.exists(keys, TIMEOUT_S))
        _bounded(lambda: store.put(["node/new"], values[:1], TIMEOUT_S))
    servers.restart_storage_node()
    wait_until_up(store)
    fresh = [f"node/fresh/{os.urandom(4).hex()}"]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if store.put(fresh, values[:1], TIMEOUT_S) == [True]:
                break
        except RemoteStoreError:
            pass
        time.sleep(0.2)
    assert store.get(fresh, into[:1], TIMEOUT_S * 5) == [True]
    assert memory.read(into[0][0]) == memory.read(values[0][0])
    store.close()


def test_master_down_at_construction(
    mooncake_factory: Callable[..., MooncakeServers], memory: HostMemory
) -> None:
    # No master yet: construction does not raise, calls fail at once; once the
    # master and a node are up the same store object works.
    servers = mooncake_factory(start=False)
    store = _open(servers, memory)
    for _ in range(3):
        assert isinstance(_bounded(lambda: store.exists(["k"], TIMEOUT_S)), Exception)
    servers.start()
    wait_until_up(store)
    value = [memory.write(0, b"after start")]
    assert store.put(["late/k"], [value], TIMEOUT_S * 5) == [True]
    into = [memory.span(1 << 20, value[0].size)]
    assert store.get(["late/k"], [into], TIMEOUT_S * 5) == [True]
    assert memory.read(into[0]) == b"after start"
    store.close()


def test_scheduler_role_asks_exists_without_a_buffer(
    mooncake: MooncakeServers, memory: HostMemory
) -> None:
    # The scheduler's client (no transfer buffer) sees what a worker stored.
    worker = _open(mooncake, memory)
    scheduler = open_store(mooncake.url, role="scheduler")
    wait_until_up(worker)
    wait_until_up(scheduler)
    key = f"sched/{os.urandom(8).hex()}"
    assert worker.put([key], [[memory.write(0, b"v" * 100)]], TIMEOUT_S * 5) == [True]
    assert scheduler.exists([key, key + "x"], TIMEOUT_S * 5) == [True, False]
    worker.close()
    scheduler.close()


def test_hung_master_times_out_then_fails_fast_and_recovers(
    mooncake_factory: Callable[..., MooncakeServers], memory: HostMemory
) -> None:
    # A master that stops answering: the call raises at its timeout, the next ones
    # fail at once without queueing behind it, and it works once the master answers.
    servers = mooncake_factory()
    store = _open(servers, memory)
    wait_until_up(store)
    value = [memory.write(0, b"kept")]
    assert store.put(["hung/k"], [value], TIMEOUT_S * 5) == [True]
    servers.pause_master()
    try:
        first = _bounded(lambda: store.exists(["hung/k"], TIMEOUT_S))
        assert isinstance(first, RemoteCallTimeout)
        for _ in range(3):
            later = _bounded(lambda: store.exists(["hung/k"], TIMEOUT_S))
            assert isinstance(later, RemoteStoreError)
    finally:
        servers.resume_master()
    wait_until_up(store)
    assert first.in_flight.result(timeout=60) is not None
    into = [memory.span(1 << 20, 4)]
    assert store.get(["hung/k"], [into], TIMEOUT_S * 5) == [True]
    assert memory.read(into[0]) == b"kept"
    store.close()


def test_restarted_master(
    mooncake_factory: Callable[..., MooncakeServers], memory: HostMemory
) -> None:
    # A master killed and started again: its values are gone (a miss), and the same
    # store object stores and reads again once the node has mounted its segment.
    servers = mooncake_factory()
    store = _open(servers, memory)
    wait_until_up(store)
    value = [memory.write(0, b"before")]
    assert store.put(["restart/old"], [value], TIMEOUT_S * 5) == [True]
    servers.restart_master()
    wait_until_up(store)
    into = [memory.span(1 << 20, 6)]
    old = _bounded(lambda: store.get(["restart/old"], [into], TIMEOUT_S))
    assert isinstance(old, RemoteStoreError) or old == [False]
    stored: object = None
    deadline = time.monotonic() + 90
    while stored != [True] and time.monotonic() < deadline:
        stored = _bounded(lambda: store.put(["restart/new"], [value], TIMEOUT_S))
        time.sleep(0.2)
    assert stored == [True]
    assert store.get(["restart/new"], [into], TIMEOUT_S * 5) == [True]
    assert memory.read(into[0]) == b"before"
    store.close()
