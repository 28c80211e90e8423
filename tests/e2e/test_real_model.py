"""A trained model (SmolLM2-135M-Instruct) reading real documents (the Python
reference): host hits give the tokens vLLM's own device hits give.

On the real model vLLM's device hits and a recompute of the same prompt need not agree
in bf16 (the prefill's numerics differ from a decode-shaped read), so the reference is
an engine whose device cache keeps every document: its re-reads are device hits. The
tier's engine has a device cache too small for them, so its re-reads are host hits.
The dtype is the one this CPU runs fast (tests/conftest.py `fast_dtype`): bf16 with
AMX or AVX512-BF16, fp32 on an AVX2-only CPU, where bf16 is about 100x slower; the test
of the other dtype is skipped and says why.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import long_documents

pytestmark = pytest.mark.e2e

DOCS = 4
DOC_TOKENS = 300  # of text; the chat template and the question add about 60
# About two documents: each re-read finds its document gone from the device cache.
SMALL_DEVICE_BLOCKS = 24
LARGE_DEVICE_BLOCKS = 8 * DOCS * (DOC_TOKENS // BLOCK_SIZE)
# A host tier holding every document: a block of the model is 1.5 MB in fp32.
SWAP_SPACE_GIB = 0.25


def _run(model: str, dtype: str, *flags: str) -> dict[str, Any]:
    return long_documents(
        model,
        "--documents", "pydoc", "--docs", str(DOCS), "--doc-tokens", str(DOC_TOKENS),
        "--dtype", dtype, "--max-tokens", "24", *flags,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(smollm2: tuple[str, str]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    model, dtype = smollm2
    device_hits = _run(model, dtype, "--device-blocks", str(LARGE_DEVICE_BLOCKS))
    host_hits = _run(
        model,
        dtype,
        "--device-blocks",
        str(SMALL_DEVICE_BLOCKS),
        "--offload",
        "--swap-space",
        str(SWAP_SPACE_GIB),
        "--metrics",
    )
    return dtype, device_hits, host_hits


def _check(runs: tuple[str, dict[str, Any], dict[str, Any]], dtype: str) -> None:
    ran, device_hits, host_hits = runs
    if ran != dtype:
        pytest.skip(f"this CPU runs {ran} fast; {dtype} is the other machines' test")
    device, host = device_hits["requests"], host_hits["requests"]
    # Every re-read hit its document's full blocks: on the device in the reference,
    # from host memory with the flag (its device cache kept none of them). The prompts
    # end inside a block (long_document_run.py), so both compute the same tail.
    for ref, got in zip(device[DOCS:], host[DOCS:], strict=True):
        full = ref["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE
        assert got["cached"] == ref["cached"] == full >= 5 * BLOCK_SIZE, (ref, got)
    assert host_hits["metrics"].get("vllm:cpu_offload_hit_tokens") == sum(
        r["cached"] for r in host[DOCS:]
    )
    assert [r["tokens"] for r in host] == [r["tokens"] for r in device]
    # A trained model answers in words about the document (a random one would not).
    answers = [r["text"] for r in host[DOCS:]]
    assert all(any(c.isalpha() for c in a) for a in answers), answers
    print(f"\n{dtype}: answers from host hits, equal to device hits: {answers}")


def test_bf16_host_hits_give_the_device_hits_tokens(
    runs: tuple[str, dict[str, Any], dict[str, Any]],
) -> None:
    _check(runs, "bfloat16")


def test_fp32_host_hits_give_the_device_hits_tokens(
    runs: tuple[str, dict[str, Any], dict[str, Any]],
) -> None:
    _check(runs, "float32")
