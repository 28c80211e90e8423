"""The `vllm.general_plugins` entry point.

vLLM calls `register()` in the API server before it builds its parser, in the engine
core and in every worker, possibly more than once per process: each step here is
idempotent.
"""

from __future__ import annotations

from vllm_cpu_offload import flags, omp_cores
from vllm_cpu_offload.config import CONNECTOR_MODULE, CONNECTOR_NAME

_warned = False


def register() -> None:
    """Registers the connector, adds the two engine flags, keeps the model's cores as
    without.

    On a vLLM release the package is not tested against it patches nothing and says so
    once per process: vLLM then runs exactly as without the package, and the two flags
    are unknown to it.
    """
    global _warned
    # vLLM on use only: `import vllm_cpu_offload` must not import vLLM (the import
    # hook and vLLM's plugin loader call this while vLLM is being imported).
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.logger import init_logger

    reason = flags.unsupported_vllm(vllm.__version__)
    if reason is not None:
        if not _warned:
            init_logger(__name__).warning(
                "%s; --enable-cpu-offload is unavailable", reason
            )
            _warned = True
        return
    flags.apply()
    omp_cores.apply()
    # Before any model loads in this process: the weights identity is what the
    # loader reads (`weight_reads.py`).
    from vllm_cpu_offload.runtime_weights import install_model_watch
    from vllm_cpu_offload.weight_reads import install_read_observer

    install_read_observer()
    install_model_watch()
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME
        )
