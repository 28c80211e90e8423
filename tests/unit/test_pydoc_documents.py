"""Documents cut from the Python reference: within their budget, each its own text,
and a request for more than the reference holds is refused with the fix."""

from __future__ import annotations

import pytest

from vllm_cpu_offload.testing.pydoc_documents import documents, prompt_token_ids


@pytest.fixture(scope="module")
def tokenizer(smollm2: tuple[str, str]):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2[0])


def test_documents_fit_their_budget_and_differ(tokenizer) -> None:  # type: ignore[no-untyped-def]
    docs = documents(tokenizer, 40, 600)
    lengths = [len(tokenizer.encode(d.text, add_special_tokens=False)) for d in docs]
    assert max(lengths) <= 600 and min(lengths) > 300, lengths
    assert len({d.text for d in docs}) == len(docs)
    assert all(d.title and f'"{d.title}"' in d.question for d in docs)
    prompt = prompt_token_ids(tokenizer, docs[0])
    text = tokenizer.decode(prompt)
    assert docs[0].question in text and text.rstrip().endswith("assistant")


def test_more_documents_than_the_reference_holds_are_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="ask for fewer or shorter documents"):
        documents(tokenizer, 10_000, 1000)
