"""The tier's layers plug into the core's seams, and the core stands without them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("vllm")

from tests.unit.connector_configs import (  # noqa: E402
    one_layer_kv_config,
    vllm_config,
    with_connector,
)
from vllm_cpu_offload import layers  # noqa: E402
from vllm_cpu_offload.scheduler.block_pool import HostBlockPool  # noqa: E402
from vllm_cpu_offload.scheduler.retention import Retention  # noqa: E402
from vllm_cpu_offload.scheduler.tier_seams import (  # noqa: E402
    NoRetention,
    NoSharedTier,
    no_hints,
)
from vllm_cpu_offload.spec import OffloadSpec  # noqa: E402


def _spec(model: str, **extra: Any) -> OffloadSpec:
    config = with_connector(vllm_config(model), **extra)
    return OffloadSpec(config, one_layer_kv_config())


def test_the_layers_a_setting_asks_for_fill_their_seams(
    tiny_model: str, tmp_path: Path
) -> None:
    spec = _spec(tiny_model, swap_space_path=str(tmp_path), retain_share=0.25)
    names = [type(layer).__module__ for layer in spec.layers]
    assert names == [
        "vllm_cpu_offload.metrics",
        "vllm_cpu_offload.lora_identity",
        "vllm_cpu_offload.scheduler.hints_layer",
        "vllm_cpu_offload.persist.layer",
        "vllm_cpu_offload.runtime_weights",
        "vllm_cpu_offload.adapter_reloads",
    ]
    scheduler = spec.build_scheduler()
    assert isinstance(scheduler.retention, Retention)
    assert scheduler.retention.budget == 16
    assert scheduler.read_hints is not no_hints
    assert isinstance(scheduler.pool, HostBlockPool)
    assert scheduler.pool._persistence is not None  # the file tier's index
    assert type(scheduler.shared) is NoSharedTier
    assert len(scheduler.on_identity_change) == 2  # the file tier, the warning
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
    assert isinstance(scheduler.pool, HostBlockPool)
    assert scheduler.pool._persistence is None
    worker = spec.build_worker()
    assert worker.memory is None and worker.open_shared_tier is None
    assert list(tmp_path.iterdir()) == []  # no file of the tier was made


def test_a_setting_no_layer_serves_is_refused_before_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_cpu_offload.config import OffloadConfig
    from vllm_cpu_offload.errors import OffloadConfigError

    config = OffloadConfig(swap_space_gib=1, swap_space_path=str(tmp_path))
    layers.check_settings(config, ("swap_space_path", "remote_url"))
    monkeypatch.setattr(layers, "LAYERS", ("vllm_cpu_offload.remote.layer",))
    with pytest.raises(OffloadConfigError, match="^swap_space_path needs a layer"):
        layers.check_settings(config, ("swap_space_path", "remote_url"))
    # The layer that serves a setting checks it.
    bad = OffloadConfig(swap_space_gib=1, remote_url="redis://h:1/?nope=1")
    with pytest.raises(OffloadConfigError, match="nope"):
        layers.check_settings(bad, ("swap_space_path", "remote_url"))


@pytest.mark.parametrize("mla", [False, True], ids=["user", "platform"])
def test_where_vllm_turned_prefix_caching_off_the_tier_serves_nothing(
    tiny_model: str, mla: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's CPU platform turns prefix caching off for MLA models without its AMX
    # backend (it does not trust the CPU MLA backend with cached context), and a
    # user may turn it off: the tier then neither loads nor stores, and says why.
    from types import SimpleNamespace

    from vllm.v1.request import Request

    from vllm_cpu_offload import spec as spec_module

    config = with_connector(vllm_config(tiny_model))
    config.cache_config.enable_prefix_caching = False
    monkeypatch.setattr(type(config.model_config), "use_mla", mla)
    lines: list[str] = []
    monkeypatch.setattr(spec_module.logger, "warning", lines.append)
    scheduler = OffloadSpec(config, one_layer_kv_config()).build_scheduler()
    request = cast(Request, SimpleNamespace(lora_request=None))
    assert not scheduler.hashes_hold(request)
    assert len(lines) == 1 and "prefix caching off" in lines[0]
    assert ("MLA" in lines[0]) == mla
    config.cache_config.enable_prefix_caching = True
    scheduler = OffloadSpec(config, one_layer_kv_config()).build_scheduler()
    assert scheduler.hashes_hold(request)
