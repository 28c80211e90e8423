"""vLLM's weight-changing worker methods tell the worker half first
(`runtime_weights.py`): its shared store is sealed before any weight changes, and its
next report carries the change to the scheduler half."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

pytest.importorskip("vllm")

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
