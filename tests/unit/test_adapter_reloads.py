"""An adapter loaded again in place with other weights refuses the tier's loads
planned or in flight before (`adapter_reloads.py`), through vLLM's own
`LRUCacheWorkerLoRAManager.add_adapter`."""

from __future__ import annotations

import weakref
from typing import Any, cast

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.lora.lora_model import LoRAModel  # noqa: E402
from vllm.lora.lora_weights import LoRALayerWeights  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager  # noqa: E402

from tests.unit.test_tier_worker import (  # noqa: E402
    _host_only_async_load,
    _step,
    _streamed_worker,
)
from vllm_cpu_offload import adapter_reloads  # noqa: E402
from vllm_cpu_offload.metadata import BlockTransfer, OffloadStepMetadata  # noqa: E402


class _Adapters:
    """The part of vLLM's `LRUCacheLoRAModelManager` that `add_adapter` calls: its
    registered adapters by id, without a model to apply them to."""

    capacity = 4

    def __init__(self) -> None:
        self.registered: dict[int, LoRAModel] = {}

    def list_adapters(self) -> dict[int, LoRAModel]:
        return dict(self.registered)

    def get_adapter(self, adapter_id: int) -> LoRAModel | None:
        return self.registered.get(adapter_id)

    def remove_adapter(self, adapter_id: int) -> bool:
        return self.registered.pop(adapter_id, None) is not None

    def add_adapter(self, adapter: LoRAModel) -> bool:
        self.registered[adapter.id] = adapter
        return True

    def activate_adapter(self, adapter_id: int) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.registered)


class _WorkerLoRA:
    """vLLM's worker LoRA manager's state, its `_load_adapter` reading `files`."""

    def __init__(self) -> None:
        self._adapter_manager = _Adapters()
        self.files = 1.0

    def list_adapters(self) -> set[int]:
        return set(self._adapter_manager.list_adapters())

    def _load_adapter(self, request: LoRARequest) -> LoRAModel:
        weights = LoRALayerWeights(
            "q_proj", 1, 1, torch.full((1, 4), self.files), torch.ones(4, 1)
        )
        return LoRAModel(request.lora_int_id, 1, {"q_proj": weights})


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's manager with the hook, put back as it was after the test."""
    original = LRUCacheWorkerLoRAManager.add_adapter
    monkeypatch.setattr(LRUCacheWorkerLoRAManager, "add_adapter", original)
    monkeypatch.setattr(adapter_reloads, "_workers", [])
    adapter_reloads.install_adapter_hook()
    adapter_reloads.install_adapter_hook()  # a second worker half: no second wrap


def _load(manager: _WorkerLoRA, *, in_place: bool) -> None:
    request = LoRARequest("a", 1, "/adapters/a", load_inplace=in_place)
    LRUCacheWorkerLoRAManager.add_adapter(cast(Any, manager), request)


def test_an_async_load_in_flight_when_its_adapter_changes_in_place_is_refused(
    hooked: None,
) -> None:
    # An async load runs on the (held) background stream; the worker loads the
    # adapter again in place: from the same files (vLLM does it every step for a
    # `load_inplace` request) the load is taken; from rewritten files the load in
    # flight, and one planned before the scheduler half heard of it, is refused.
    worker, caches, streams = _streamed_worker()
    assert worker.engine is not None
    adapter_reloads._workers.append(weakref.WeakMethod(worker.adapter_changed))
    manager = _WorkerLoRA()
    _load(manager, in_place=False)
    _step(worker, OffloadStepMetadata(stores=[BlockTransfer(1, [5], [2], "a")]))
    background = worker.engine._background_stream
    streams.hold(background)
    _step(worker, OffloadStepMetadata(async_loads=[_host_only_async_load(2, 1, 2)]))
    _load(manager, in_place=True)
    streams.release(background)
    _step(worker, OffloadStepMetadata())
    report = worker.take_report()
    assert report is not None and dict(report.finished) == {1: 1, 2: 1}
    assert not report.epochs
    streams.hold(background)
    _step(worker, OffloadStepMetadata(async_loads=[_host_only_async_load(3, 1, 2)]))
    manager.files = 2.0  # rewritten
    _load(manager, in_place=True)
    streams.release(background)
    _step(worker, OffloadStepMetadata())
    assert worker.take_load_errors() == {1}
    report = worker.take_report()
    assert report is not None and dict(report.failed) == {3: 1}
    assert report.epochs == {worker.token: 1} and not report.weights_changed
    _step(worker, OffloadStepMetadata(loads=[BlockTransfer(4, [1], [2], "b")]))
    assert worker.take_load_errors() == {1}
    assert streams.host_waits == []
