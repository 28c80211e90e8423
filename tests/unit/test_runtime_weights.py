"""vLLM's weight-changing worker methods tell the worker half first
(`runtime_weights.py`): its shared store is sealed before any weight changes, and its
next report carries the change to the scheduler half."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from vllm_cpu_offload import runtime_weights  # noqa: E402
from vllm_cpu_offload.worker.tier_seams import NoSharedTierWorker  # noqa: E402
from vllm_cpu_offload.worker.tier_worker import HostTierWorker  # noqa: E402


class SealRecorder(NoSharedTierWorker):
    def __init__(self, order: list[str]) -> None:
        self.order = order

    def seal(self) -> None:
        self.order.append("sealed")


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's Worker with the hooks, put back as it was after the test."""
    for name in runtime_weights.WEIGHT_CHANGERS:
        if hasattr(Worker, name):
            monkeypatch.setattr(Worker, name, getattr(Worker, name))
    monkeypatch.setattr(runtime_weights, "_workers", [])
    runtime_weights.install_weight_hooks()
    runtime_weights.install_weight_hooks()  # a second worker half: no second wrap


def test_reload_weights_seals_the_store_before_the_weights_change(
    hooked: None,
) -> None:
    order: list[str] = []
    tier = HostTierWorker(num_slots=4, num_device_blocks=4)
    tier.shared = SealRecorder(order)
    runtime_weights._workers.append(
        runtime_weights.weakref.WeakMethod(tier.weights_changed)
    )
    runner = SimpleNamespace(reload_weights=lambda: order.append("reloaded"))
    worker = SimpleNamespace(vllm_config=VllmConfig(), model_runner=runner)
    Worker.reload_weights(cast(Worker, worker))  # what the method reads of it
    assert order == ["sealed", "reloaded"]
    report = tier.take_report()
    assert report is not None and "reload_weights" in str(report.weights_changed)
    assert tier.take_report() is None  # told once


def test_every_weight_changer_of_this_vllm_is_hooked(hooked: None) -> None:
    present = [n for n in runtime_weights.WEIGHT_CHANGERS if hasattr(Worker, n)]
    assert "reload_weights" in present and "update_weights" in present
    for name in present:
        original = getattr(Worker, name)._cpu_offload_original
        assert not hasattr(original, "_cpu_offload_original")


@pytest.fixture
def loaded_model(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's own Llama model class, made by vLLM's loader at start (`get_model`)
    in this process, with the hooks a worker has."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.model_loader import get_model

    from tests.unit.connector_configs import vllm_config
    from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama
    from vllm_cpu_offload.weight_reads import forget_start, install_read_observer

    install_read_observer()
    runtime_weights.install_model_watch()
    # The loader frees the accelerator's cache: this torch has no accelerator.
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    config = vllm_config(str(ensure_tiny_llama()))
    config.device_config.device = torch.device("cpu")
    ours = not torch.distributed.is_initialized()
    with set_current_vllm_config(config), forget_start():
        if ours:
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{tmp_path}/rendezvous",
                backend="gloo",
            )
            ps.ensure_model_parallel_initialized(1, 1)
        try:
            yield get_model(vllm_config=config)
        finally:
            if ours:
                ps.destroy_model_parallel()
                ps.destroy_distributed_environment()


def test_weights_an_extension_loads_into_the_model_are_a_change(
    hooked: None, loaded_model: Any
) -> None:
    # An RL framework's worker extension: `self.model_runner.model.load_weights(...)`
    # with no worker method of vLLM around it, then a prefix-cache reset only.
    tier = HostTierWorker(num_slots=4, num_device_blocks=4)
    runtime_weights._workers.append(
        runtime_weights.weakref.WeakMethod(tier.weights_changed)
    )
    assert tier.take_report() is None  # the start's own load is no change
    norm = dict(loaded_model.named_parameters())["model.norm.weight"]
    loaded_model.load_weights([("model.norm.weight", torch.zeros_like(norm))])
    assert not norm.any()  # the weights did change
    report = tier.take_report()
    assert report is not None and list(report.epochs.values()) == [1]
    assert "loaded into the model" in str(report.weights_changed)


def test_finishing_a_weight_transfer_session_is_a_change(hooked: None) -> None:
    # The layer-wise finalize writes the weights without the model's load_weights.
    tier = HostTierWorker(num_slots=4, num_device_blocks=4)
    runtime_weights._workers.append(
        runtime_weights.weakref.WeakMethod(tier.weights_changed)
    )
    order: list[str] = []
    engine = SimpleNamespace(
        finish_weight_update=lambda: order.append("finalized"),
        reset_weight_update_target=lambda: None,
    )
    worker = SimpleNamespace(
        vllm_config=VllmConfig(),
        weight_transfer_engine=engine,
        _weight_update_active=True,
        _weight_update_is_draft=True,
        _check_weight_transfer_engine=lambda: None,
        get_draft_model=lambda: None,  # vLLM 0.33 asks for a draft session
    )
    Worker.finish_weight_update(cast(Worker, worker))
    report = tier.take_report()
    assert order == ["finalized"]
    assert report is not None and "finish_weight_update" in str(report.weights_changed)
