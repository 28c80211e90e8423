"""The long-document benchmark shows the trained model's answers whenever it read real
documents, also when a no-reuse phase follows the re-read (its entry comes last)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.long_document_tables import _print_answers


def _arm(answer: str) -> list[dict[str, Any]]:
    answers = [{"question": "What does the section explain?", "answer": answer}]
    return [
        {"docs": 4, "warmup": {}, "reread": {}, "answers": answers},
        {"docs": 4, "no_reuse": {}},
    ]


def test_answers_are_shown_when_a_no_reuse_entry_follows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pairs = [{"prefix-caching": _arm("Paris."), "cpu-offload": _arm("Paris.")}]
    summary: dict[str, Any] = {"outputs_equal": True}
    _print_answers(pairs, ("prefix-caching", "cpu-offload"), summary)
    assert summary["answers_equal"] and summary["outputs_equal"]
    assert "A: Paris." in capsys.readouterr().out


def test_answers_that_differ_make_the_outputs_unequal() -> None:
    pairs = [{"prefix-caching": _arm("Paris."), "cpu-offload": _arm("Lyon.")}]
    summary: dict[str, Any] = {"outputs_equal": True}
    _print_answers(pairs, ("prefix-caching", "cpu-offload"), summary)
    assert not summary["answers_equal"] and not summary["outputs_equal"]
