"""The simulation in CI: a bounded set of seeds at TP 1, 2 and 4 (more with
`python -m tests.simulation --seeds N --steps M --tp K`)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.simulation.runner import run_seeds  # noqa: E402

CI_SEEDS = range(6)
CI_STEPS = 120


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_no_seed_breaks_an_invariant(tp: int) -> None:
    # Every seed: faults, late completions, aborts and preemptions, checked by the
    # content oracle and the bookkeeping invariants; a failure names its replay.
    failures = run_seeds(list(CI_SEEDS), CI_STEPS, [tp], log=lambda line: None)
    assert not failures, "\n".join(failures)
