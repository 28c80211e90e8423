"""A pytest plugin for vLLM's offloading unit tests in the upstream stage.

vLLM's conftest tears down the distributed environment and runs a full `gc.collect()`
after every test unless the test carries its `skip_global_cleanup` marker, which vLLM
puts on unit tests that start no engine ("a ~10x speedup for non-GPU unit tests", its
conftest says). vLLM's offloading unit tests do not carry it, and on a 2-core machine
the clean-up was 2,381 of the 2,800 s their 1,520 tests took. This marks every test the
stage runs as vLLM's unit tests, except those using `dist_init` (they set up a
distributed environment the clean-up takes down). The series' end-to-end tests, which
start engines, run apart, without this plugin.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "dist_init" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip_global_cleanup)
