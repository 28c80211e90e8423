"""What the host tier asks of a store shared by every engine of a fleet.

A store holds values by string key. The host tier writes each block it stores to the
store too (write-through) and, on a lookup past the device and host hits, asks which of
the following blocks the store holds and fetches them into host memory. Every call is
batched and bounded by a timeout: a store that is slow, full or gone costs a miss, never
a hang.

A call past its timeout may go on in the background. Where it still uses the caller's
spans, the backend raises `RemoteCallTimeout`, whose `in_flight` says when the call has
really returned: until then the caller keeps that memory alive, registered and unused.

A value is given and received as spans of host memory (`Span`: an address and a size),
so that a backend may move bytes without a copy (Mooncake Store reads and writes
registered host memory directly); a backend that needs bytes copies them.

Imports the standard library only.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

_PROBE_KEY = "vllm-cpu-offload/probe"


class RemoteStoreError(RuntimeError):
    """A call to the store failed as a whole (unreachable, timed out, refused)."""


class RemoteCallTimeout(RemoteStoreError):
    """A call ran past its timeout and still runs until `in_flight` is done: until
    then a `get` may still write its spans and a `put` read them. A backend whose calls
    touch no span once the caller has them back raises a plain `RemoteStoreError`."""

    def __init__(self, message: str, in_flight: Future[Any]) -> None:
        super().__init__(message)
        self.in_flight = in_flight


@dataclass(frozen=True)
class Span:
    """`size` bytes of host memory at `address`."""

    address: int
    size: int


class RemoteStore(ABC):
    """A shared key-value store of KV blocks, as the host tier uses it.

    Implementations are used from one thread at a time per instance, and must bound
    every call by `timeout_s` (raise `RemoteStoreError` past it).
    """

    # The client library a built-in backend imports when it connects, and the extra
    # of this package that installs it; checked before the engine starts.
    client_library: ClassVar[str | None] = None
    install_extra: ClassVar[str | None] = None

    @abstractmethod
    def exists(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        """Whether the store holds each key now."""

    @abstractmethod
    def put(
        self, keys: Sequence[str], values: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        """Stores each key's value, the concatenation of its spans; True where stored.

        A key the store holds already may be kept as it is (values are immutable by
        construction: a key names its bytes). A full store refuses (False).
        """

    @abstractmethod
    def get(
        self, keys: Sequence[str], into: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        """Reads each key's value into its spans, in order; True where the value was
        found and filled the spans exactly (a missing key or another length: False)."""

    def register(self, span: Span) -> None:  # noqa: B027 - optional hook
        """Host memory that later calls will name in spans (a backend that moves bytes
        without a copy registers it once)."""

    def unregister(self, span: Span) -> None:  # noqa: B027 - optional hook
        """`span`, registered before, is about to be freed: the backend must not name
        it to its transport again, a reconnect included. The caller unregisters only
        memory that no call still uses."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections; later calls may fail."""

    @property
    @abstractmethod
    def description(self) -> str:
        """Where the store is, for the log (never a secret)."""


def wait_until_answering(store: RemoteStore, timeout_s: float) -> bool:
    """Whether `store` answered a call within `timeout_s`: stores connect in the
    background once made, and fail calls until they do. An engine waits this long at
    start, so its first requests find the store connected; after that, it goes on."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.exists([_PROBE_KEY], max(0.05, deadline - time.monotonic()))
            return True
        except RemoteStoreError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
