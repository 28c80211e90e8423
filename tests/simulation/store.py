"""The simulation's shared store: an in-process backend behind the `RemoteStore`
interface, each client deciding its faults from a seeded generator of its own.

A call ends one of four ways: served now; failed now (`RemoteStoreError`); past its
timeout (`RemoteCallTimeout`: the call goes on and is served at a later tick, reading
or writing the caller's spans then, as Mooncake's client does); or held (the caller's
thread blocks in the call until a later tick). The store also goes down and comes back
(every call fails at once meanwhile).

What it checks, as a transport over registered memory would and as the oracle needs:
every span a call names is registered with that client, also when a late call touches
it; memory is not unregistered while a call still uses it; and every value put holds
the bytes its key stands for (`Oracle.check_value`), at the moment the store reads it.
"""

from __future__ import annotations

import ctypes
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vllm_cpu_offload.remote.store import (
    RemoteCallTimeout,
    RemoteStore,
    RemoteStoreError,
    Span,
)

# The store's worlds by name, so that a `py://` URL reaches its backend.
BACKENDS: dict[str, SimBackend] = {}


@dataclass(frozen=True)
class StoreFaults:
    """Per-call chances of each fault."""

    fail: float = 0.05
    timeout: float = 0.05
    hold: float = 0.05
    miss: float = 0.03  # per key of a get that is served
    refuse: float = 0.03  # per key of a put that is served


@dataclass
class PendingCall:
    """A call the store has not finished: timed out (finished by `advance`) or held
    (its own thread finishes it once released)."""

    client: object
    spans: list[Span]
    due: int
    run: Callable[[], Any] | None = None  # timed out: what finishes it
    future: Future[Any] | None = None
    release: threading.Event | None = None  # held


@dataclass
class SimBackend:
    """The shared key-value data and the world's view of every client."""

    seed: int
    faults: StoreFaults
    check_value: Callable[[str, bytes], str | None]
    data: dict[str, bytes] = field(default_factory=dict)
    # Who put each value (its client's name), and how many values each engine got
    # from another's puts: (writer engine, reader engine) -> values.
    writers: dict[str, str] = field(default_factory=dict)
    cross_reads: dict[tuple[str, str], int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    down: bool = False
    tick: int = 0
    clients: list[SimStore] = field(default_factory=list)
    # The name the next client gets (set by the world while it builds a worker).
    next_client: str = "scheduler"
    closed: bool = False
    _pending: list[PendingCall] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ticked: threading.Condition = field(default_factory=threading.Condition)

    def violation(self, what: str) -> None:
        self.violations.append(f"tick {self.tick}: {what}")

    def spans_in_use(self) -> list[Span]:
        with self._lock:
            return [s for p in self._pending for s in p.spans]

    def advance(self, tick: int, *, everything: bool = False) -> None:
        """Finishes the timed-out calls due by `tick` and releases the held ones."""
        with self._ticked:
            self.tick = tick
            self._ticked.notify_all()
        with self._lock:
            due = [p for p in self._pending if everything or p.due <= tick]
        for p in due:
            if p.run is not None:
                assert p.future is not None
                try:
                    p.future.set_result(p.run())
                except RemoteStoreError as e:
                    p.future.set_exception(e)
                finally:
                    self._forget(p)
            elif p.release is not None:
                p.release.set()  # its thread forgets it once it has run

    def put_values(
        self,
        client: str,
        rng: random.Random,
        keys: list[str],
        values: list[list[Span]],
    ) -> list[bool]:
        """Stores each value (read from its spans now) unless its key is held; checks
        that it holds what its key stands for."""
        stored = []
        for key, spans in zip(keys, values, strict=True):
            value = b"".join(ctypes.string_at(s.address, s.size) for s in spans)
            problem = self.check_value(key, value)
            if problem is not None:
                self.violation(f"{client} put {key}: {problem}")
            if rng.random() < self.faults.refuse:
                stored.append(False)
                continue
            if key not in self.data:
                self.data[key] = value
                self.writers[key] = client
            stored.append(True)
        return stored

    def get_values(
        self, client: str, rng: random.Random, keys: list[str], into: list[list[Span]]
    ) -> list[bool]:
        """Writes each value held into its spans now; False where none is (or one of
        another length)."""
        found = []
        for key, spans in zip(keys, into, strict=True):
            value = self.data.get(key)
            if (
                value is None
                or len(value) != sum(s.size for s in spans)
                or rng.random() < self.faults.miss
            ):
                found.append(False)
                continue
            at = 0
            for s in spans:
                ctypes.memmove(s.address, value[at : at + s.size], s.size)
                at += s.size
            found.append(True)
            writer, reader = _engine_of(self.writers[key]), _engine_of(client)
            if writer != reader:
                pair = (writer, reader)
                self.cross_reads[pair] = self.cross_reads.get(pair, 0) + 1
        return found

    def wait_for_tick(self, tick: int) -> None:
        """Blocks until the world's tick passes `tick` or the world closes."""
        with self._ticked:
            self._ticked.wait_for(lambda: self.tick > tick or self.closed)

    def close(self) -> None:
        """Releases every call still held: the world is done."""
        with self._ticked:
            self.closed = True
            self._ticked.notify_all()
        self.advance(self.tick + 1, everything=True)

    def held_call(
        self, client: Any, spans: list[Span], due: int, run: Callable[[], Any]
    ) -> Any:
        """Holds the caller's thread (`client.blocked` meanwhile) until `advance`
        releases it at tick `due` or later, then runs the call."""
        release = threading.Event()
        pending = PendingCall(client, spans, due, release=release)
        self._add(pending)
        client.blocked = True
        try:
            release.wait()
        finally:
            client.blocked = False
        try:
            return run()
        finally:
            self._forget(pending)

    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _add(self, pending: PendingCall) -> None:
        with self._lock:
            self._pending.append(pending)

    def _forget(self, pending: PendingCall) -> None:
        with self._lock:
            self._pending.remove(pending)


class SimStore(RemoteStore):
    """One client of a `SimBackend` (`py://tests.simulation.store:SimStore?world=W`)."""

    def __init__(self, url: Any, *, role: str) -> None:
        self.backend = BACKENDS[url.option("world")]
        self.name = self.backend.next_client
        self.role = role
        self._rng = random.Random(f"{self.backend.seed}/{self.name}")
        self._registered: list[Span] = []
        self.blocked = False  # its thread waits in a held call
        self.backend.clients.append(self)

    @property
    def description(self) -> str:
        return f"simulated store ({self.name})"

    def register(self, span: Span) -> None:
        self._registered.append(span)

    def unregister(self, span: Span) -> None:
        for used in self.backend.spans_in_use():
            if overlap(used, span):
                self.backend.violation(
                    f"{self.name} unregistered {span} while a call still uses it"
                )
        self._registered.remove(span)

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        self._enter("exists", [], count_hold=False)
        return [k in self.backend.data for k in keys]

    def put(
        self, keys: Sequence[str], values: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        spans = [s for v in values for s in v]
        return self._call(
            "put", spans, lambda: self._put_now(list(keys), [list(v) for v in values])
        )

    def get(
        self, keys: Sequence[str], into: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        spans = [s for v in into for s in v]
        return self._call(
            "get", spans, lambda: self._get_now(list(keys), [list(v) for v in into])
        )

    # ---- faults ----

    def _enter(self, what: str, spans: list[Span], *, count_hold: bool) -> str:
        """Checks the spans and draws this call's fate: "now", "timeout" or "hold"
        (a failure raises)."""
        self._check_registered(what, spans)
        if self.backend.down:
            raise RemoteStoreError(f"{self.name}: the store is down")
        f = self.backend.faults
        roll = self._rng.random()
        if roll < f.fail:
            raise RemoteStoreError(f"{self.name}: {what} failed (injected)")
        if not count_hold:
            return "now"
        if roll < f.fail + f.timeout:
            return "timeout"
        if roll < f.fail + f.timeout + f.hold:
            return "hold"
        return "now"

    def _call(self, what: str, spans: list[Span], run: Callable[[], Any]) -> Any:
        fate = self._enter(what, spans, count_hold=True)
        if fate == "now":
            return run()
        due = self.backend.tick + self._rng.randint(1, 4)
        if fate == "timeout":
            future: Future[Any] = Future()
            self.backend._add(PendingCall(self, spans, due, run=run, future=future))
            raise RemoteCallTimeout(f"{self.name}: {what} timed out (injected)", future)
        return self.backend.held_call(self, spans, due, run)

    # ---- the data ----

    def _check_registered(self, what: str, spans: list[Span]) -> None:
        for span in spans:
            if not any(_inside(span, r) for r in self._registered):
                self.backend.violation(
                    f"{self.name}: {what} names unregistered memory {span}"
                )
                raise RemoteStoreError(f"{self.name}: unregistered memory")

    def _put_now(self, keys: list[str], values: list[list[Span]]) -> list[bool]:
        self._check_registered("put (as it reads)", [s for v in values for s in v])
        return self.backend.put_values(self.name, self._rng, keys, values)

    def _get_now(self, keys: list[str], into: list[list[Span]]) -> list[bool]:
        self._check_registered("get (as it writes)", [s for v in into for s in v])
        return self.backend.get_values(self.name, self._rng, keys, into)


def _engine_of(client: str) -> str:
    """The engine of a client's name (`A2/tp1`, `A2/tp1#2`)."""
    return client.partition("/")[0]


def _inside(span: Span, region: Span) -> bool:
    return (
        region.address <= span.address
        and span.address + span.size <= region.address + region.size
    )


def overlap(a: Span, b: Span) -> bool:
    return a.address < b.address + b.size and b.address < a.address + a.size
