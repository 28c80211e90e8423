"""Shared fixtures: the locally generated model and the engine settings every test
uses."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# The CPU platform otherwise reserves most of a NUMA node for KV and may fail to start.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BLOCK_SIZE = 32  # vLLM's CPU attention wants multiples of 32


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama

    return str(ensure_tiny_llama())


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A redis-server on loopback for the shared tier's tests (its keys are namespaced
    by what the blocks depend on, so tests do not see each other's by accident)."""
    from vllm_cpu_offload.testing.store_servers import RedisServer, ServerUnavailable

    try:
        server = RedisServer().start()
    except ServerUnavailable as e:
        pytest.skip(str(e))
    try:
        yield server.url
    finally:
        server.stop()
