"""A store whose reads wait at a gate: tests hold a fetch for as long as they need
without depending on how fast anything runs.

    py://vllm_cpu_offload.testing.gated_store:GatedStore?store=URL&gate=PATH

`store` is the store it passes every call to (percent-encoded); each `get` first waits
until the file `gate` exists, within the call's timeout. It is also a small example of
a store of the user's own (`py://`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from vllm_cpu_offload.remote.registry import open_store
from vllm_cpu_offload.remote.store import RemoteStore, RemoteStoreError, Span
from vllm_cpu_offload.remote.url import RemoteUrl

_POLL_S = 0.01


class GatedStore(RemoteStore):
    def __init__(self, url: RemoteUrl, *, role: str) -> None:
        inner, gate = url.option("store"), url.option("gate")
        if not inner or not gate:
            raise ValueError("a gated store needs ?store=URL&gate=PATH")
        self._inner = open_store(inner, role=role)
        self._gate = Path(gate)

    @property
    def description(self) -> str:
        return f"{self._inner.description}, reads gated by {self._gate}"

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        return self._inner.exists(keys, timeout_s)

    def put(
        self, keys: Sequence[str], values: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        return self._inner.put(keys, values, timeout_s)

    def get(
        self, keys: Sequence[str], into: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        deadline = time.monotonic() + timeout_s
        while not self._gate.exists():
            if time.monotonic() >= deadline:
                raise RemoteStoreError(f"the gate {self._gate} stayed closed")
            time.sleep(_POLL_S)
        return self._inner.get(keys, into, max(0.0, deadline - time.monotonic()))

    def register(self, span: Span) -> None:
        self._inner.register(span)

    def close(self) -> None:
        self._inner.close()
