"""tests/vllm_dependent.py: which test files the vLLM 0.33 stage runs again. A test
that reaches vLLM only through a benchmark imported by bare name (the benchmarks put
their folder on sys.path) must be found, or the second vLLM never runs it."""

from __future__ import annotations

from pathlib import Path

from tests.vllm_dependent import module_file, reaches_vllm

TESTS = Path(__file__).resolve().parents[1]
BENCHMARKS = TESTS.parent / "benchmarks"


def test_a_benchmark_imported_by_bare_name_is_followed_to_vllm() -> None:
    assert module_file("trace_replay") == BENCHMARKS / "trace_replay.py"
    assert module_file("trace_replay.VllmTier") == BENCHMARKS / "trace_replay.py"
    assert reaches_vllm(TESTS / "unit" / "test_trace_replay_vllm_tier.py")


def test_names_that_are_no_file_of_the_repository_are_not_followed() -> None:
    assert module_file("json") is None
    assert module_file("torch.nn") is None
    assert not reaches_vllm(TESTS / "kernels" / "test_copy_kernels.py")
