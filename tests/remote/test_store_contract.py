"""What every built-in backend does the same, on a real server: values given as two
spans come back byte for byte; exists, missing keys, repeated puts, wrong lengths."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from vllm_cpu_offload.remote.mooncake_store import MooncakeRemoteStore
from vllm_cpu_offload.remote.redis_store import RedisRemoteStore
from vllm_cpu_offload.remote.registry import open_store
from vllm_cpu_offload.remote.store import RemoteStore, RemoteStoreError

from .conftest import HostMemory, wait_until_up

TIMEOUT_S = 10.0
HEADER = 64
BLOCK = 256 << 10


@pytest.fixture(params=["mooncake", "redis"])
def store(request: pytest.FixtureRequest, memory: HostMemory) -> Iterator[RemoteStore]:
    backend: type[RemoteStore]
    if request.param == "mooncake":
        url, backend = request.getfixturevalue("mooncake").url, MooncakeRemoteStore
    else:
        url, backend = request.getfixturevalue("redis_url"), RedisRemoteStore
    opened = open_store(url, role="worker")
    assert type(opened) is backend
    opened.register(memory.span(0, memory.size))
    wait_until_up(opened)
    yield opened
    opened.close()


def _value(memory: HostMemory, slot: int, seed: bytes) -> list:
    """A value as the host tier gives it: a header span and a block span, apart."""
    base = slot * (HEADER + BLOCK + 4096)
    header = memory.write(base, (seed * HEADER)[:HEADER])
    block = memory.write(base + HEADER + 4096, os.urandom(BLOCK))
    return [header, block]


def test_round_trip_of_two_span_values(store: RemoteStore, memory: HostMemory) -> None:
    # Three values put as header + block spans come back into other spans exactly.
    keys = [f"rt/{os.urandom(8).hex()}/{i}" for i in range(3)]
    values = [_value(memory, i, bytes([65 + i])) for i in range(3)]
    assert store.put(keys, values, TIMEOUT_S) == [True] * 3
    into = [_value(memory, 10 + i, b"\0") for i in range(3)]
    assert store.get(keys, into, TIMEOUT_S) == [True] * 3
    for sent, got in zip(values, into, strict=True):
        assert [memory.read(s) for s in got] == [memory.read(s) for s in sent]


def test_exists_and_missing_keys(store: RemoteStore, memory: HostMemory) -> None:
    # A missing key is False in exists and get, next to a present one.
    key, missing = f"ex/{os.urandom(8).hex()}", f"none/{os.urandom(8).hex()}"
    assert store.put([key], [_value(memory, 0, b"x")], TIMEOUT_S) == [True]
    assert store.exists([key, missing], TIMEOUT_S) == [True, False]
    into = [_value(memory, 1, b"\0"), _value(memory, 2, b"\0")]
    assert store.get([key, missing], into, TIMEOUT_S) == [True, False]


def test_put_of_a_held_key_counts_as_stored(
    store: RemoteStore, memory: HostMemory
) -> None:
    # Values are immutable by key: a second put of the same key is a success.
    key = f"again/{os.urandom(8).hex()}"
    value = _value(memory, 0, b"y")
    assert store.put([key], [value], TIMEOUT_S) == [True]
    assert store.put([key], [value], TIMEOUT_S) == [True]


def test_get_of_another_length_fails(store: RemoteStore, memory: HostMemory) -> None:
    # Spans shorter or longer than the value: False, not a partial read.
    key = f"len/{os.urandom(8).hex()}"
    assert store.put([key], [_value(memory, 0, b"z")], TIMEOUT_S) == [True]
    short = [memory.span(1 << 20, HEADER), memory.span(2 << 20, BLOCK - 1)]
    long = [memory.span(1 << 20, HEADER), memory.span(2 << 20, BLOCK + 1)]
    assert store.get([key], [short], TIMEOUT_S) == [False]
    assert store.get([key], [long], TIMEOUT_S) == [False]


def test_empty_batches(store: RemoteStore) -> None:
    # An empty batch is an empty answer, not a call.
    assert store.exists([], TIMEOUT_S) == []
    assert store.put([], [], TIMEOUT_S) == []
    assert store.get([], [], TIMEOUT_S) == []


def test_calls_after_close_fail(store: RemoteStore) -> None:
    # A closed store refuses calls with the store's own error, at once.
    store.close()
    with pytest.raises(RemoteStoreError, match="closed"):
        store.exists(["k"], TIMEOUT_S)
