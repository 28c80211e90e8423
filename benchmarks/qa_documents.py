"""What benchmarks/long_document_qa.py reads: real documents on the trained model, or
random token ids on the generated one.

Real: SmolLM2-135M-Instruct (vllm_cpu_offload/testing/real_model.py) answering a
question about each of the first N documents cut from the Python reference
(testing/pydoc_documents.py), in its chat template. Random: the generated Llama of the
benchmark's shape reading random words, which costs less per token; outputs carry no
meaning there.
"""

from __future__ import annotations

import random
from typing import Any

from vllm_cpu_offload.testing.tiny_model import TinyLlamaShape, random_token_ids

# SmolLM2-135M-Instruct's shape (its config.json), for the benchmark's sizing only.
REAL_SHAPE = TinyLlamaShape(
    num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, intermediate_size=1536
)
# The chat template and the question around a document's text, at most.
PROMPT_ALLOWANCE = 80
ANSWERED_DOCS = 3
ANSWER_TOKENS = 40


class Documents:
    """The prompts of `source` ("real" or "random") for the model at `model`."""

    def __init__(self, source: str, model: str, doc_tokens: int) -> None:
        self.source, self.doc_tokens = source, doc_tokens
        self._tokenizer: Any = None
        if source == "real":
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(model)

    def prompts(self, n: int, seed: int) -> list[list[int]]:
        """`n` prompts of at most doc_tokens tokens, none sharing a first block."""
        if self.source == "random":
            rng = random.Random(seed)
            return [random_token_ids(rng, self.doc_tokens) for _ in range(n)]
        from vllm_cpu_offload.testing.pydoc_documents import prompt_token_ids

        out = [prompt_token_ids(self._tokenizer, d) for d in self._documents(n)]
        longest = max(map(len, out))
        if longest > self.doc_tokens:
            raise ValueError(
                f"a prompt of {longest} tokens is over --doc-tokens {self.doc_tokens}: "
                "raise PROMPT_ALLOWANCE"
            )
        return out

    def _documents(self, n: int) -> list[Any]:
        from vllm_cpu_offload.testing.pydoc_documents import documents

        return documents(self._tokenizer, n, self.doc_tokens - PROMPT_ALLOWANCE)

    def answers(self, llm: Any) -> list[dict[str, str]]:
        """The model's greedy answers to the first documents' questions (real
        documents only): what a person can check."""
        if self.source != "real":
            return []
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vllm_cpu_offload.testing.pydoc_documents import prompt_token_ids

        params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
        answers = []
        for doc in self._documents(ANSWERED_DOCS):  # one at a time, as the phases
            ids = prompt_token_ids(self._tokenizer, doc)
            prompt = TokensPrompt(prompt_token_ids=ids)
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            answers.append({"question": doc.question, "answer": out.outputs[0].text})
        return answers
