"""Weights that change while the engine runs, as a layer of the tier (`layers.py`).

The shared store's namespace and the file tier's fingerprint name the weights the
engine loaded at start. Weights replaced later (an RL loop's weight sync, a reload from
disk) compute other KV under the same block hashes, so from the first sign of a change
the KV this engine computes is kept from every engine but itself and from every start
but this one:
- the shared store is sealed, on each worker before the weights change (nothing more
  is written to it or fetched from it) and in the scheduler half once it hears of it
  (nothing more is asked or planned): `SharedTier.seal`, `RemoteIO.seal`;
- the file tier's fingerprint becomes this start's (`BlockIndex.make_private`): the
  next start restores nothing of it;
- the host tier drops every block it holds, and each worker refuses the loads of the
  steps planned before the scheduler half heard of the change (vLLM recomputes them):
  `HostTierScheduler.identity_changed`, `HostTierWorker.weights_changed`. A caller
  that reset vLLM's prefix cache alone before the change is served nothing of before,
  as by vLLM; what vLLM's prefix cache still holds it serves itself.

The signs, whichever comes first:
- vLLM resets the connector's cache (`reset_cache`): it does so before weight updates
  (`pause_generation(clear_cache=True)`, which RL loops use) and sleep;
- weights are loaded into a loaded model: every model vLLM's loader makes at start
  (`weight_reads`, `get_model_loader`'s `load_model`) has its own `load_weights`
  wrapped on the instance (`watch_model`), the call every weight path ends in
  (`reload_weights`: model_loader/reload/inplace.py:95; the IPC and NCCL weight
  transfer engines: distributed/weight_transfer/ipc_engine.py:245,
  nccl_engine.py:227; a worker extension's method of an RL framework), whoever calls
  it. The start's own load calls
  the class's method before the wrap (base_loader.py:88, default_loader.py:498) and
  before any worker half exists, so it is no change;
- a weight-transfer session, whose steps may write weights without `load_weights`
  (resharded straight into live parameters, distributed/weight_transfer/m2n_engine.py:
  258; the layer-wise finalize copies into kernel tensors,
  model_loader/reload/layerwise.py:311, run by `finish_weight_update`,
  ipc_engine.py:174): vLLM's `Worker.start_weight_update`,
  `start_draft_weight_update`, `update_weights` and `finish_weight_update`
  (gpu_worker.py:1507-1587), and `reload_weights`, tell this worker's tier first.
A worker's tier seals its store at once and reports the change with its next step; a
change told again (each chunk of a session, its finish) drops what the host tier
stored since, KV of weights half replaced.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_cpu_offload.layers import TierLayer

if TYPE_CHECKING:
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler
    from vllm_cpu_offload.spec import OffloadSpec
    from vllm_cpu_offload.worker.tier_worker import HostTierWorker

logger = init_logger("vllm.cpu_offload")

# vLLM's worker methods of a weight-transfer session, which may change the weights
# without the model's `load_weights` (those a release lacks are skipped).
WEIGHT_CHANGERS = (
    "reload_weights",
    "start_weight_update",
    "start_draft_weight_update",
    "update_weights",
    "finish_weight_update",
)

# This process's worker halves, told before any weight changes.
_workers: list[weakref.WeakMethod[Callable[[str], None]]] = []


def install_weight_hooks() -> None:
    """Makes vLLM's weight-changing worker methods tell this process's tier first; a
    second call changes nothing."""
    from vllm.v1.worker.gpu_worker import Worker

    for name in WEIGHT_CHANGERS:
        original = getattr(Worker, name, None)
        if original is None or hasattr(original, "_cpu_offload_original"):
            continue
        why = f"vLLM's {name} changed the weights at run time"
        setattr(Worker, name, _telling_the_tier(why, original))


def _telling_the_tier(why: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (a function or a bound method), telling the tier `why` first."""

    @functools.wraps(original)
    def changing_weights(*args: Any, **kwargs: Any) -> Any:
        weights_changing(why)
        return original(*args, **kwargs)

    changing_weights._cpu_offload_original = original  # type: ignore[attr-defined]
    return changing_weights


def watch_model(model: Any) -> None:
    """Makes `model.load_weights` tell this process's tier first, on this instance
    (a second call changes nothing)."""
    load_weights = getattr(model, "load_weights", None)
    if load_weights is None or hasattr(load_weights, "_cpu_offload_original"):
        return

    loading_weights = _telling_the_tier(
        "weights were loaded into the model at run time", load_weights
    )
    # object's setattr: nn.Module's would take a callable for nothing special either,
    # but a model class may override __setattr__.
    object.__setattr__(model, "load_weights", loading_weights)


def install_model_watch() -> None:
    """Every model vLLM's loader makes in this process from now on is watched."""
    from vllm_cpu_offload.weight_reads import on_model_loaded

    if watch_model not in on_model_loaded:
        on_model_loaded.append(watch_model)


def weights_changing(why: str) -> None:
    """Tells every worker half of this process that its weights change now."""
    tell_each(_workers, why)


def tell_each(listeners: list[weakref.WeakMethod[Any]], *args: Any) -> None:
    """Calls every live listener with `args`; drops those whose worker is gone."""
    for ref in list(listeners):
        told = ref()
        if told is None:
            listeners.remove(ref)
        else:
            told(*args)


class RuntimeWeightsLayer(TierLayer):
    """Stops serving KV of the weights before once the weights may change: every
    tier wants it, the host tier alone too."""

    def __init__(self, spec: OffloadSpec) -> None:
        super().__init__(spec)
        self._announced = False

    def attach_scheduler(self, scheduler: HostTierScheduler) -> None:
        scheduler.on_identity_change.append(self._announce)

    def attach_worker(self, worker: HostTierWorker) -> None:
        install_weight_hooks()
        _workers.append(weakref.WeakMethod(worker.weights_changed))

    def _announce(self, why: str) -> None:
        config = self.spec.config
        effects = []
        if config.remote_url is not None:
            effects.append("nothing more is shared through the shared tier")
        if config.swap_space_path is not None:
            effects.append("the file tier restores none of it at the next start")
        if self._announced or not effects:  # the host tier alone: it just drops
            return
        self._announced = True
        logger.warning(
            "CPU offload: %s; the weights may no longer be those the engine started "
            "with, so %s (restart the engine to share and keep KV again)",
            why,
            " and ".join(effects),
        )


layer = RuntimeWeightsLayer
