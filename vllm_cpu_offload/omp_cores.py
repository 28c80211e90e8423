"""Patch `omp_core_reservation`: with our connector, the model keeps the cores it has
without it.

vLLM 0.32's CPU executor (`vllm.utils.ompmultiprocessing.OMPProcessManager`) reserves
one more core per local worker whenever any `kv_transfer_config` is set, for NIXL's
transfer threads. Our connector needs no such core: its copies run on the worker's own
thread between forward passes and borrow the idle OpenMP cores
(`worker/copy_threads.py`). The reservation would only change the model's OpenMP
threads: on a large machine it takes a core away from the model; on a machine too small
to honour it, vLLM drops the reservation altogether and the model gets one more thread
than without a connector. A different thread count changes the order of bf16 reductions,
and so greedy tokens, before the host tier has served anything.

The patch hands the manager a view of the config without the kv_transfer_config when
that config names our connector, so the cores and the binding are exactly those of vLLM
without the flag. A user's `VLLM_CPU_NUM_OF_RESERVED_CPU` or `VLLM_CPU_OMP_THREADS_BIND`
still decide, as vLLM applies them on top of the default. Other connectors keep vLLM's
reservation.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_cpu_offload.config import names_our_connector

PATCH_NAME = "omp_core_reservation"
_PATCHED_MARK = "_vllm_cpu_offload_patched"


class _ConfigWithoutConnector:
    """A read-only view of a VllmConfig whose kv_transfer_config is None."""

    kv_transfer_config = None

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def applied() -> bool:
    """Whether apply() has patched vLLM in this process."""
    # vLLM on use only, here and in apply(): the plugin imports this module early.
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    return bool(getattr(OMPProcessManager, _PATCHED_MARK, False))


def apply() -> None:
    """Applies the patch once per process; the caller has checked the vLLM version."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    if getattr(OMPProcessManager, _PATCHED_MARK, False):
        return
    original = OMPProcessManager.__init__

    @functools.wraps(original)
    def __init__(self: Any, config: Any) -> None:
        ours = names_our_connector(config.kv_transfer_config)
        view = _ConfigWithoutConnector(config) if ours else config
        original(self, view)  # type: ignore[arg-type]  # reads only what the view forwards

    OMPProcessManager.__init__ = __init__  # type: ignore[method-assign]
    setattr(OMPProcessManager, _PATCHED_MARK, True)
