"""The product's Mooncake adapter (`MooncakeRemoteStore`) over a simulated Mooncake
client: the adapter's own code (its call thread, timeouts, recovery, client rebuilds
and registration bookkeeping) runs against the world's `SimBackend`.

`SimMooncakeClient` answers the calls the adapter makes of Mooncake's
`MooncakeDistributedStore`, as Mooncake does: per-key codes (`-900` for every key when
the master does not answer), and a call that outlives the adapter's timeout goes on
and reads or writes the caller's memory when it ends. What it checks, as a transport
over RDMA would: every pointer a call names lies in memory registered with this
client (a new client knows nothing of its predecessor's registrations), no memory is
unregistered while a call uses it, no registration overlaps another (a buffer freed
while registered, its address taken by a new one), and no call reaches a closed
client.

URL: `py://tests.simulation.mooncake_client:SimMooncakeStore?world=W`.
"""

from __future__ import annotations

import random
from typing import Any

from tests.simulation.store import BACKENDS, SimBackend, overlap
from vllm_cpu_offload.remote.mooncake_store import MooncakeRemoteStore
from vllm_cpu_offload.remote.store import RemoteStoreError, Span
from vllm_cpu_offload.remote.url import RemoteUrl

_MASTER_DOWN = -900
_FAILED = -1


class SimMooncakeClient:
    """One `MooncakeDistributedStore` (see the module docstring)."""

    def __init__(self, backend: SimBackend, name: str, rng: random.Random) -> None:
        self.backend = backend
        self.name = name
        self._rng = rng
        self._registered: dict[int, int] = {}  # address -> size
        self.closed = False
        self.blocked = False  # its caller's thread waits in a held call

    # ---- registration ----

    def register_buffer(self, address: int, size: int) -> int:
        self._alive("register_buffer")
        span = Span(address, size)
        for a, n in self._registered.items():
            if overlap(span, Span(a, n)):
                # Memory freed while registered, its address taken by a new buffer.
                self.backend.violation(
                    f"{self.name}: registers {span} over registered {Span(a, n)}"
                )
                return _FAILED
        self._registered[address] = size
        return 0

    def unregister_buffer(self, address: int) -> int:
        self._alive("unregister_buffer")
        size = self._registered.pop(address, None)
        if size is None:
            return _FAILED
        span = Span(address, size)
        for used in self.backend.spans_in_use():
            if overlap(used, span):
                self.backend.violation(
                    f"{self.name} unregistered {span} while a call still uses it"
                )
        return 0

    def close(self) -> None:
        self.closed = True

    # ---- calls ----

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._alive("batch_is_exist")
        if self.backend.down:
            return [_MASTER_DOWN] * len(keys)
        return [1 if k in self.backend.data else 0 for k in keys]

    def batch_put_from_multi_buffers(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        values = _spans(ptrs, sizes)

        def run() -> list[int]:
            if not self._registered_all("put (as it reads)", values):
                return [_FAILED] * len(keys)
            stored = self.backend.put_values(self.name, self._rng, keys, values)
            return [0 if ok else _FAILED for ok in stored]

        return self._call("put", keys, values, run)

    def batch_get_into_multi_buffers(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        into = _spans(ptrs, sizes)

        def run() -> list[int]:
            if not self._registered_all("get (as it writes)", into):
                return [_FAILED] * len(keys)
            found = self.backend.get_values(self.name, self._rng, keys, into)
            return [
                sum(sz) if ok else _FAILED for ok, sz in zip(found, sizes, strict=True)
            ]

        return self._call("get", keys, into, run)

    # ---- faults ----

    def _call(
        self, what: str, keys: list[str], values: list[list[Span]], run: Any
    ) -> list[int]:
        """Draws the call's fate: the master does not answer, the call fails, or it
        is served now or at a later tick (past the adapter's timeout meanwhile)."""
        self._alive(what)
        if not self._registered_all(what, values):
            return [_FAILED] * len(keys)
        if self.backend.down:
            return [_MASTER_DOWN] * len(keys)
        f = self.backend.faults
        roll = self._rng.random()
        if roll < f.fail:
            return [_FAILED] * len(keys)
        if roll >= f.fail + f.timeout + f.hold:
            result: list[int] = run()
            return result
        due = self.backend.tick + self._rng.randint(1, 4)
        spans = [s for v in values for s in v]
        held: list[int] = self.backend.held_call(self, spans, due, run)
        return held

    def _alive(self, what: str) -> None:
        if self.closed:
            self.backend.violation(f"{self.name}: {what} on a closed client")
            raise RuntimeError("closed client")

    def _registered_all(self, what: str, values: list[list[Span]]) -> bool:
        for spans in values:
            for span in spans:
                if not any(
                    a <= span.address and span.address + span.size <= a + size
                    for a, size in self._registered.items()
                ):
                    self.backend.violation(
                        f"{self.name}: {what} names unregistered memory {span}"
                    )
                    return False
        return True


class SimMooncakeStore(MooncakeRemoteStore):
    """The product's adapter, its client built over the world's backend. It asks
    again at once after a failure: a client it builds while the store is down waits
    for the next tick, so it retries once a tick, as the seed decides."""

    min_backoff_s = 0.0

    def __init__(self, url: RemoteUrl, *, role: str = "worker") -> None:
        world = url.option("world")
        assert world is not None, f"{url}: no simulated world named"
        self.backend = BACKENDS[world]
        self.name = self.backend.next_client
        self._rng = random.Random(f"{self.backend.seed}/{self.name}/mooncake")
        self._clients = 0
        self.sim_client: SimMooncakeClient | None = None
        self._waiting_for_tick = False
        super().__init__(url, role=role)

    @property
    def description(self) -> str:
        return f"simulated Mooncake Store ({self.name})"

    def settled(self) -> bool:
        """Whether its thread is idle, or held where only a later tick frees it."""
        client = self.sim_client
        if self._waiting_for_tick or (client is not None and client.blocked):
            return True
        return self._caller.is_idle

    def check_registrations(self, live: list[Span]) -> str | None:
        """With its thread idle and up, the client has registered exactly the memory
        the worker keeps alive for calls: no buffer missing (over RDMA its calls
        would fail), none freed (registered memory nobody owns)."""
        client = self.sim_client
        if client is None or not self._caller.is_idle:
            return None
        registered = {Span(a, n) for a, n in client._registered.items()}
        missing, freed = set(live) - registered, registered - set(live)
        if missing or freed:
            return (
                f"{client.name}: live buffers not registered {_listed(missing)}, "
                f"registered buffers not alive {_listed(freed)}"
            )
        return None

    def _new_client(self) -> Any:
        if self.backend.down:
            self.sim_client = None
            self._waiting_for_tick = True
            try:
                self.backend.wait_for_tick(self.backend.tick)
            finally:
                self._waiting_for_tick = False
            raise RemoteStoreError("setup failed: the master is down")
        self._clients += 1
        self.sim_client = SimMooncakeClient(
            self.backend, f"{self.name}#{self._clients}", self._rng
        )
        return self.sim_client


def _spans(ptrs: list[list[int]], sizes: list[list[int]]) -> list[list[Span]]:
    return [
        [Span(p, n) for p, n in zip(ps, ns, strict=True)]
        for ps, ns in zip(ptrs, sizes, strict=True)
    ]


def _listed(spans: set[Span]) -> list[Span]:
    return sorted(spans, key=lambda s: s.address)
