"""The tier's layers: capabilities that plug into the seams of the host tier.

The core (the pool, the two halves, the spec) knows no layer. A layer is a module with
a `layer` class (a `TierLayer`); `LAYERS` names the modules, one line each, and the
spec builds the layers whose settings ask for them (`wanted`) in this order. Each
hook is optional; together they are every seam the core leaves open:

- the scheduler's pool: a persistence listener, and the pool once built (restore);
- the scheduler half: `HostTierScheduler.shared`, `.retention`, `.read_hints`
  (`scheduler/tier_seams.py`);
- the worker half: the memory the host buffer maps (`worker/host_buffer.py`'s
  `MappedMemory`; at most one layer gives it) and `HostTierWorker.open_shared_tier`
  (`worker/tier_seams.py`);
- what the connector reports to vLLM: each step's statistics of either half, the
  class vLLM rebuilds them with, its Prometheus metrics, and KV cache events
  (without a layer that gives them, the connector reports none, as vLLM's base
  connector does);
- before the engine starts (`flags.py`, in the process that parses the flags): the
  settings a layer serves and checks, the host memory its copies of the tier take.
  A setting that no registered layer serves is refused, never ignored.

Removing a layer's modules and its line here leaves a working tier without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )

    from vllm_cpu_offload.config import OffloadConfig
    from vllm_cpu_offload.scheduler.block_pool import HostBlockPool
    from vllm_cpu_offload.scheduler.pool_events import PersistenceListener, PoolEvent
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler
    from vllm_cpu_offload.spec import OffloadSpec
    from vllm_cpu_offload.worker.host_buffer import MappedMemory
    from vllm_cpu_offload.worker.tier_worker import HostTierWorker

LAYERS: tuple[str, ...] = (
    "vllm_cpu_offload.metrics",
    "vllm_cpu_offload.events",
    "vllm_cpu_offload.lora_identity",
    "vllm_cpu_offload.scheduler.hints_layer",
    "vllm_cpu_offload.scheduler.drafter_layer",
    "vllm_cpu_offload.worker.region_layer",
    "vllm_cpu_offload.persist.layer",
    "vllm_cpu_offload.remote.layer",
    "vllm_cpu_offload.runtime_weights",
    "vllm_cpu_offload.adapter_reloads",
)


class TierLayer:
    """One capability of the tier, for one process; built from the spec, which holds
    the tier's numbers."""

    # The `OffloadConfig` fields this layer serves (each off when None).
    settings: tuple[str, ...] = ()

    def __init__(self, spec: OffloadSpec) -> None:
        self.spec = spec

    @classmethod
    def check_settings(cls, config: OffloadConfig) -> None:
        """Refuses bad settings of this layer in one line, before the engine."""

    @classmethod
    def check_engine(cls, vllm_config: Any, config: OffloadConfig) -> None:
        """Refuses an engine this layer cannot serve, before it starts."""

    @classmethod
    def host_copies(
        cls, vllm_config: Any, config: OffloadConfig
    ) -> tuple[int, str] | None:
        """How many copies of the tier the engine keeps, and of what, where this
        layer decides (None: one per worker)."""
        return None

    @classmethod
    def check_fits(
        cls, config: OffloadConfig, wanted: int, copies: int, each: str
    ) -> bool:
        """Refuses `wanted` bytes of tier where this layer keeps them and they do
        not fit; whether it checked (False: they are host memory)."""
        return False

    @classmethod
    def wanted(cls, spec: OffloadSpec) -> bool:
        """Whether the tier's settings ask for this layer."""
        return True

    def pool_persistence(self) -> PersistenceListener | None:
        """What the scheduler's pool tells of every block it adds or frees."""
        return None

    def pool_built(self, pool: HostBlockPool) -> None:
        """The scheduler's pool exists, empty."""

    def attach_scheduler(self, scheduler: HostTierScheduler) -> None:
        """Fills the scheduler half's seams."""

    def host_memory(self) -> MappedMemory | None:
        """The memory this worker's host buffer maps instead of its own."""
        return None

    def attach_worker(self, worker: HostTierWorker) -> None:
        """Fills the worker half's seams."""

    def scheduler_stats(self, scheduler: HostTierScheduler) -> KVConnectorStats | None:
        """What the scheduler half tells vLLM's stats this step."""
        return None

    def worker_stats(self, worker: HostTierWorker) -> KVConnectorStats | None:
        """What this worker tells vLLM's stats this step."""
        return None

    @classmethod
    def stats_from(cls, data: dict[str, Any]) -> KVConnectorStats | None:
        """The statistics `data` came from, rebuilt where vLLM gathers them."""
        return None

    @classmethod
    def prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """The Prometheus metrics that show this layer's statistics."""
        return None

    def kv_events(
        self, scheduler: HostTierScheduler, pool_events: list[PoolEvent]
    ) -> list[KVCacheEvent]:
        """The KV cache events of this step, from the pool's events (`pool_events`,
        taken every step whether or not a layer publishes them)."""
        return []

    def close(self) -> None:
        """Releases what the layer opened."""


def layer_classes() -> list[type[TierLayer]]:
    """Every registered layer, in `LAYERS` order."""
    return [importlib.import_module(name).layer for name in LAYERS]


def load_layers(spec: OffloadSpec) -> list[TierLayer]:
    """The layers `spec`'s settings ask for, in `LAYERS` order."""
    return [cls(spec) for cls in layer_classes() if cls.wanted(spec)]


def check_settings(config: OffloadConfig, served: tuple[str, ...]) -> None:
    """Refuses a setting of `served` (the fields that layers serve) that no
    registered layer serves, then lets each layer check its own."""
    from vllm_cpu_offload.errors import OffloadConfigError

    classes = layer_classes()
    known = {name for cls in classes for name in cls.settings}
    for name in served:
        if getattr(config, name) is not None and name not in known:
            raise OffloadConfigError(
                f"{name} needs a layer of the host tier that this build does not "
                f"have; drop {name}"
            )
    for cls in classes:
        cls.check_settings(config)
