"""vLLM's own long-document benchmark script, run by plain python with the two flags
appended.

The script (benchmarks/benchmark_long_document_qa_throughput.py of vLLM 0.32.0's source
distribution) builds its parser with `EngineArgs.add_cli_args` before vLLM loads plugins
and never imports this package: the flags reach it through the .pth import hook.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

CONNECTOR_LINE = "Creating v1 connector with name: CPUOffloadConnector"


def _run(script: Path, model: str, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS",)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the script runs as users run it
    cmd = [
        sys.executable, str(script),
        "--model", model,
        "--num-documents", "4", "--document-length", "200", "--output-len", "2",
        "--repeat-count", "2", "--repeat-mode", "tile",
        "--block-size", "32", "--num-gpu-blocks-override", "24",
        "--max-model-len", "512",
        "--enforce-eager", "--max-num-seqs", "2",
        *flags,
    ]  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=env, cwd="/"
    )


def test_vllms_long_document_script_takes_the_flags_by_plain_python(
    tiny_model: str, vllm_sdist: Path
) -> None:
    # The flags are appended to vLLM's own script; it runs, and the host
    # tier is engaged.
    script = vllm_sdist / "benchmarks" / "benchmark_long_document_qa_throughput.py"
    with_flags = _run(
        script, tiny_model, "--enable-cpu-offload", "--swap-space", "0.05"
    )
    assert with_flags.returncode == 0, with_flags.stderr[-3000:]
    assert with_flags.stdout.count("Time to execute all requests") == 2
    assert CONNECTOR_LINE in with_flags.stdout + with_flags.stderr
    without = _run(script, tiny_model)
    assert without.returncode == 0, without.stderr[-3000:]
    assert CONNECTOR_LINE not in without.stdout + without.stderr
