"""A worker's traffic with the shared store: write-through of stored host blocks, and
fetches of blocks into host blocks, on a thread of its own.

The engine step never waits for the store. The worker hands over jobs (`write`,
`fetch`) and collects what finished (`poll`); the thread serves fetches first (a request
waits on them) and writes in small batches between them. Writes are bounded: when
`max_queued_writes` blocks already wait, a write is dropped and counted (the store is a
cache). The scheduler keeps the host blocks of a job pinned until the job is reported,
so the thread reads and writes them while no copy of the step touches them.

A fetch lands in a staging buffer of the worker's own, is checked there
(`value_format`: a value of another namespace, key or length, or with a bad checksum, is
a miss, counted), and only then copied into its host block. A fetch that runs past its
timeout may still write its buffers later: that staging buffer is abandoned for a new
one, so a late write never reaches a host block that the tier has handed to another
block since.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from vllm_cpu_offload.block_transfer import RemoteBlocks
from vllm_cpu_offload.remote import value_format
from vllm_cpu_offload.remote.namespace import shard_key
from vllm_cpu_offload.remote.store import (
    RemoteStore,
    RemoteStoreError,
    Span,
    wait_until_answering,
)
from vllm_cpu_offload.worker.host_buffer import HostBuffer

logger = logging.getLogger(__name__)

# Blocks per write call: small, so that a fetch waits behind at most one short batch.
WRITE_BATCH = 16
# Bytes per fetch call, the size of the staging buffer: a request waits on the whole
# fetch, and few large calls move it faster than many small ones (on loopback TCP, 124
# blocks of 256 KiB took 26 ms in calls of 16 blocks and 15 ms in calls of 64 or more).
# 16 blocks of a Llama-3-8B shard with 16-token blocks.
FETCH_BATCH_BYTES = 32 << 20


@dataclass
class RemoteResults:
    """What finished since the last poll."""

    # job id -> for each of its blocks, whether it is in host memory now
    fetched: dict[int, list[bool]] = field(default_factory=dict)
    # write job id -> for each of its blocks, whether the store holds it now (a
    # failed or dropped write: all False)
    written: dict[int, list[bool]] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)


class RemoteIO:
    """The store traffic of one worker; see the module docstring.

    Args:
        store: this worker's client of the shared store.
        host: the host buffer; a store block is `blocks_per_host_block` slots of it.
        rank: this worker's name, the last part of its shards' keys.
        namespace: what the values' headers must name.
        timeout_s: the bound of every store call.

    """

    def __init__(
        self,
        store: RemoteStore,
        host: HostBuffer,
        *,
        blocks_per_host_block: int,
        rank: str,
        namespace: str,
        timeout_s: float,
        max_queued_writes: int,
    ) -> None:
        self.store = store
        self.rank = rank
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.max_queued_writes = max_queued_writes
        # Held: the thread writes into its memory through raw addresses.
        self._host = host
        self._base = host.tensor.data_ptr()
        self._block_bytes = host.block_bytes * blocks_per_host_block
        self._fetch_batch = max(1, FETCH_BATCH_BYTES // self._block_bytes)
        self._num_blocks = host.num_host_blocks // blocks_per_host_block
        # Headers of one write batch (fetches land in their staging buffer).
        self._headers = ctypes.create_string_buffer(
            WRITE_BATCH * value_format.HEADER_BYTES
        )
        self._headers_at = ctypes.addressof(self._headers)
        store.register(Span(self._base, host.tensor.numel()))
        store.register(Span(self._headers_at, len(self._headers)))
        self._staging = self._new_staging()
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
            self._writes.append(job)
            self._lock.notify()
        return True

    def fetch(self, job: RemoteBlocks) -> None:
        """Queues the fetch of `job` into its host blocks."""
        with self._lock:
            self._fetches.append(job)
            self._lock.notify()

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
            try:
                done = self._fetch(job) if is_fetch else self._write(job)
            except Exception:  # the thread must outlive any one job
                logger.exception("remote KV job %d failed", job.job_id)
                done = [False] * len(job.keys)
            with self._lock:
                if is_fetch:
                    self._results.fetched[job.job_id] = done
                else:
                    self._results.written[job.job_id] = done
                self._busy = False
                self._lock.notify_all()

    def _span(self, host_block: int) -> Span:
        if not 0 <= host_block < self._num_blocks:
            raise ValueError(f"host block {host_block} out of range")
        return Span(self._base + host_block * self._block_bytes, self._block_bytes)

    def _new_staging(self) -> ctypes.Array[ctypes.c_char]:
        """A fetch batch's landing place: headers and blocks, registered."""
        size = self._fetch_batch * (value_format.HEADER_BYTES + self._block_bytes)
        staging = ctypes.create_string_buffer(size)
        self.store.register(Span(ctypes.addressof(staging), size))
        return staging

    def _header(self, i: int) -> Span:
        at = self._headers_at + i * value_format.HEADER_BYTES
        return Span(at, value_format.HEADER_BYTES)

    def _write(self, job: RemoteBlocks) -> list[bool]:
        """Writes the job's blocks; for each, whether the store holds it now."""
        written: list[bool] = []
        for start in range(0, len(job.keys), WRITE_BATCH):
            keys = [
                shard_key(k, self.rank) for k in job.keys[start : start + WRITE_BATCH]
            ]
            values: list[list[Span]] = []
            for i, host_block in enumerate(
                job.host_blocks[start : start + WRITE_BATCH]
            ):
                block, header = self._span(host_block), self._header(i)
                packed = value_format.pack_header(
                    keys[i], self.namespace, block.address, block.size
                )
                ctypes.memmove(header.address, packed, len(packed))
                values.append([header, block])
            begin = time.perf_counter()
            try:
                stored = self.store.put(keys, values, self.timeout_s)
            except RemoteStoreError as e:
                self._failed("write", len(keys), e)
                written += [False] * len(keys)
                continue
            self._count("write_seconds", time.perf_counter() - begin)
            written += stored
            done = sum(stored)
            self._count("written_blocks", done)
            self._count("bytes_out", done * self._block_bytes)
            self._count("write_refused_blocks", len(keys) - done)
        return written

    def _fetch(self, job: RemoteBlocks) -> list[bool]:
        arrived: list[bool] = []
        header_bytes, size, batch = (
            value_format.HEADER_BYTES,
            self._block_bytes,
            self._fetch_batch,
        )
        for start in range(0, len(job.keys), batch):
            keys = [shard_key(k, self.rank) for k in job.keys[start : start + batch]]
            targets = [self._span(h) for h in job.host_blocks[start : start + batch]]
            at = ctypes.addressof(self._staging)
            into = [
                [
                    Span(at + i * header_bytes, header_bytes),
                    Span(at + batch * header_bytes + i * size, size),
                ]
                for i in range(len(keys))
            ]
            begin = time.perf_counter()
            try:
                found = self.store.get(keys, into, self.timeout_s)
            except RemoteStoreError as e:
                # The call may still write the staging buffer later: never use it
                # again.
                self._staging = self._new_staging()
                self._failed("fetch", len(keys), e)
                found = [False] * len(keys)
            self._count("fetch_seconds", time.perf_counter() - begin)
            self._count("fetch_calls", 1)
            for key, (header, payload), target, ok in zip(
                keys, into, targets, found, strict=True
            ):
                if ok:
                    problem = value_format.header_problem(
                        ctypes.string_at(header.address, header_bytes),
                        key,
                        self.namespace,
                        payload.address,
                        size,
                    )
                    if problem is not None:
                        logger.warning("remote KV block %s refused: %s", key, problem)
                        self._count("rejected_blocks", 1)
                        ok = False
                if ok:
                    ctypes.memmove(target.address, payload.address, size)
                    self._count("bytes_in", size)
                arrived.append(ok)
        self._count("fetched_blocks", sum(arrived))
        self._count("fetch_missed_blocks", len(arrived) - sum(arrived))
        return arrived

    def _failed(self, what: str, blocks: int, error: Exception) -> None:
        self._count(f"{what}_failures", 1)
        self._count(f"{what}_failed_blocks", blocks)
        logger.debug("remote KV %s of %d blocks failed: %s", what, blocks, error)

    def _count(self, name: str, value: float) -> None:
        # The condition's lock is reentrant: `write` counts while holding it.
        with self._lock:
            stats = self._results.stats
            stats[name] = stats.get(name, 0) + value
