"""The `vllm.general_plugins` entry point.

vLLM calls `register()` in the API server before it builds its parser, in the engine core
and in every worker, possibly more than once per process: each step here is idempotent.
"""

from __future__ import annotations

from vllm_cpu_offload.config import CONNECTOR_MODULE, CONNECTOR_NAME


def register() -> None:
    """Registers the connector, adds the two engine flags, keeps the model's cores as without."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_cpu_offload import flags, omp_cores

    flags.apply()  # checks the vLLM version first
    omp_cores.apply()
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
