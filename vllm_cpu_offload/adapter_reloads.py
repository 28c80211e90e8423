"""LoRA adapters a worker loads again with other weights, as a layer of the tier.

vLLM's worker loads an adapter's files again, in place, whenever a request or an
`add_lora` asks for `load_inplace` (`LRUCacheWorkerLoRAManager.add_adapter`,
vllm/lora/worker_manager.py:289-325: at each such `add_lora`, and at every step a
request whose `LoRARequest` says so runs, since `_apply_adapters` adds each active
adapter every step, worker_manager.py:287). A load of the tier planned before,
still in flight then, would end with KV the old files computed, for a request that
runs on the new ones. So each in-place load is compared with what it replaced (every
tensor and value reachable from vLLM's `LoRAModel`): other weights move the epoch of
every worker half of this process on (`HostTierWorker.adapter_changed`), which
refuses the loads planned or in flight before; the same weights loaded again change
nothing. What is compared is what was loaded, whatever the adapter's source (a
folder, a hub id).

Cost: one comparison of the adapter's weights (in host memory, where vLLM loads
them: worker_manager.py:145) per in-place load, beside vLLM's own read of its files.
An adapter evicted (`--max-cpu-loras`) and later loaded from changed files, with no
in-place load, is not compared: nothing of the old one is left to compare with.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from vllm_cpu_offload.layers import TierLayer
from vllm_cpu_offload.runtime_weights import tell_each

if TYPE_CHECKING:
    from vllm_cpu_offload.worker.tier_worker import HostTierWorker

logger = init_logger("vllm.cpu_offload")

# This process's worker halves, told when an adapter's weights change.
_workers: list[weakref.WeakMethod[Callable[[], None]]] = []
# Nesting a comparison walks at most; deeper: taken as changed.
_MAX_DEPTH = 8


def install_adapter_hook() -> None:
    """Makes vLLM's worker LoRA manager tell this process's tier when an in-place
    load changes an adapter's weights; a second call changes nothing."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    original = LRUCacheWorkerLoRAManager.add_adapter
    if hasattr(original, "_cpu_offload_original"):
        return
    LRUCacheWorkerLoRAManager.add_adapter = _comparing(original)  # type: ignore[method-assign]


def _comparing(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def add_adapter(self: Any, lora_request: Any) -> bool:
        adapter_id = lora_request.lora_int_id
        # `list_adapters` reads vLLM's cache without touching its LRU order.
        before = self._adapter_manager.list_adapters().get(adapter_id)
        loaded = original(self, lora_request)
        after = self._adapter_manager.list_adapters().get(adapter_id)
        if before is not None and after is not before and not _same(before, after):
            logger.info(
                "CPU offload: LoRA adapter %r was loaded again with other weights; "
                "the tier's loads planned before it are recomputed",
                lora_request.lora_name,
            )
            adapter_changed()
        return loaded

    add_adapter._cpu_offload_original = original  # type: ignore[attr-defined]
    return add_adapter


def adapter_changed() -> None:
    """Tells every worker half of this process that an adapter's weights changed."""
    tell_each(_workers)


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether `a` and `b` hold the same values: tensors by value, containers and
    objects by their contents. Anything it cannot compare counts as changed (a
    recompute, never a wrong token)."""
    if a is b:
        return True
    if type(a) is not type(b) or depth > _MAX_DEPTH:
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (int, float, str, bytes, bool, type(None))):
        return bool(a == b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(
            _same(x, y, depth + 1) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, torch.nn.Module) or not hasattr(a, "__dict__"):
        return False
    return _same(vars(a), vars(b), depth + 1)


class AdapterReloadsLayer(TierLayer):
    """Refuses the tier's loads planned before an adapter's weights changed in
    place: every tier wants it."""

    def attach_worker(self, worker: HostTierWorker) -> None:
        install_adapter_hook()
        _workers.append(weakref.WeakMethod(worker.adapter_changed))


layer = AdapterReloadsLayer
