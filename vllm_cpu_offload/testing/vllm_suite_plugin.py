"""A pytest plugin that loads this package into a run of vLLM's own test suite.

vLLM applies its general plugins only when it builds EngineArgs, and the import hook only when
`vllm.engine.arg_utils` is imported, so a run of vLLM's unit tests might never load ours and a
"plugin loaded" count would silently be a plain one. `-p vllm_cpu_offload.testing.vllm_suite_plugin`
applies the plugin before collection and fails the session if it is not in place at the end.
"""

from __future__ import annotations

import pytest


def plugin_in_place() -> list[str]:
    """What of the plugin is missing from vLLM right now (empty when all of it is there)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_cpu_offload import flags, omp_cores
    from vllm_cpu_offload.config import CONNECTOR_NAME

    missing = []
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        missing.append(f"{CONNECTOR_NAME} in KVConnectorFactory")
    if not flags.applied():
        missing.append("the two engine flags")
    if not omp_cores.applied():
        missing.append("the core-reservation patch")
    return missing


def pytest_configure(config: pytest.Config) -> None:
    from vllm_cpu_offload.plugin import register

    register()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    missing = plugin_in_place()
    if missing:
        print(f"\nvllm_cpu_offload was not in place at the end: {', '.join(missing)}")
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
