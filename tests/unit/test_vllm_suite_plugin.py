"""The pytest plugin that loads this package into vLLM's own test suite
(tests/vllm_suite).

Its counts are only "plugin loaded" counts if a test that ran without the plugin in
place fails: here a test removes our connector from vLLM's registry and must be reported
failed, while its neighbour, which leaves vLLM alone, passes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vllm_cpu_offload.config import CONNECTOR_NAME

SUITE = """
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from vllm_cpu_offload.config import CONNECTOR_NAME


def test_leaves_vllm_alone():
    assert CONNECTOR_NAME in KVConnectorFactory._registry


def test_removes_our_connector():
    KVConnectorFactory._registry.pop(CONNECTOR_NAME)
"""


def test_a_test_after_which_the_plugin_is_gone_fails(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider"]
        + ["-p", "vllm_cpu_offload.testing.vllm_suite_plugin", "test_suite.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "PASSED test_suite.py::test_leaves_vllm_alone" in out, out
    assert "ERROR test_suite.py::test_removes_our_connector" in out, out
    assert f"vllm_cpu_offload is no longer in place: {CONNECTOR_NAME} in" in out, out
