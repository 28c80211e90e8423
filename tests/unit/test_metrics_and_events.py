"""The tier's statistics and KV events reach vLLM through their layers, and the
connector reports none without them."""

from __future__ import annotations

from typing import Any, cast

import pytest

pytest.importorskip("vllm")

from tests.unit.connector_configs import (  # noqa: E402
    one_layer_kv_config,
    vllm_config,
    with_connector,
)
from vllm_cpu_offload import layers  # noqa: E402
from vllm_cpu_offload.events import EventsLayer  # noqa: E402
from vllm_cpu_offload.metrics import (  # noqa: E402
    MetricsLayer,
    OffloadPromMetrics,
    OffloadStats,
)


def _scheduler_connector(tiny_model: str, *, kv_events: bool) -> Any:
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_cpu_offload.connector import CPUOffloadConnector

    config = with_connector(vllm_config(tiny_model))
    if kv_events:
        config.kv_events_config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="null"
        )
    return CPUOffloadConnector(config, KVConnectorRole.SCHEDULER, one_layer_kv_config())


def _store(connector: Any, hashes: list[bytes]) -> None:
    pool = connector.scheduler.pool
    allocated = pool.allocate_for_store([(0, h) for h in hashes], None)
    pool.complete_store([key for key, _ in allocated], True)


def test_the_scheduler_half_reports_what_changed_since_its_last_report(
    tiny_model: str,
) -> None:
    connector = _scheduler_connector(tiny_model, kv_events=False)
    assert [type(layer) for layer in connector.spec.layers][:1] == [MetricsLayer]
    connector.scheduler.stats.hit_tokens += 64
    _store(connector, [b"a", b"b"])
    first = connector.get_kv_connector_stats()
    assert isinstance(first, OffloadStats)
    assert first.data["hit_tokens"] == 64
    assert first.data["host_usage_perc"] == pytest.approx(2 / 64)
    second = connector.get_kv_connector_stats()
    assert "hit_tokens" not in second.data  # an increment is reported once
    assert second.data["host_usage_perc"] == pytest.approx(2 / 64)  # a gauge stays
    # vLLM sums the reports of a step's engines.
    summed = type(connector).build_kv_connector_stats(first.data)
    assert isinstance(summed, OffloadStats)
    summed.aggregate(OffloadStats(data={"hit_tokens": 32, "host_usage_perc": 0.5}))
    assert summed.reduce()["hit_tokens"] == 96
    assert summed.reduce()["host_usage_perc"] == 0.5


def test_kv_events_are_published_only_while_vllm_asks_for_them(
    tiny_model: str,
) -> None:
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored

    quiet = _scheduler_connector(tiny_model, kv_events=False)
    assert not any(isinstance(layer, EventsLayer) for layer in quiet.spec.layers)
    _store(quiet, [b"a"])
    assert list(quiet.take_events()) == []

    loud = _scheduler_connector(tiny_model, kv_events=True)
    _store(loud, [b"a", b"b"])
    events = list(loud.take_events())
    assert [type(e) for e in events] == [BlockStored]
    assert events[0].medium == MEDIUM_CPU and len(events[0].block_hashes) == 2
    loud.scheduler.pool.reset()
    events = list(loud.take_events())
    assert [type(e) for e in events] == [BlockRemoved]
    assert list(loud.take_events()) == []  # taken once


def test_prometheus_metrics_register_and_count_per_engine(tiny_model: str) -> None:
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from vllm_cpu_offload.connector import CPUOffloadConnector

    metrics = CPUOffloadConnector.build_prom_metrics(
        vllm_config(tiny_model),
        cast(Any, {Counter: Counter, Gauge: Gauge, Histogram: Histogram}),
        ["engine"],
        {0: ["0"]},
    )
    assert isinstance(metrics, OffloadPromMetrics)
    try:
        metrics.observe({"hit_tokens": 5, "host_usage_perc": 0.25}, engine_idx=0)
        metrics.observe({"hit_tokens": 2, "host_usage_perc": 0.5}, engine_idx=0)
        sample = REGISTRY.get_sample_value
        assert sample("vllm:cpu_offload_hit_tokens_total", {"engine": "0"}) == 7
        assert sample("vllm:cpu_offload_host_usage_perc", {"engine": "0"}) == 0.5
    finally:
        for collector in list(REGISTRY._collector_to_names):
            names = REGISTRY._collector_to_names[collector]
            if any(n.startswith("vllm:cpu_offload_") for n in names):
                REGISTRY.unregister(collector)


def test_without_their_layers_the_connector_reports_nothing(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a tree without metrics.py, events.py and their lines in LAYERS: vLLM's base
    # connector's answers, and the tier still counts its evictions.
    from vllm_cpu_offload.connector import CPUOffloadConnector

    monkeypatch.setattr(layers, "LAYERS", ())
    connector = _scheduler_connector(tiny_model, kv_events=True)
    assert connector.spec.layers == []
    connector.scheduler.stats.hit_tokens += 64
    assert connector.get_kv_connector_stats() is None
    assert CPUOffloadConnector.build_kv_connector_stats({"hit_tokens": 1}) is None
    assert (
        CPUOffloadConnector.build_prom_metrics(vllm_config(tiny_model), {}, [], {})
        is None
    )
    _store(connector, [b"a"])
    connector.scheduler.pool.reset()
    assert list(connector.take_events()) == []
