"""A worker's traffic with the shared store: write-through of stored host blocks, and
fetches of blocks into host blocks, on a thread of its own.

The engine step never waits for the store. The worker hands over jobs (`write`,
`fetch`) and collects what finished (`poll`); the thread serves fetches first (a request
waits on them) and writes in small batches between them. Writes are bounded: when
`max_queued_writes` blocks already wait, a write is dropped and counted (the store is a
cache). The scheduler keeps the host blocks of a job pinned until the job is reported,
so the thread reads and writes them while no copy of the step touches them.

A block is one value or several (one per KV head: `block_values.py`); it is written,
or arrived, only when all of them are. A fetch lands in a staging buffer of the worker's
own, is checked there (`value_format`: a value of another namespace, key or length, or
with a bad checksum, is a miss, counted), and only then copied into its host block.

Memory named in a store call lives, registered, until that call has returned. A call
past its timeout may go on (`RemoteCallTimeout`): a fetch's staging buffer, or a
write's headers buffer, is then held, untouched, until the call returns, while later
calls use another (so does a write's values buffer, where values are cut from host
blocks); then it is unregistered before it is freed (or used again). So a
late write reaches no host block and no buffer in use, and no client names freed
memory. At most `MAX_HELD_BUFFERS` of each are held: past that, fetches are misses and
writes fail, without a call. A write whose put timed out is reported only once that
put has returned, so its host blocks stay pinned while it may still read them; the
engine never waits for it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vllm_cpu_offload.block_transfer import RemoteBlocks
from vllm_cpu_offload.remote import value_format
from vllm_cpu_offload.remote.namespace import shard_key
from vllm_cpu_offload.remote.store import (
    RemoteCallTimeout,
    RemoteStore,
    RemoteStoreError,
    Span,
    wait_until_answering,
)
from vllm_cpu_offload.worker.block_values import BlockValues
from vllm_cpu_offload.worker.host_buffer import HostBuffer

logger = logging.getLogger(__name__)

# Blocks per write call: small, so that a fetch waits behind at most one short batch.
WRITE_BATCH = 16
# Bytes per fetch call, the size of the staging buffer: a request waits on the whole
# fetch, and few large calls move it faster than many small ones (on loopback TCP, 124
# blocks of 256 KiB took 26 ms in calls of 16 blocks and 15 ms in calls of 64 or more).
# 16 blocks of a Llama-3-8B shard with 16-token blocks.
FETCH_BATCH_BYTES = 32 << 20
# Buffers of each kind (staging, headers) that calls past their timeout may hold. With
# the built-in stores one at most (a timeout marks the store down until its thread,
# free again, reconnects); the bound is for a store that lets timed-out calls pile up.
MAX_HELD_BUFFERS = 2
_ALL_HELD = RemoteStoreError("every buffer is held by a call that timed out")
_SEALED = RemoteStoreError("the weights changed at run time: the store is sealed")


@dataclass
class RemoteResults:
    """What finished since the last poll."""

    # job id -> for each of its blocks, whether it is in host memory now
    fetched: dict[int, list[bool]] = field(default_factory=dict)
    # write job id -> for each of its blocks, whether the store holds it now (a
    # failed or dropped write: all False; one whose put timed out is reported once
    # that put has returned)
    written: dict[int, list[bool]] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)


class _Buffers:
    """Registered host buffers of one size for the spans of store calls.

    One is in use; `hold` sets it aside, alive and registered, while a call that timed
    out may still use it, and `ready` then gives another: one whose call has returned,
    a new one, or none while `MAX_HELD_BUFFERS` are held. A held buffer no longer
    needed is unregistered, then freed. O(MAX_HELD_BUFFERS) per call; RemoteIO's
    thread only.
    """

    def __init__(self, store: RemoteStore, size: int) -> None:
        self._store = store
        self._size = size
        self._held: list[tuple[ctypes.Array[ctypes.c_char], Future[Any]]] = []
        self._current: ctypes.Array[ctypes.c_char] | None = self._new()

    def ready(self) -> int | None:
        """The address of the buffer for the next call; None while all are held."""
        held = []
        for buffer, in_flight in self._held:
            if not in_flight.done():
                held.append((buffer, in_flight))
            elif self._current is None:
                self._current = buffer  # still registered
            else:
                self._store.unregister(self._span(buffer))  # then freed
        self._held = held
        if self._current is None and len(self._held) < MAX_HELD_BUFFERS:
            self._current = self._new()
        return None if self._current is None else ctypes.addressof(self._current)

    def hold(self, in_flight: Future[Any], *also: object) -> None:
        """Sets the buffer in use aside until `in_flight` is done; `also`: other
        memory that call uses."""
        assert self._current is not None, "hold without a buffer in use"
        buffer, self._current = self._current, None
        self._held.append((buffer, in_flight))
        # The store holds the future until the call returns: tied to it, the memory
        # outlives the call even if this RemoteIO goes first (closed, call stuck).
        kept = (buffer, *also)
        in_flight.add_done_callback(lambda _: kept)

    def spans(self) -> list[Span]:
        """The buffers alive now: the one in use and the held ones."""
        buffers = [buffer for buffer, _ in self._held]
        if self._current is not None:
            buffers.append(self._current)
        return [self._span(buffer) for buffer in buffers]

    def _new(self) -> ctypes.Array[ctypes.c_char]:
        buffer = ctypes.create_string_buffer(self._size)
        self._store.register(self._span(buffer))
        return buffer

    def _span(self, buffer: ctypes.Array[ctypes.c_char]) -> Span:
        return Span(ctypes.addressof(buffer), self._size)


class RemoteIO:
    """The store traffic of one worker; see the module docstring.

    Args:
        store: this worker's client of the shared store.
        host: the host buffer; a store block is `blocks_per_host_block` slots of it.
        values: a block's values (their names end their keys) and where they lie.
        namespace: what the values' headers must name.
        timeout_s: the bound of every store call.

    """

    def __init__(
        self,
        store: RemoteStore,
        host: HostBuffer,
        values: BlockValues,
        *,
        namespace: str,
        timeout_s: float,
        max_queued_writes: int,
    ) -> None:
        self.store = store
        self.values = values
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.max_queued_writes = max_queued_writes
        # Held: the thread writes into its memory through raw addresses.
        self._host = host
        self._block_bytes = values.block_bytes
        self._fetch_batch = max(1, FETCH_BATCH_BYTES // self._block_bytes)
        self._host_span = Span(host.tensor.data_ptr(), host.tensor.numel())
        store.register(self._host_span)
        # Headers of one write batch, its values where they are cut from host blocks,
        # and a fetch batch's landing place (its headers, then its values).
        per_block = len(values.names)
        self._headers = _Buffers(
            store, WRITE_BATCH * per_block * value_format.HEADER_BYTES
        )
        self._cut = (
            _Buffers(store, WRITE_BATCH * self._block_bytes) if values.staged else None
        )
        self._staging = _Buffers(
            store,
            self._fetch_batch
            * (per_block * value_format.HEADER_BYTES + self._block_bytes),
        )
        # The worker's first stores come right after start: give the store its
        # timeout to connect (then the tier goes on, and connects when it answers).
        wait_until_answering(store, timeout_s)
        self._lock = threading.Condition()
        self._fetches: deque[RemoteBlocks] = deque()
        self._writes: deque[RemoteBlocks] = deque()
        self._queued_write_blocks = 0
        self._results = RemoteResults()
        self._closed = False
        self._busy = False
        # Set once this worker's weights may differ from those the namespace names
        # (`seal`): from then on no value is written or fetched.
        self._sealed = False
        self._thread = threading.Thread(
            target=self._serve, name="vllm-cpu-offload-remote", daemon=True
        )
        self._thread.start()

    # ---- the worker's side ----

    def write(self, job: RemoteBlocks) -> bool:
        """Queues the write-through of `job`; False (and reported as done) when the
        queue is full."""
        with self._lock:
            if self._queued_write_blocks + len(job.keys) > self.max_queued_writes:
                self._count("write_dropped_blocks", len(job.keys))
                self._results.written[job.job_id] = [False] * len(job.keys)
                return False
            self._queued_write_blocks += len(job.keys)
            if job.first:
                self._writes.appendleft(job)
            else:
                self._writes.append(job)
            self._lock.notify()
        return True

    def fetch(self, job: RemoteBlocks) -> None:
        """Queues the fetch of `job` into its host blocks."""
        with self._lock:
            self._fetches.append(job)
            self._lock.notify()

    def seal(self) -> None:
        """From now on writes and fetches fail without a call: the KV this worker
        computes may come from other weights than those the namespace names. A batch
        already in a call ends as it would have (its values came from before)."""
        self._sealed = True

    def poll(self) -> RemoteResults:
        with self._lock:
            results, self._results = self._results, RemoteResults()
        return results

    def wait_for_fetch(self, timeout_s: float) -> bool:
        """Waits until a fetch has ended since the last poll, at most `timeout_s`;
        whether one has."""
        with self._lock:
            return self._lock.wait_for(lambda: bool(self._results.fetched), timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no job is queued or running (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._fetches or self._writes or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def registered_spans(self) -> list[Span]:
        """The memory this worker keeps registered with its store: the host buffer
        and every header and staging buffer alive (read while the worker is idle)."""
        cut = self._cut.spans() if self._cut is not None else []
        return [
            self._host_span,
            *self._headers.spans(),
            *cut,
            *self._staging.spans(),
        ]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=2 * self.timeout_s + 1)
        self.store.close()

    # ---- the thread ----

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not (self._fetches or self._writes or self._closed):
                    self._lock.wait()
                if self._closed:
                    return
                if self._fetches:
                    job, is_fetch = self._fetches.popleft(), True
                else:
                    job, is_fetch = self._writes.popleft(), False
                    self._queued_write_blocks -= len(job.keys)
                self._busy = True
            running: list[Future[Any]] = []  # puts past their timeout
            try:
                done = self._fetch(job) if is_fetch else self._write(job, running)
            except Exception:  # the thread must outlive any one job
                logger.exception("remote KV job %d failed", job.job_id)
                done = [False] * len(job.keys)
            with self._lock:
                if is_fetch:
                    self._results.fetched[job.job_id] = done
                elif not running:
                    self._results.written[job.job_id] = done
                self._busy = False
                self._lock.notify_all()
            if running:
                self._report_when_returned(job.job_id, done, running)

    def _report_when_returned(
        self, job_id: int, done: list[bool], running: list[Future[Any]]
    ) -> None:
        """Reports write `job_id` once every put of it in `running` has returned:
        until then they may read its host blocks, which the scheduler keeps pinned
        until the report. The last put's return makes the report (on the store's
        thread): nothing waits for it."""
        left = [len(running)]

        def returned(_: Future[Any]) -> None:
            with self._lock:
                left[0] -= 1
                if not left[0]:
                    self._results.written[job_id] = done
                    self._lock.notify_all()

        for in_flight in running:
            in_flight.add_done_callback(returned)

    def _keys(self, block_keys: Sequence[str]) -> list[str]:
        """The keys of the values of `block_keys`, block by block."""
        return [shard_key(k, name) for k in block_keys for name in self.values.names]

    def _by_block(self, per_value: Sequence[bool]) -> list[bool]:
        """Per block: whether every one of its values did."""
        n = len(self.values.names)
        return [all(per_value[i : i + n]) for i in range(0, len(per_value), n)]

    def _write(self, job: RemoteBlocks, running: list[Future[Any]]) -> list[bool]:
        """Writes the job's blocks; for each, whether the store holds it now. A put
        past its timeout joins `running`."""
        written: list[bool] = []
        for start in range(0, len(job.keys), WRITE_BATCH):
            end = start + WRITE_BATCH
            written += self._write_batch(
                job.keys[start:end], job.host_blocks[start:end], running
            )
        return written

    def _write_batch(
        self,
        block_keys: Sequence[str],
        host_blocks: Sequence[int],
        running: list[Future[Any]],
    ) -> list[bool]:
        if self._sealed:
            self._failed("write", len(block_keys), _SEALED)
            return [False] * len(block_keys)
        headers_at = self._headers.ready()
        cut_at = self._cut.ready() if self._cut is not None else 0
        if headers_at is None or cut_at is None:
            self._failed("write", len(block_keys), _ALL_HELD)
            return [False] * len(block_keys)
        keys = self._keys(block_keys)
        spans = self.values.write_spans(host_blocks, cut_at)
        header_bytes = value_format.HEADER_BYTES
        values: list[list[Span]] = []
        for i, (key, payload) in enumerate(zip(keys, spans, strict=True)):
            header = Span(headers_at + i * header_bytes, header_bytes)
            packed = value_format.pack_header(
                key, self.namespace, payload.address, payload.size
            )
            ctypes.memmove(header.address, packed, len(packed))
            values.append([header, payload])
        begin = time.perf_counter()
        try:
            stored = self.store.put(keys, values, self.timeout_s)
        except RemoteCallTimeout as e:
            # It may still read the headers, the cut values and the host blocks.
            self._headers.hold(e.in_flight, self._host)
            if self._cut is not None:
                self._cut.hold(e.in_flight)
            running.append(e.in_flight)
            self._failed("write", len(block_keys), e)
            return [False] * len(block_keys)
        except RemoteStoreError as e:
            self._failed("write", len(block_keys), e)
            return [False] * len(block_keys)
        self._count("write_seconds", time.perf_counter() - begin)
        by_block = self._by_block(stored)
        done = sum(by_block)
        self._count("written_blocks", done)
        self._count("bytes_out", done * self._block_bytes)
        self._count("write_refused_blocks", len(block_keys) - done)
        return by_block

    def _fetch(self, job: RemoteBlocks) -> list[bool]:
        arrived: list[bool] = []
        for start in range(0, len(job.keys), self._fetch_batch):
            end = start + self._fetch_batch
            arrived += self._fetch_batch_into(
                job.keys[start:end], job.host_blocks[start:end]
            )
        # Fetched blocks are counted once by the scheduler half, not by every rank.
        self._count("fetch_missed_blocks", len(arrived) - sum(arrived))
        return arrived

    def _fetch_batch_into(
        self, block_keys: Sequence[str], host_blocks: Sequence[int]
    ) -> list[bool]:
        """Fetches the values of `block_keys` through the staging buffer into
        `host_blocks`; for each block, whether all its values arrived and passed
        their checks."""
        for host_block in host_blocks:
            self.values.host_span(host_block)  # refuses an id out of range
        at = None if self._sealed else self._staging.ready()
        if at is None:
            why = _SEALED if self._sealed else _ALL_HELD
            self._failed("fetch", len(block_keys), why)
            return [False] * len(block_keys)
        keys = self._keys(block_keys)
        header_bytes, size = value_format.HEADER_BYTES, self.values.value_bytes
        payloads_at = at + self._fetch_batch * len(self.values.names) * header_bytes
        into = [
            [
                Span(at + i * header_bytes, header_bytes),
                Span(payloads_at + i * size, size),
            ]
            for i in range(len(keys))
        ]
        begin = time.perf_counter()
        try:
            found = self.store.get(keys, into, self.timeout_s)
        except RemoteCallTimeout as e:
            # It may still write the staging buffer.
            self._staging.hold(e.in_flight)
            self._failed("fetch", len(block_keys), e)
            found = [False] * len(keys)
        except RemoteStoreError as e:
            self._failed("fetch", len(block_keys), e)
            found = [False] * len(keys)
        self._count("fetch_seconds", time.perf_counter() - begin)
        self._count("fetch_calls", 1)
        checked = [
            ok and self._passes(key, header, payload)
            for key, (header, payload), ok in zip(keys, into, found, strict=True)
        ]
        arrived = self._by_block(checked)
        rows = [i for i, ok in enumerate(arrived) if ok]
        if rows:
            self.values.land(payloads_at, rows, [host_blocks[i] for i in rows])
            self._count("bytes_in", len(rows) * self._block_bytes)
        return arrived

    def _passes(self, key: str, header: Span, payload: Span) -> bool:
        """Whether the value just fetched under `key` may be loaded (counted and
        logged where not)."""
        problem = value_format.header_problem(
            ctypes.string_at(header.address, header.size),
            key,
            self.namespace,
            payload.address,
            payload.size,
        )
        if problem is None:
            return True
        logger.warning("remote KV block %s refused: %s", key, problem)
        self._count("rejected_blocks", 1)
        return False

    def _failed(self, what: str, blocks: int, error: Exception) -> None:
        self._count(f"{what}_failures", 1)
        self._count(f"{what}_failed_blocks", blocks)
        logger.debug("remote KV %s of %d blocks failed: %s", what, blocks, error)

    def _count(self, name: str, value: float) -> None:
        # The condition's lock is reentrant: `write` counts while holding it.
        with self._lock:
            stats = self._results.stats
            stats[name] = stats.get(name, 0) + value
