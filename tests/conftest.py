"""Shared fixtures: the locally generated model and the engine settings every test
uses."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The CPU platform otherwise reserves most of a NUMA node for KV and may fail to start.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BLOCK_SIZE = 32  # vLLM's CPU attention wants multiples of 32


def _bind_this_workers_engines() -> None:
    """Under pytest-xdist, a core of its own for the model threads of each worker's
    engines.

    vLLM's automatic binding reserves the last core of a small machine for the engine
    core and binds a TP=1 worker's OpenMP threads to the first
    (`vllm/utils/ompmultiprocessing.py:46-54`, `_get_autobind_cpu_ids` :290-297):
    the engines of every worker then compute on core 0 alone while the other waits.
    Each worker's engines get core `i % cores` instead (an explicit list reserves
    none, :152-170). Every engine of one worker has the same binding, so arms
    compared within a test still run alike; tests that set their own binding (TP=2:
    "0|1"), or drop it to check vLLM's own (`long_documents`), keep theirs, and so
    does a user's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])


_bind_this_workers_engines()

# The dtype the real-model tests run (fast_dtype), probed once per run: pytest-xdist's
# workers inherit it from the controller, so every worker collects and runs alike.
FAST_DTYPE_VARIABLE = "VLLM_CPU_OFFLOAD_TEST_DTYPE"


def fast_dtype() -> str:
    """bfloat16 where this CPU multiplies it faster than float32 (AMX, AVX512-BF16),
    float32 where bf16 is slow (AVX2-only CPUs run it about 100x slower)."""
    if FAST_DTYPE_VARIABLE not in os.environ:
        from benchmarks.matmul_rate import choose_dtype, probe

        os.environ[FAST_DTYPE_VARIABLE] = choose_dtype(probe())
    return os.environ[FAST_DTYPE_VARIABLE]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--only-vllm-dependent",
        action="store_true",
        help="collect only the test files whose code reaches vLLM (tests/vllm_dependent"
        ".py): what another vLLM can change; the vLLM 0.33 stage runs with it",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist (-n N), before its workers start: the files that tests of
    # several workers would otherwise write at the same time, made once.
    if getattr(config.option, "numprocesses", None) and not hasattr(
        config, "workerinput"
    ):
        import warnings

        with warnings.catch_warnings():  # torch's and vLLM's, at import, once more
            warnings.simplefilter("ignore", DeprecationWarning)
            _make_shared_files()


def _make_shared_files() -> None:
    """The generated models the tests use, the trained one in the dtype this CPU runs
    fast, and the installed vLLM's source distribution (tests/vllm_helpers)."""
    import dataclasses
    import importlib.metadata
    import subprocess

    from vllm_cpu_offload.testing.real_model import ensure_smollm2
    from vllm_cpu_offload.testing.tiny_model import TEST_SHAPE, ensure_tiny_llama

    ensure_tiny_llama()
    ensure_tiny_llama(dataclasses.replace(TEST_SHAPE, sliding_window=64))
    ensure_smollm2(fast_dtype())
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
        fetch = Path(__file__).resolve().parents[1] / "scripts" / "fetch_vllm_sdist.sh"
        subprocess.run(
            ["bash", str(fetch), version], check=True, capture_output=True, timeout=600
        )
        break


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not config.getoption("--only-vllm-dependent"):
        return None
    name = collection_path.name
    if not (collection_path.suffix == ".py" and name.startswith("test_")):
        return None
    from tests.vllm_dependent import reaches_vllm

    return True if not reaches_vllm(collection_path) else None


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama

    return str(ensure_tiny_llama())


@pytest.fixture(scope="session")
def smollm2() -> tuple[str, str]:
    """The trained model's folder and the dtype it is in (fast_dtype)."""
    from vllm_cpu_offload.testing.real_model import ensure_smollm2

    dtype = fast_dtype()
    return str(ensure_smollm2(dtype)), dtype


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
