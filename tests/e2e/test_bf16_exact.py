"""bf16, one request at a time, the engine as users run it: the flag changes no token
and no core.

Each arm runs `tests/e2e/long_document_run.py` in a fresh process with vLLM's default
multiprocess engine, so vLLM's CPU executor binds the worker's OpenMP threads as it does
for a user; the worker reports its threads and binding from inside.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import assert_exact_with_host_rereads, long_documents

pytestmark = pytest.mark.e2e

# bf16 prefills are what this module costs where bf16 is slow (AVX2-only CPUs). Four
# documents leave none of them in the 24-block device cache (about two documents) when
# it is read again; with three, the first blocks of the first would still be there.
DOC_TOKENS = 300
DOCS = 4


def _run(model: str, *flags: str) -> dict[str, Any]:
    return long_documents(
        model, "--docs", str(DOCS), "--doc-tokens", str(DOC_TOKENS), *flags
    )


@pytest.fixture(scope="module")
def runs(tiny_model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return _run(tiny_model), _run(tiny_model, "--offload")


def test_worker_gets_the_same_openmp_threads_and_binding_with_the_flag(
    runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    # vLLM reserves a core for any KV connector; ours must not change the model's cores.
    without, with_flag = runs
    # The script never imports the package: importing vLLM applied it (the .pth hook).
    assert with_flag["plugin"] == {"at_start": False, "after_vllm": True}
    assert with_flag["worker"] == without["worker"]
    assert with_flag["worker"]["torch_threads"] == int(
        without["worker"]["env"]["OMP_NUM_THREADS"]
    )


def test_bf16_greedy_tokens_equal_without_the_flag_and_rereads_hit_host(
    runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    # Documents read twice; the device cache holds about two, so re-reads
    # come from host.
    without, with_flag = runs
    full_blocks = (DOC_TOKENS - 1) // BLOCK_SIZE
    assert_exact_with_host_rereads(without, with_flag, DOCS, full_blocks * BLOCK_SIZE)


def test_host_blocks_of_two_device_blocks_give_the_same_tokens(
    tiny_model: str, runs: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    # offload_block_size of two device blocks: fewer, larger host blocks. Re-reads load
    # whole host blocks (8 of a document's 9 full device blocks); tokens stay the same.
    without, _ = runs
    pairs = _run(tiny_model, "--offload", "--offload-block-size", str(2 * BLOCK_SIZE))
    full_blocks = (DOC_TOKENS - 1) // BLOCK_SIZE
    assert_exact_with_host_rereads(
        without, pairs, DOCS, full_blocks // 2 * 2 * BLOCK_SIZE
    )
