"""Test-only fault injection: fail a chosen share of the worker's loads and stores.

`VLLM_CPU_OFFLOAD_TEST_FAIL_SHARE=0.3` makes each worker report about 30% of its
transfer jobs as failed without copying them, as a broken copy would. It exercises the
fault path of a real engine: a failed load becomes a recompute (vLLM's
`kv_load_failure_policy=recompute`, which the flags set), a failed store a miss. The
draw is seeded (`VLLM_CPU_OFFLOAD_TEST_FAIL_SEED`, default 0), so a run is reproducible.
Unset, nothing fails and the worker pays one attribute check per step.
"""

from __future__ import annotations

import os
import random

FAIL_SHARE_ENV = "VLLM_CPU_OFFLOAD_TEST_FAIL_SHARE"
FAIL_SEED_ENV = "VLLM_CPU_OFFLOAD_TEST_FAIL_SEED"


class FaultInjector:
    """Decides, job by job, whether a transfer fails; `share` of them on average."""

    def __init__(self, share: float, seed: int = 0) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{FAIL_SHARE_ENV} must be a share in [0, 1], got {share}")
        self.share = share
        self._rng = random.Random(seed)

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        value = os.environ.get(FAIL_SHARE_ENV)
        if not value:
            return None
        try:
            share = float(value)
        except ValueError:
            message = f"{FAIL_SHARE_ENV} must be a number in [0, 1], got {value!r}"
            raise ValueError(message) from None
        return cls(share, int(os.environ.get(FAIL_SEED_ENV, "0")))

    def fails(self) -> bool:
        return self._rng.random() < self.share
