"""The tier's layers plug into the core's seams, and the core stands without them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.unit.test_kv_identity import (  # noqa: E402
    BLOCK_SIZE,
    one_layer_kv_config,
    vllm_config,
)
from vllm_cpu_offload import layers  # noqa: E402
from vllm_cpu_offload.scheduler.retention import Retention  # noqa: E402
from vllm_cpu_offload.scheduler.tier_seams import (  # noqa: E402
    NoRetention,
    NoSharedTier,
    no_hints,
)
from vllm_cpu_offload.spec import OffloadSpec  # noqa: E402


def _spec(model: str, **extra: Any) -> OffloadSpec:
    from vllm.config import KVTransferConfig

    config = vllm_config(model)
    page_bytes = BLOCK_SIZE * 2 * 4
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="CPUOffloadConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "swap_space_gib": 64 * page_bytes / (1 << 30),
            **extra,
        },
    )
    return OffloadSpec(config, one_layer_kv_config())


def test_the_layers_a_setting_asks_for_fill_their_seams(
    tiny_model: str, tmp_path: Path
) -> None:
    spec = _spec(tiny_model, swap_space_path=str(tmp_path), retain_share=0.25)
    names = [type(layer).__module__ for layer in spec.layers]
    assert names == [
        "vllm_cpu_offload.lora_identity",
        "vllm_cpu_offload.scheduler.hints_layer",
        "vllm_cpu_offload.persist.layer",
    ]
    scheduler = spec.build_scheduler()
    assert isinstance(scheduler.retention, Retention)
    assert scheduler.retention.budget == 16
    assert scheduler.read_hints is not no_hints
    assert scheduler.pool._persistence is not None  # the file tier's index
    assert type(scheduler.shared) is NoSharedTier
    spec.close()


def test_without_its_layers_the_core_is_a_host_tier_alone(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a tree without the layers' modules and their lines in LAYERS: the settings
    # of missing layers change nothing, and the tier serves from host memory.
    monkeypatch.setattr(layers, "LAYERS", ())
    spec = _spec(tiny_model, swap_space_path=str(tmp_path), retain_share=0.25)
    assert spec.layers == []
    scheduler = spec.build_scheduler()
    assert type(scheduler.retention) is NoRetention
    assert scheduler.read_hints is no_hints
    assert scheduler.pool._persistence is None
    worker = spec.build_worker()
    assert worker.memory is None and worker.open_shared_tier is None
    assert list(tmp_path.iterdir()) == []  # no file of the tier was made
