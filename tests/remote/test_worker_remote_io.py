"""A worker's store traffic against a real redis-server: write-through, fetches into
host blocks, values checked before use, faults that cost misses, bounded writes."""

from __future__ import annotations

import ctypes
import time
from typing import Any

import pytest
import torch

from vllm_cpu_offload.block_transfer import RemoteBlocks
from vllm_cpu_offload.kv_shards import WorkerShards
from vllm_cpu_offload.remote import value_format
from vllm_cpu_offload.remote.namespace import shard_key
from vllm_cpu_offload.remote.registry import open_store
from vllm_cpu_offload.remote.store import RemoteStore, RemoteStoreError, Span
from vllm_cpu_offload.scheduler.remote_lookup import RemoteLookup
from vllm_cpu_offload.testing.store_servers import (
    UNBOUNDED_CALL_S,
    free_port,
)
from vllm_cpu_offload.worker import remote_io
from vllm_cpu_offload.worker.block_values import BlockValues
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.kv_layout import KVLayout
from vllm_cpu_offload.worker.remote_io import RemoteIO, RemoteResults

from .conftest import HANG_S, UP_WITHIN_S, requires

NAMESPACE = "vco-test"
HOST_BLOCKS = 8


def _host(seed: int) -> HostBuffer:
    cache = torch.zeros(HOST_BLOCKS, 2, 4, 16)
    layout = KVLayout.from_tensor(cache)
    host = HostBuffer({"l0": layout}, HOST_BLOCKS, pin=False)
    g = torch.Generator().manual_seed(seed)
    host.tensor.copy_(torch.randint(0, 256, host.tensor.shape, generator=g))
    return host


def _connected(url: str, role: str = "worker") -> RemoteStore:
    """A store that answered once: stores connect in the background after they are
    made, and fail calls until then."""
    store = open_store(url, role=role)
    deadline = time.monotonic() + UP_WITHIN_S
    while True:
        try:
            store.exists(["probe"], 2.0)
            return store
        except RemoteStoreError:
            assert time.monotonic() < deadline, "the store never answered"
            time.sleep(0.05)


def _io(url: str, host: HostBuffer, rank: str = "tp0-pp0", **kw: Any) -> RemoteIO:
    values = BlockValues(
        host, [rank], blocks_per_host_block=int(kw.pop("blocks_per_host_block", 1))
    )
    options: dict = dict(
        namespace=NAMESPACE,
        # Unbounded: a call that a loaded machine makes slow is no miss here (the
        # tests of the bound pass their own).
        timeout_s=UNBOUNDED_CALL_S,
        max_queued_writes=HOST_BLOCKS,
    )
    options.update(kw)
    store = open_store(url, role="worker") if kw.get("down") else _connected(url)
    options.pop("down", None)
    return RemoteIO(store, host, values, **options)


def _until(io: RemoteIO, done: object) -> RemoteResults:
    """Polls until `done(results so far)`; the bound is a hang's."""
    merged = RemoteResults()
    deadline = time.monotonic() + HANG_S
    while True:
        got = io.poll()
        merged.fetched.update(got.fetched)
        merged.written.update(got.written)
        for k, v in got.stats.items():
            merged.stats[k] = merged.stats.get(k, 0) + v
        if done(merged):  # type: ignore[operator]
            return merged
        assert time.monotonic() < deadline, merged
        time.sleep(0.01)


def test_written_blocks_come_back_into_other_host_blocks(redis_url: str) -> None:
    writer_host, reader_host = _host(1), _host(2)
    writer, reader = _io(redis_url, writer_host), _io(redis_url, reader_host)
    keys = [f"{NAMESPACE}/0/a{i}" for i in range(3)]
    writer.write(RemoteBlocks(1, keys, [5, 0, 3]))
    assert _until(writer, lambda r: 1 in r.written).written[1] == [True] * 3
    # The scheduler sees every rank's shard.
    lookup = RemoteLookup(
        _connected(redis_url, "scheduler"), ["tp0-pp0"], timeout_s=UNBOUNDED_CALL_S
    )
    missing = f"{NAMESPACE}/0/missing"
    assert lookup.held([*keys, missing]) == [True, True, True, False]
    assert lookup.held([missing, *keys]) == [False, True, True, True]
    reader.fetch(RemoteBlocks(2, [*keys, f"{NAMESPACE}/0/missing"], [1, 2, 4, 6]))
    results = _until(reader, lambda r: 2 in r.fetched)
    assert results.fetched[2] == [True, True, True, False]
    for src, dst in ((5, 1), (0, 2), (3, 4)):
        assert torch.equal(reader_host.tensor[dst], writer_host.tensor[src])
    assert results.stats["bytes_in"] == 3 * reader_host.block_bytes
    for io in (writer, reader):
        io.close()
    lookup.close()


def test_a_value_of_another_namespace_or_key_or_a_torn_one_is_a_miss(
    redis_url: str,
) -> None:
    host = _host(3)
    io = _io(redis_url, host)
    other = _io(redis_url, _host(4), namespace="vco-other-model")
    other.write(RemoteBlocks(1, [f"{NAMESPACE}/0/foreign"], [0]))
    _until(other, lambda r: 1 in r.written)
    # A torn value: a header that names its key, then bytes that do not match it.
    store = _connected(redis_url)
    key = shard_key(f"{NAMESPACE}/0/torn", "tp0-pp0")
    payload = bytes(host.block_bytes)
    header = value_format.pack_header(
        key,
        NAMESPACE,
        ctypes.addressof(ctypes.create_string_buffer(payload)),
        len(payload),
    )
    torn = ctypes.create_string_buffer(header + b"\x01" + payload[1:])
    addr = ctypes.addressof(torn)
    assert store.put([key], [[Span(addr, len(header) + len(payload))]], 5.0) == [True]
    before = host.tensor.clone()
    io.fetch(RemoteBlocks(2, [f"{NAMESPACE}/0/foreign", f"{NAMESPACE}/0/torn"], [0, 1]))
    results = _until(io, lambda r: 2 in r.fetched)
    assert results.fetched[2] == [False, False]
    assert results.stats["rejected_blocks"] == 2
    # Rejected bytes may sit in host memory, but no block is reported as arrived.
    assert torch.equal(host.tensor[2:], before[2:])
    for x in (io, other):
        x.close()
    store.close()


def test_a_full_write_queue_drops_and_says_so(redis_url: str) -> None:
    io = _io(redis_url, _host(5), max_queued_writes=2)
    kept = io.write(RemoteBlocks(1, [f"{NAMESPACE}/q/{i}" for i in range(2)], [0, 1]))
    dropped = io.write(
        RemoteBlocks(2, [f"{NAMESPACE}/q/x{i}" for i in range(2)], [2, 3])
    )
    results = _until(io, lambda r: {1, 2} <= r.written.keys())
    # The first may be taken off the queue before the second comes: then both fit.
    assert kept and results.written[1] == [True, True]
    if not dropped:
        assert results.stats["write_dropped_blocks"] == 2
        assert results.written[2] == [False, False]
    io.close()


@requires("redis", value_format.CHECKSUM_MODULE)
def test_a_store_that_is_down_costs_misses_within_the_timeout() -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    io = _io(url, _host(6), timeout_s=0.5, down=True)
    io.write(RemoteBlocks(1, ["k"], [0]))
    io.fetch(RemoteBlocks(2, ["k"], [1]))
    results = _until(io, lambda r: 1 in r.written and 2 in r.fetched)
    assert results.fetched[2] == [False] and results.written[1] == [False]
    # A back-off longer than the test: its second call is never a second try.
    lookup = RemoteLookup(
        open_store(url, role="scheduler"), ["tp0-pp0"], timeout_s=0.5, backoff_s=3600
    )
    assert lookup.held(["k"]) == [False]
    assert lookup.failures == 1
    # Left alone for its back-off: no second wait.
    assert lookup.held(["k"]) == [False] and lookup.failures == 1
    io.close()
    lookup.close()


def test_fetches_go_in_calls_of_a_bounded_size(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = _host(7)
    writer = _io(redis_url, host)
    keys = [f"{NAMESPACE}/b/{i}" for i in range(7)]
    writer.write(RemoteBlocks(1, keys, list(range(7))))
    _until(writer, lambda r: 1 in r.written)
    monkeypatch.setattr(remote_io, "FETCH_BATCH_BYTES", 3 * host.block_bytes)
    reader = _io(redis_url, _host(8))
    reader.fetch(RemoteBlocks(2, keys, list(range(7))))
    results = _until(reader, lambda r: 2 in r.fetched)
    assert results.fetched[2] == [True] * 7
    assert results.stats["fetch_calls"] == 3  # 3 + 3 + 1 blocks
    for io in (writer, reader):
        io.close()


def test_an_idle_step_reports_a_fetch_that_ends_while_it_waits(redis_url: str) -> None:
    """A step in which nothing computes waits for the fetch (bounded) instead of
    spinning on empty steps: the step that starts the async load reports it."""
    pytest.importorskip("vllm")
    from vllm_cpu_offload.block_transfer import AsyncLoad, BlockTransfer
    from vllm_cpu_offload.metadata import OffloadStepMetadata
    from vllm_cpu_offload.worker.shared_tier import (
        RemoteSettings,
        attach_shared_tier_worker,
    )
    from vllm_cpu_offload.worker.tier_worker import HostTierWorker

    def caches(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        shape = (HOST_BLOCKS, 2, 4, 16)
        return {f"l{i}": torch.randn(*shape, generator=g) for i in (0, 1)}

    written = caches(9)
    writer_host = HostBuffer.for_kv_caches(written, HOST_BLOCKS, pin=False)
    writer_host.tensor[3].copy_(torch.arange(writer_host.tensor[3].numel()) % 251)
    writer = _io(redis_url, writer_host)
    writer.write(RemoteBlocks(1, [f"{NAMESPACE}/w/0"], [3]))
    _until(writer, lambda r: 1 in r.written)

    settings = RemoteSettings(
        open_store=lambda: _connected(redis_url),
        namespace=NAMESPACE,
        shards=WorkerShards(("tp0-pp0",), writes=True, per_head=False),
        timeout_s=UNBOUNDED_CALL_S,
        # A wait far longer than the fetch: the assertion does not depend on timing.
        idle_fetch_wait_s=60.0,
    )
    worker = HostTierWorker(HOST_BLOCKS, HOST_BLOCKS)
    attach_shared_tier_worker(worker, settings)
    device = caches(10)
    worker.register_kv_caches(device)
    load = AsyncLoad(
        load=BlockTransfer(7, [2], [5], req_id="r"),
        fetch=RemoteBlocks(7, [f"{NAMESPACE}/w/0"], [5]),
        fetched_from=0,
    )
    meta = OffloadStepMetadata(async_loads=[load], idle=True)
    worker.begin_step(meta)
    worker.finish_step()
    _, recving = worker.get_finished()
    assert recving == {"r"}
    # Device block 2 holds the fetched block: stored back, it is the writer's bytes.
    store_back = OffloadStepMetadata(stores=[BlockTransfer(8, [2], [6], req_id="s")])
    worker.begin_step(store_back)
    for name in device:
        worker.save_layer(name)
    worker.finish_step()
    worker.get_finished()
    assert worker.engine is not None
    assert torch.equal(worker.engine.host.tensor[6], writer_host.tensor[3])
    worker.shutdown()
    writer.close()
