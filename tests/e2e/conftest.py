"""Engines for the end-to-end tests: real vLLM on the CPU platform, in this process.

The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that tests can
read the connector's scheduler and worker halves directly; one engine per module keeps
the suite inside CI's budget. The device KV cache is made small
(num_gpu_blocks_override) so that blocks are evicted from it and must come back from
host memory.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from tests.conftest import BLOCK_SIZE  # noqa: E402
from vllm_cpu_offload.testing.store_servers import (  # noqa: E402
    MooncakeServers,
    ServerUnavailable,
)

DEVICE_BLOCKS = 24  # 768 tokens of device KV cache
HOST_GIB = 0.01  # 163 blocks of the tiny model (64 KiB each)
MAX_MODEL_LEN = 512


def script_result(module: str, *args: str, env: dict[str, str], timeout: float) -> Any:
    """Runs `python -m module args` in a fresh process; returns the JSON of its RESULT
    line."""
    return script_output(module, *args, env=env, timeout=timeout)[0]


def script_output(
    module: str, *args: str, env: dict[str, str], timeout: float
) -> tuple[Any, str]:
    """Runs `python -m module args` in a fresh process; returns the JSON of its RESULT
    line and its output (stdout, where vLLM logs, then stderr): the engine's log."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), proc.stdout + proc.stderr


def long_documents(model: str, *args: str) -> dict[str, Any]:
    """Runs tests/e2e/long_document_run.py in a fresh process, the engine as users run
    it.

    vLLM's default multiprocess engine, with vLLM's own binding of the worker's cores in
    every arm (no core variables of this environment are passed on).
    """
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    for name in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND"):
        env.pop(name, None)
    return dict(
        script_result("tests.e2e.long_document_run", model, *args, env=env, timeout=400)
    )


def assert_exact_with_host_rereads(
    without: dict[str, Any],
    with_flag: dict[str, Any],
    docs: int,
    min_cached_tokens: int,
) -> None:
    """Same greedy tokens in both runs; the second read of each document hit at least
    `min_cached_tokens` with the flag and nothing without it (the device cache is too
    small to keep them), so what it hit came from host memory."""
    assert [r["tokens"] for r in with_flag["requests"]] == [
        r["tokens"] for r in without["requests"]
    ]
    rereads = with_flag["requests"][docs:]
    assert all(r["cached"] >= min_cached_tokens for r in rereads), rereads
    assert all(r["cached"] == 0 for r in without["requests"][docs:])


def make_llm(model: str, offload: bool, **overrides: Any) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=DEVICE_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        # bf16 is what users run, and test_bf16_exact runs it. Here fp32: nothing these
        # tests check depends on the dtype, batched and solo greedy outputs agree in it
        # (not in bf16: test_offload_engine), and AVX2-only CPUs run bf16 ~100x slower.
        dtype="float32",
        seed=0,
    )
    if offload:
        kwargs |= dict(enable_cpu_offload=True, swap_space=HOST_GIB)
    kwargs |= overrides
    return LLM(model, **kwargs)


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def scheduler_connector(llm: Any) -> Any:
    """The scheduler half of our connector inside the in-process engine core."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def worker_connector() -> Any:
    """The worker half (the single CPU worker runs in this process too)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


@pytest.fixture(scope="module")
def offload_llm(tiny_model: str) -> Iterator[Any]:
    llm = make_llm(tiny_model, offload=True)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def mooncake() -> Iterator[MooncakeServers]:
    """A Mooncake Store (master and storage node) on loopback for a module's tests."""
    try:
        servers = MooncakeServers().start()
    except ServerUnavailable as e:
        pytest.skip(str(e))
    try:
        yield servers
    finally:
        servers.stop()
