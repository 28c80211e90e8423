# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the CPUOffloadConnector tests: a small generated model and vLLM's
connector test helpers."""

import os
from types import ModuleType

import pytest

# The CPU backend otherwise sizes its KV cache from most of a NUMA node.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device")


@pytest.fixture()
def should_do_global_cleanup_after_test(request) -> bool:
    """No global cleanup after these tests: they hold no process group or device memory
    (the engine test shuts its engine down itself), and the cleanup would cost seconds
    per test on a CPU-only machine."""
    return False


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """A Llama-style model written locally in seconds: KV reuse does not depend on the
    weights, and the engine tests then need no download."""
    from tests.v1.kv_connector.cpu_offload.tiny_model import ensure_tiny_llama

    return str(ensure_tiny_llama())


@pytest.fixture(scope="module")
def vllm_utils() -> ModuleType:
    """The connector test helpers of vLLM (tests/v1/kv_connector/unit/utils.py)."""
    from tests.v1.kv_connector.unit import utils

    return utils
