"""A pytest plugin (`-p outcome_log`) that writes every test's outcome as JSON lines.

The runner reads these instead of junit XML, whose class names cannot be turned back
into node ids that pytest accepts on its command line. It imports neither vLLM nor this
package, so it is the same in a plain run and in a run with the plugin loaded.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_PATH = os.environ.get("VLLM_SUITE_OUTCOMES", "")


def _write(record: dict[str, Any]) -> None:
    # Under pytest-xdist the controller sees every worker's reports; only it writes.
    if _PATH and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(_PATH, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # One record per test: the call phase, or setup when it failed or skipped, or
    # a teardown error.
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome: str = report.outcome
        if report.when == "setup" and report.failed:
            outcome = "error"
        elif hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        _write({"nodeid": report.nodeid, "outcome": outcome})
    elif report.when == "teardown" and report.failed:
        _write({"nodeid": report.nodeid, "outcome": "error"})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write({"nodeid": report.nodeid, "outcome": "collection error"})
