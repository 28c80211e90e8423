"""The source distribution (its tests/ and benchmarks/) of the installed vLLM, fetched
once per session."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_sdist() -> Path:
    import vllm

    version = vllm.__version__.split("+")[0]
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch_vllm_sdist.sh"), version],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"fetching vLLM's source distribution failed: {proc.stderr}"
    )
    return Path(proc.stdout.strip())
