"""Real documents for long-document QA: the Python language reference that ships with
every Python (`pydoc_data.topics`, 79 topics, about 465k characters of English).

The topics are read in name order, each once (some names share one text), as one run
of paragraphs; documents are consecutive paragraphs cut to a token budget. Each
document's question names the section it starts in, and the prompt is the model's
chat template around the document and the question.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Document:
    title: str  # the section the document starts in
    text: str
    question: str


def _paragraphs() -> list[tuple[str, str]]:
    """(section title, paragraph) over every topic, in topic-name order."""
    from pydoc_data.topics import topics

    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for name in sorted(topics):
        text = topics[name]
        if text in seen:
            continue
        seen.add(text)
        title = ""
        for para in text.split("\n\n"):
            para = para.strip("\n")
            lines = para.strip().splitlines()
            if not lines:
                continue
            # A heading is its line over an underline of = * - ~ ^ (reST).
            if len(lines) == 2 and set(lines[1].strip()) <= set("*=-~^"):
                title = lines[0].strip()
            out.append((title, para))
    return out


def documents(tokenizer: Any, count: int, tokens: int) -> list[Document]:
    """`count` documents of at most `tokens` tokens of text each (the prompt around
    one adds its chat template and the question)."""
    docs: list[Document] = []
    title, used = "", 0
    parts: list[str] = []
    for para_title, para in _paragraphs():
        n = len(tokenizer.encode(para, add_special_tokens=False)) + 1
        if not parts:
            title = para_title
        if used + n > tokens and parts:
            docs.append(_document(title, _within(tokenizer, parts, tokens)))
            if len(docs) == count:
                return docs
            title, parts, used = para_title, [], 0
        if n > tokens:  # a paragraph longer than a document: cut to the budget
            ids = tokenizer.encode(para, add_special_tokens=False)[: tokens - 1]
            para, n = tokenizer.decode(ids), tokens
        parts.append(para)
        used += n
    raise ValueError(
        f"the Python reference holds {len(docs)} documents of {tokens} tokens, not "
        f"{count}: ask for fewer or shorter documents"
    )


def _within(tokenizer: Any, parts: list[str], tokens: int) -> str:
    """The paragraphs joined, cut to `tokens` tokens (tokens merge across the joins,
    so the sum of the parts' counts is near, not exact)."""
    text = "\n\n".join(parts)
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) > tokens:
        text = tokenizer.decode(ids[:tokens])
        ids = tokenizer.encode(text, add_special_tokens=False)
        tokens -= 1
    return text


def _document(title: str, text: str) -> Document:
    question = (
        f'According to the passage above, what does the section "{title}" '
        "explain? Answer in one sentence."
    )
    return Document(title=title, text=text, question=question)


def prompt_token_ids(tokenizer: Any, doc: Document) -> list[int]:
    """The chat-formatted prompt of `doc`, ready for generation."""
    messages = [{"role": "user", "content": f"{doc.text}\n\n{doc.question}"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return list(ids)
