"""Prometheus metrics of the host tier, on `vllm serve`'s /metrics endpoint.

Each engine step, the scheduler half (hits, blocks, evictions, usage) and each worker
half (time spent on transfers) hand vLLM an `OffloadStats` of what changed since the
last step; vLLM aggregates them, ships them to the API server and calls
`OffloadPromMetrics.observe`. The payload is a flat dict of plain numbers so that it
crosses processes as is.

A layer of the tier (`layers.py`): without it the connector reports no statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from vllm_cpu_offload.layers import TierLayer
from vllm_cpu_offload.scheduler.tier_stats import TierStats

if TYPE_CHECKING:
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler
    from vllm_cpu_offload.spec import OffloadSpec
    from vllm_cpu_offload.worker.tier_worker import HostTierWorker

PREFIX = "vllm:cpu_offload_"

# stats key -> help text; exposed as counters named PREFIX + key (+ "_total").
COUNTERS = {
    "lookup_tokens": (
        "Prompt tokens past the device prefix hit that were looked up in host memory."
    ),
    "hit_tokens": "Prompt tokens loaded from host memory instead of recomputed.",
    "async_hit_tokens": (
        "Of those, tokens loaded across steps while the request waited "
        "(async_load_tokens, and the host part of a shared-store hit)."
    ),
    "stored_blocks": "KV blocks copied to host memory.",
    "loaded_blocks": "KV blocks copied back from host memory.",
    "stored_bytes": "Bytes of KV copied to host memory.",
    "loaded_bytes": "Bytes of KV copied back from host memory.",
    "evicted_blocks": "KV blocks evicted from host memory.",
    "failed_transfers": (
        "Loads and stores that failed (each costs a recompute or a miss)."
    ),
    "load_seconds": "Seconds the workers spent on loads.",
    "store_seconds": "Seconds the workers spent on stores.",
    # The shared store of --swap-space-remote.
    "remote_lookup_tokens": (
        "Prompt tokens past the host hit that were looked up in the shared store."
    ),
    "remote_hit_tokens": "Prompt tokens loaded from the shared store.",
    "remote_fetched_blocks": "Host blocks fetched from the shared store (all ranks).",
    "remote_missed_blocks": (
        "Host blocks the shared store held at lookup but that did not arrive."
    ),
    "remote_lookup_failures": "Lookups in the shared store that failed or timed out.",
    "remote_written_blocks": "Block shards written through to the shared store.",
    "remote_write_dropped_blocks": (
        "Block shards not written to the shared store: the write queue was full."
    ),
    "remote_write_refused_blocks": "Block shards the shared store refused (full).",
    "remote_write_failures": "Writes to the shared store that failed or timed out.",
    "remote_fetch_failures": "Fetches from the shared store that failed or timed out.",
    "remote_rejected_blocks": (
        "Block shards read from the shared store and refused by their header or "
        "checksum."
    ),
    "remote_bytes_in": "Bytes of KV read from the shared store.",
    "remote_bytes_out": "Bytes of KV written to the shared store.",
    "remote_fetch_seconds": "Seconds the workers waited on fetches from the store.",
    "remote_fetch_calls": "Batched fetch calls to the shared store.",
    # Requests' hints (kv_transfer_params).
    "retained_hit_blocks": "Retained blocks a later request read.",
    "retains_expired_unread": "Retains whose time passed before any request read them.",
}
# stats key -> help text; counters named PREFIX + "group_" + key, with a
# `kv_cache_group` label. In the stats payload their increments travel
# as "key:group id".
GROUP_COUNTERS = {
    "stored_blocks": "KV blocks copied to host memory, per KV cache group.",
    "loaded_blocks": "KV blocks copied back from host memory, per KV cache group.",
}
GROUP_LABEL = "kv_cache_group"
# stats key -> help text; gauges keep the latest value.
GAUGES = {
    "host_usage_perc": "Fraction of the host tier's blocks in use (0-1).",
    "retained_blocks": "Host blocks that requests' retain hints keep from eviction.",
}

_SCHEDULER_COUNTERS = (
    "lookup_tokens", "hit_tokens", "async_hit_tokens", "stored_blocks", "loaded_blocks",
    "evicted_blocks",
    "remote_lookup_tokens", "remote_hit_tokens", "remote_fetched_blocks",
    "remote_missed_blocks", "retained_hit_blocks", "retains_expired_unread",
)  # fmt: skip


@dataclass
class OffloadStats(KVConnectorStats):
    """Counter increments and gauge values since the last report."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key in GAUGES:
                self.data[key] = value
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: round(value, 4) for key, value in self.data.items()}

    def is_empty(self) -> bool:
        return not self.data


class SchedulerStatsReporter:
    """Turns the scheduler half's running totals into per-step increments."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, stats: TierStats, usage: float) -> OffloadStats:
        now = {key: int(getattr(stats, key)) for key in _SCHEDULER_COUNTERS}
        now["stored_bytes"] = stats.stored_bytes
        now["loaded_bytes"] = stats.loaded_bytes
        now["failed_transfers"] = stats.failed_loads + stats.failed_stores
        now["remote_lookup_failures"] = stats.remote_lookup_failures
        for group_id, blocks in stats.stored_by_group.items():
            now[f"stored_blocks:{group_id}"] = blocks
        for group_id, blocks in stats.loaded_by_group.items():
            now[f"loaded_blocks:{group_id}"] = blocks
        data: dict[str, Any] = {
            key: value - self._last.get(key, 0)
            for key, value in now.items()
            if value != self._last.get(key, 0)
        }
        self._last = now
        data["host_usage_perc"] = usage
        data["retained_blocks"] = stats.retained_blocks
        return OffloadStats(data=data)


class OffloadPromMetrics(KVConnectorPromMetrics):
    """Registers the host tier's counters and gauges, one child per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[str, dict[int, Any]] = {}
        for key, doc in COUNTERS.items():
            self._register(self._counter_cls, key, doc)
        for key, doc in GAUGES.items():
            self._register(self._gauge_cls, key, doc)
        self._group_metrics: dict[str, Any] = {
            key: self._counter_cls(
                name=f"{PREFIX}group_{key}",
                documentation=doc,
                labelnames=[*self._labelnames, GROUP_LABEL],
            )
            for key, doc in GROUP_COUNTERS.items()
        }

    def _register(self, cls: Any, key: str, doc: str) -> None:
        metric = cls(name=PREFIX + key, documentation=doc, labelnames=self._labelnames)
        self._children[key] = {
            idx: metric.labels(*values)
            for idx, values in self.per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if ":" in key:
                name, group_id = key.split(":", 1)
                metric = self._group_metrics.get(name)
                labels = self.per_engine_labelvalues.get(engine_idx)
                if metric is not None and labels is not None and value > 0:
                    metric.labels(*labels, group_id).inc(value)
                continue
            child = self._children.get(key, {}).get(engine_idx)
            if child is None:
                continue
            if key in GAUGES:
                child.set(value)
            elif value > 0:
                child.inc(value)


class MetricsLayer(TierLayer):
    """Reports either half's statistics to vLLM each step."""

    def __init__(self, spec: OffloadSpec) -> None:
        super().__init__(spec)
        self._reporter = SchedulerStatsReporter()

    def scheduler_stats(self, scheduler: HostTierScheduler) -> OffloadStats:
        return self._reporter.take(scheduler.stats, scheduler.pool.usage)

    def worker_stats(self, worker: HostTierWorker) -> OffloadStats | None:
        data = worker.take_stats()
        return OffloadStats(data=data) if data else None

    @classmethod
    def stats_from(cls, data: dict[str, Any]) -> OffloadStats:
        return OffloadStats(data=dict(data))

    @classmethod
    def prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> OffloadPromMetrics:
        return OffloadPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )


layer = MetricsLayer
