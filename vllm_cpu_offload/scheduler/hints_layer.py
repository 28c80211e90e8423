"""Request hints and retention, as a layer of the tier (`layers.py`).

It fills two seams of the scheduler half (`tier_seams.py`): `read_hints` reads what a
client says of a request's KV (`request_hints.py`), and `retention` keeps the blocks
of a `retain` hint from eviction within `retain_share` of the pool
(`retention.py`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from vllm_cpu_offload.layers import TierLayer
from vllm_cpu_offload.scheduler.request_hints import hints_of
from vllm_cpu_offload.scheduler.retention import Retention

if TYPE_CHECKING:
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler


def attach_hints(
    scheduler: HostTierScheduler, *, retain_blocks: int, max_retain_s: float
) -> None:
    """The scheduler reads requests' hints and retains at most `retain_blocks`
    blocks, each for at most `max_retain_s` seconds."""
    scheduler.read_hints = functools.partial(hints_of, max_retain_s=max_retain_s)
    scheduler.retention = Retention(scheduler.pool, retain_blocks, scheduler.stats)


class HintsLayer(TierLayer):
    """Reads every request's hints; retains within `retain_share` of the pool."""

    def attach_scheduler(self, scheduler: HostTierScheduler) -> None:
        config = self.spec.config
        attach_hints(
            scheduler,
            retain_blocks=int(config.retain_share * self.spec.num_host_blocks),
            max_retain_s=config.max_retain_s,
        )


layer = HintsLayer
