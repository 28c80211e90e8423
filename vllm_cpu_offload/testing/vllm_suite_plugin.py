"""A pytest plugin that loads this package into a run of vLLM's own test suite.

vLLM applies its general plugins only when it builds EngineArgs, and the import hook
only when `vllm.engine.arg_utils` is imported, so a run of vLLM's unit tests might never
load ours and a "plugin loaded" count would silently be a plain one. `-p
vllm_cpu_offload.testing.vllm_suite_plugin` applies the plugin before collection and
fails any test after which it is no longer in place (checked per test, so that it also
holds in pytest-xdist's worker processes, where the tests run).
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from vllm_cpu_offload import flags, omp_cores
from vllm_cpu_offload.config import CONNECTOR_NAME
from vllm_cpu_offload.plugin import register


def plugin_in_place() -> list[str]:
    """What of the plugin is missing from vLLM right now (empty when all of it is
    there)."""
    # vLLM on use only: pytest loads this plugin before vLLM's conftest runs.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    missing = []
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        missing.append(f"{CONNECTOR_NAME} in KVConnectorFactory")
    if not flags.applied():
        missing.append("the two engine flags")
    if not omp_cores.applied():
        missing.append("the core-reservation patch")
    return missing


def pytest_configure(config: pytest.Config) -> None:
    register()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when == "teardown" and report.passed:
        missing = plugin_in_place()
        if missing:
            report.outcome = "failed"
            report.longrepr = (
                f"vllm_cpu_offload is no longer in place: {', '.join(missing)}"
            )
    return report
