"""Fault injection for tests: fail a chosen share of a worker's loads and stores.

A test sets `HostTierWorker.faults` (the worker's seam for it) to a `FaultInjector`;
from then on the worker reports about `share` of its transfer jobs as failed without
copying them, as a broken copy would. That exercises the fault path of a real engine: a
failed load becomes a recompute (vLLM's `kv_load_failure_policy=recompute`, which the
flags set), a failed store a miss. The draw is seeded, so a run is reproducible.
"""

from __future__ import annotations

import random


class FaultInjector:
    """Decides, job by job, whether a transfer fails; `share` of them on average."""

    def __init__(self, share: float, seed: int = 0) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {share}")
        self.share = share
        self._rng = random.Random(seed)

    def fails(self) -> bool:
        return self._rng.random() < self.share
