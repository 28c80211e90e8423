"""A pytest plugin (`-p cleanup_marks`) that spares vLLM's unit tests the clean-up of a
test that started an engine.

vLLM's conftest (tests/conftest.py:265-279 in 0.32.0) tears the distributed environment
down and runs a full `gc.collect()` after every test unless it carries the
`skip_global_cleanup` marker, which vLLM puts on unit tests that start no engine. Most
of the suite's tests do not carry it, and on two cores the clean-up was most of their
time (in the upstream stage, 2,381 of 2,800 s). This marks every test of a module that
starts nothing the clean-up takes down: a module whose source names no engine
(`LLM(`, `vllm_runner`) and no distributed set-up (`dist_init`,
`init_distributed_environment`) keeps vLLM's clean-up for none of its tests; any other
module keeps it for all of its tests. It imports neither vLLM nor this package.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

STARTS = ("LLM(", "vllm_runner", "dist_init", "init_distributed_environment")


@functools.cache
def _starts_something(module: Path) -> bool:
    try:
        source = module.read_text()
    except OSError:
        return True
    return any(name in source for name in STARTS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not _starts_something(Path(item.path)):
            item.add_marker(pytest.mark.skip_global_cleanup)
