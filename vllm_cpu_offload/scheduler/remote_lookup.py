"""The scheduler half's question to the shared store: how many of a request's next
blocks does it hold, on every rank (with several KV cache groups: which of each
group's blocks)?

One batched call per lookup, for every block past the device and host hits and every
rank's shard. A block counts only when each rank holds its shard; with one group the
hit is the longest such run from the first block on. The call is bounded by its
timeout; a store that fails or is slow answers "none" (a miss, counted), and after a
failure the store is left alone for `backoff_s`, so a dead store costs a step at most
one timeout per back-off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from vllm_cpu_offload.remote.namespace import shard_key
from vllm_cpu_offload.remote.store import RemoteStore, RemoteStoreError

logger = logging.getLogger(__name__)


class RemoteLookup:
    """Counts a request's blocks that the shared store holds; see the module
    docstring."""

    def __init__(
        self,
        store: RemoteStore,
        ranks: Sequence[str],
        *,
        timeout_s: float,
        backoff_s: float = 1.0,
    ) -> None:
        self.store = store
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.failures = 0
        # The time source of the back-off and of the shared tier's window for blocks
        # the store failed to serve (a simulation steps its own).
        self.clock: Callable[[], float] = time.monotonic
        self._quiet_until = 0.0

    def held(self, keys: Sequence[str]) -> list[bool]:
        """For each of `keys` (rank-independent), whether every rank holds it; all
        False when the store fails or is left alone after a failure."""
        if not keys or self.clock() < self._quiet_until:
            return [False] * len(keys)
        shards = [shard_key(k, r) for k in keys for r in self.ranks]
        try:
            found = self.store.exists(shards, self.timeout_s)
        except RemoteStoreError as e:
            self.failures += 1
            self._quiet_until = self.clock() + self.backoff_s
            logger.debug("remote KV lookup failed: %s", e)
            return [False] * len(keys)
        ranks = len(self.ranks)
        return [all(found[i * ranks : i * ranks + ranks]) for i in range(len(keys))]

    def close(self) -> None:
        self.store.close()
