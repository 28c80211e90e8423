"""Memory named in a store call lives, registered, until that call has returned, on a
real Mooncake Store: a fetch or a write-through that outlives its timeout, and the
client's registrations across a hung master and a rebuilt client.

The client is Mooncake's own, subclassed to record what it registered and, where a
test must decide when a call that outlived its timeout returns, to hold that call at a
gate before it goes on to the real transfer. Buffers made with
`ctypes.create_string_buffer` are tracked by weak reference, so a held call can tell
whether the memory it was given is still the memory it was given. The bound on held
buffers needs calls that pile up, which no built-in store allows: an in-process store
whose calls never end by themselves stands in there. Redis, which copies bytes on the
caller's thread, has nothing to hold: its last test says so on a real server."""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from vllm_cpu_offload.block_transfer import RemoteBlocks
from vllm_cpu_offload.remote import value_format
from vllm_cpu_offload.remote.registry import open_store
from vllm_cpu_offload.remote.store import (
    RemoteCallTimeout,
    RemoteStore,
    RemoteStoreError,
    Span,
)
from vllm_cpu_offload.testing.store_servers import MooncakeServers, RedisServer
from vllm_cpu_offload.worker import remote_io
from vllm_cpu_offload.worker.block_values import BlockValues
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.kv_layout import KVLayout
from vllm_cpu_offload.worker.remote_io import RemoteIO, RemoteResults

from .conftest import HostMemory, requires, wait_until_up

NAMESPACE = "vco-held"
HOST_BLOCKS = 8
TIMEOUT_S = 1.0
BATCH_BLOCKS = 4  # blocks per fetch call: a staging buffer of a few KiB


class Allocations:
    """Every `ctypes.create_string_buffer` made while patched, by weak reference."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = ctypes.create_string_buffer
        self._made: list[tuple[int, int, weakref.ref[Any]]] = []

        def make(init: Any, size: int | None = None) -> Any:
            buffer = real(init) if size is None else real(init, size)
            address, length = ctypes.addressof(buffer), ctypes.sizeof(buffer)
            self._made.append((address, length, weakref.ref(buffer)))
            return buffer

        monkeypatch.setattr(ctypes, "create_string_buffer", make)

    def made(self, size: int) -> list[int]:
        """The addresses of the buffers of `size` bytes made, oldest first."""
        return [at for at, length, _ in self._made if length == size]

    def owner(self, address: int, size: int) -> weakref.ref[Any] | None:
        """The live buffer that holds those bytes now; None if none of ours does."""
        for at, length, ref in reversed(self._made):
            if at <= address and address + size <= at + length and ref() is not None:
                return ref
        return None


@dataclass
class Recorder:
    """What the clients made during a test registered and did; gates for calls."""

    allocations: Allocations
    clients: list[Any] = field(default_factory=list)
    # "get" or "put" -> the gate the next such call waits at (then the entry is gone)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    # held calls that found their memory freed, unregistered or rewritten
    problems: list[str] = field(default_factory=list)
    late_call_returned: threading.Event = field(default_factory=threading.Event)
    # the first address of each get's buffers: where its staging buffer begins
    get_addresses: list[int] = field(default_factory=list)


def _recording_client(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Makes the stores opened from now on build clients that record into the
    returned `Recorder` (the real client's calls, through a subclass)."""
    import mooncake.store

    recorder = Recorder(Allocations(monkeypatch))

    class Client(mooncake.store.MooncakeDistributedStore):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.registered: dict[int, int] = {}  # address -> size
            self.closed = False
            recorder.clients.append(self)

        def close(self) -> Any:
            self.closed = True
            return super().close()

        def register_buffer(self, address: int, size: int) -> int:
            rc = int(super().register_buffer(address, size))
            if rc == 0:
                self.registered[address] = size
            return rc

        def unregister_buffer(self, address: int) -> int:
            rc = int(super().unregister_buffer(address))
            if rc == 0:
                self.registered.pop(address, None)
            return rc

        def batch_get_into_multi_buffers(
            self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
        ) -> list[int]:
            recorder.get_addresses.append(ptrs[0][0])
            return self._gated(
                "get", keys, ptrs, sizes, super().batch_get_into_multi_buffers
            )

        def batch_put_from_multi_buffers(
            self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
        ) -> list[int]:
            return self._gated(
                "put", keys, ptrs, sizes, super().batch_put_from_multi_buffers
            )

        def _gated(
            self,
            what: str,
            keys: list[str],
            ptrs: list[list[int]],
            sizes: list[list[int]],
            real: Callable[..., list[int]],
        ) -> list[int]:
            gate = recorder.gates.pop(what, None)
            if gate is None:
                return real(keys, ptrs, sizes)
            spans = [
                (p, s)
                for ps, ss in zip(ptrs, sizes, strict=True)
                for p, s in zip(ps, ss, strict=True)
            ]
            # Host blocks are torch memory, not tracked: the staging and header
            # buffers are.
            found = [(p, s, recorder.allocations.owner(p, s)) for p, s in spans]
            owned = [(p, s, ref) for p, s, ref in found if ref is not None]
            before = [ctypes.string_at(p, s) for p, s, _ in owned]
            # On the store's thread: what goes wrong is recorded for the test to see.
            if not owned or not gate.wait(60):
                recorder.problems.append(f"{what}: no buffer of ours, or no release")
            for (p, s, ref), was in zip(owned, before, strict=True):
                if ref() is None:
                    recorder.problems.append(f"{what}: {p:#x} freed during the call")
                elif not self._is_registered(p, s):
                    recorder.problems.append(f"{what}: {p:#x} unregistered")
                elif what == "put" and ctypes.string_at(p, s) != was:
                    recorder.problems.append(f"{what}: {p:#x} rewritten")
            try:
                if any(ref() is None for _, _, ref in owned):
                    # The real transfer would write freed memory (or read it).
                    return [-1] * len(keys)
                return real(keys, ptrs, sizes)
            finally:
                recorder.late_call_returned.set()

        def _is_registered(self, address: int, size: int) -> bool:
            return any(
                at <= address and address + size <= at + length
                for at, length in self.registered.items()
            )

    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", Client)
    return recorder


def _host(seed: int) -> HostBuffer:
    layout = KVLayout.from_tensor(torch.zeros(HOST_BLOCKS, 2, 4, 16))
    host = HostBuffer({"l0": layout}, HOST_BLOCKS, pin=False)
    g = torch.Generator().manual_seed(seed)
    host.tensor.copy_(torch.randint(0, 256, host.tensor.shape, generator=g))
    return host


def _io(store: RemoteStore, host: HostBuffer) -> RemoteIO:
    wait_until_up(store)
    return RemoteIO(
        store,
        host,
        BlockValues(host, ["tp0-pp0"], blocks_per_host_block=1),
        namespace=NAMESPACE,
        timeout_s=TIMEOUT_S,
        max_queued_writes=HOST_BLOCKS,
    )


def _until(io: RemoteIO, done: Callable[[RemoteResults], bool]) -> RemoteResults:
    """Polls until `done(results so far)`; bounded generously (2 busy cores)."""
    merged = RemoteResults()
    deadline = time.monotonic() + 60
    while True:
        got = io.poll()
        merged.fetched.update(got.fetched)
        merged.written.update(got.written)
        for k, v in got.stats.items():
            merged.stats[k] = merged.stats.get(k, 0) + v
        if done(merged):
            return merged
        assert time.monotonic() < deadline, merged
        time.sleep(0.01)


def _staging_bytes(host: HostBuffer) -> int:
    return BATCH_BLOCKS * (value_format.HEADER_BYTES + host.block_bytes)


def _registered_staging(client: Any, host: HostBuffer) -> set[int]:
    size = _staging_bytes(host)
    return {at for at, length in client.registered.items() if length == size}


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    block_bytes = _host(0).block_bytes
    monkeypatch.setattr(remote_io, "FETCH_BATCH_BYTES", BATCH_BLOCKS * block_bytes)


def _keys(tag: str, n: int) -> list[str]:
    return [f"{NAMESPACE}/{tag}/{time.monotonic_ns()}/{i}" for i in range(n)]


def _write(io: RemoteIO, job_id: int, keys: Sequence[str], blocks: list[int]) -> None:
    io.write(RemoteBlocks(job_id, keys, blocks))
    written = _until(io, lambda r: job_id in r.written).written[job_id]
    assert written == [True] * len(keys)


@pytest.mark.usefixtures("small_batches")
def test_a_fetch_past_its_timeout_writes_into_memory_still_held(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fetch outlives its timeout and its transfer writes the staging buffer after
    # the fetch was reported a miss: that memory is still the buffer it was given,
    # alive and registered; once the call has returned, fetches find the blocks.
    recorder = _recording_client(monkeypatch)
    host = _host(1)
    io = _io(open_store(mooncake.url, role="worker"), host)
    keys = _keys("fetch", 3)
    _write(io, 1, keys, [0, 1, 2])
    release = recorder.gates["get"] = threading.Event()
    io.fetch(RemoteBlocks(2, keys, [4, 5, 6]))
    missed = _until(io, lambda r: 2 in r.fetched)
    assert missed.fetched[2] == [False] * 3 and missed.stats["fetch_failures"] == 1
    release.set()
    assert recorder.late_call_returned.wait(60)
    assert recorder.problems == []
    wait_until_up(io.store)
    host.tensor[4:7].zero_()
    io.fetch(RemoteBlocks(3, keys, [4, 5, 6]))
    assert _until(io, lambda r: 3 in r.fetched).fetched[3] == [True] * 3
    assert torch.equal(host.tensor[4:7], host.tensor[:3])
    io.close()


def test_a_write_past_its_timeout_keeps_its_memory_until_it_returns(
    mooncake: MooncakeServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A write-through put outlives its timeout: until it returns, its headers are
    # not rewritten (the next write packs its own elsewhere) and its job is not
    # reported, so the scheduler keeps its host blocks pinned; then it is.
    recorder = _recording_client(monkeypatch)
    io = _io(open_store(mooncake.url, role="worker"), _host(3))
    release = recorder.gates["put"] = threading.Event()
    io.write(RemoteBlocks(1, _keys("put", 2), [0, 1]))
    before = _until(io, lambda r: r.stats.get("write_failures", 0) >= 1)
    io.write(RemoteBlocks(2, _keys("put-next", 2), [2, 3]))
    before_release = _until(io, lambda r: 2 in r.written)
    before_release.written.update(before.written)
    release.set()
    assert recorder.late_call_returned.wait(60)
    assert recorder.problems == []
    assert 1 not in before_release.written, "reported while its put still ran"
    assert _until(io, lambda r: 1 in r.written).written[1] == [False, False]
    io.close()


@pytest.mark.usefixtures("small_batches")
def test_registrations_follow_live_buffers_across_a_hung_master_and_a_new_client(
    mooncake_factory: Callable[..., MooncakeServers], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fetch times out on a hung master. Once the master answers, the client has
    # registered the staging buffer later fetches use, and not the one the timed-out
    # fetch held once that call returned; a client built later registers only the
    # live buffers.
    servers = mooncake_factory()
    recorder = _recording_client(monkeypatch)
    host = _host(4)
    store = open_store(servers.url, role="worker")
    io = _io(store, host)
    keys, absent = _keys("hung", 2), _keys("absent", 2)
    _write(io, 1, keys, [0, 1])
    servers.pause_master()
    try:
        # Keys the store lacks: the late answer writes nothing (a late write is the
        # first test's; here, before the fix, it would land in freed memory).
        io.fetch(RemoteBlocks(2, absent, [4, 5]))
        assert _until(io, lambda r: 2 in r.fetched).fetched[2] == [False, False]
        # Fetches go on while the store is down: the next one takes a new buffer.
        io.fetch(RemoteBlocks(3, absent, [4, 5]))
        assert _until(io, lambda r: 3 in r.fetched).fetched[3] == [False, False]
    finally:
        servers.resume_master()
    wait_until_up(store)
    # Made while the store was down, registered once it answers (before any call).
    newest = recorder.allocations.made(_staging_bytes(host))[-1]
    assert newest in _registered_staging(recorder.clients[-1], host)
    io.fetch(RemoteBlocks(4, keys, [4, 5]))
    assert _until(io, lambda r: 4 in r.fetched).fetched[4] == [True, True]
    timed_out, now = recorder.get_addresses[0], recorder.get_addresses[-1]
    assert timed_out != now
    assert _registered_staging(recorder.clients[-1], host) == {now}
    # A master that stays dead while the store reconnects: the store closes its
    # client and builds a new one once a master answers, which registers what lives.
    old = recorder.clients[-1]
    servers._procs.kill("master")  # no public stop: it must stay down a while
    deadline = time.monotonic() + 90
    while not old.closed:
        assert time.monotonic() < deadline, "the store never dropped its client"
        io.fetch(RemoteBlocks(5, keys, [4, 5]))
        _until(io, lambda r: 5 in r.fetched)
        time.sleep(0.2)
    servers.start_master()
    wait_until_up(store)
    assert recorder.clients[-1] is not old
    # The values went with the master: a miss, through the staging buffer in use.
    io.fetch(RemoteBlocks(6, keys, [4, 5]))
    _until(io, lambda r: 6 in r.fetched)
    now = recorder.get_addresses[-1]
    assert _registered_staging(recorder.clients[-1], host) == {now}
    io.close()


class _StuckStore(RemoteStore):
    """A store whose every `get` outlives its timeout until the test ends the calls
    (the built-in stores let one call at most outlive its timeout at a time: this
    one lets them pile up). It records what is registered."""

    def __init__(self) -> None:
        self.calls: list[Future[Any]] = []
        self.registered: set[Span] = set()

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        return [False] * len(keys)

    def put(
        self, keys: Sequence[str], values: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        return [False] * len(keys)

    def get(
        self, keys: Sequence[str], into: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        in_flight: Future[Any] = Future()
        in_flight.set_running_or_notify_cancel()
        self.calls.append(in_flight)
        raise RemoteCallTimeout("get timed out", in_flight)

    def register(self, span: Span) -> None:
        self.registered.add(span)

    def unregister(self, span: Span) -> None:
        self.registered.remove(span)

    @property
    def description(self) -> str:
        return "a store whose calls never end by themselves"


@pytest.mark.usefixtures("small_batches")
def test_stuck_fetches_hold_a_bounded_number_of_buffers() -> None:
    # Fetch after fetch outlives its timeout: each holds its staging buffer, up to
    # MAX_HELD_BUFFERS; past that fetches are misses without a call (no buffer is
    # made). Once the calls end, fetches call again and the extra buffer is
    # unregistered.
    store, host = _StuckStore(), _host(5)
    io = _io(store, host)
    for job_id in range(1, 5):
        io.fetch(RemoteBlocks(job_id, ["k"], [job_id]))
    stuck = _until(io, lambda r: len(r.fetched) == 4)
    assert all(v == [False] for v in stuck.fetched.values())
    assert len(store.calls) == remote_io.MAX_HELD_BUFFERS
    assert stuck.stats["fetch_failures"] == 4
    staging = {s for s in store.registered if s.size == _staging_bytes(host)}
    assert len(staging) == remote_io.MAX_HELD_BUFFERS
    for call in store.calls:
        call.set_result(None)
    io.fetch(RemoteBlocks(5, ["k"], [5]))
    _until(io, lambda r: 5 in r.fetched)
    assert len(store.calls) == remote_io.MAX_HELD_BUFFERS + 1
    live = {s for s in store.registered if s.size == _staging_bytes(host)}
    assert len(live) == 1 and live < staging
    for call in store.calls[remote_io.MAX_HELD_BUFFERS :]:
        call.set_result(None)
    io.close()


def test_a_redis_call_past_its_timeout_leaves_the_spans_alone(
    redis_factory: Callable[..., RedisServer], memory: HostMemory
) -> None:
    # Redis copies bytes on the caller's thread: a get past its timeout on a hung
    # server raises a plain RemoteStoreError (nothing for the caller to hold), and
    # its late reply, once the server answers, writes nothing.
    server = redis_factory()
    store = open_store(server.url, role="worker")
    wait_until_up(store)
    assert store.put(["late"], [[memory.write(0, b"v" * 64)]], 5.0) == [True]
    target = memory.span(1 << 20, 64)
    server.pause()
    try:
        with pytest.raises(RemoteStoreError) as raised:
            store.get(["late"], [[target]], TIMEOUT_S)
        assert not isinstance(raised.value, RemoteCallTimeout)
    finally:
        server.resume()
    wait_until_up(store)
    assert memory.read(target) == bytes(64)
    store.close()


class _GatedPutStore(_StuckStore):
    """Puts wait at a gate until the test opens it; records the keys of each put."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.puts: list[list[str]] = []

    def put(
        self, keys: Sequence[str], values: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        self.puts.append(list(keys))
        return [True] * len(keys)


@requires(value_format.CHECKSUM_MODULE)  # the values written are checked
def test_a_retained_requests_write_goes_before_those_queued_earlier() -> None:
    # While one write is in the store, two wait; a third marked `first` (its request
    # will be read again) is written before them.
    store, host = _GatedPutStore(), _host(6)
    io = _io(store, host)
    io.write(RemoteBlocks(1, ["a"], [0]))
    assert store.entered.wait(60)
    io.write(RemoteBlocks(2, ["b"], [1]))
    io.write(RemoteBlocks(3, ["c"], [2]))
    io.write(RemoteBlocks(4, ["d"], [3], first=True))
    store.gate.set()
    _until(io, lambda r: len(r.written) == 4)
    assert [keys[0].rsplit("/", 1)[0] for keys in store.puts] == ["a", "d", "b", "c"]
    io.close()
