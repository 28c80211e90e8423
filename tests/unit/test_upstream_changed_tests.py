"""The upstream stage runs the tests a patch brings: its new test files whole, and in
vLLM's test files only the test functions and classes it adds or changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from upstream_changed_tests import changed_tests  # noqa: E402

EXISTING = """\
import pytest


def helper():
    return 1


def test_untouched():
    assert helper() == 1


@pytest.mark.parametrize("n", [1, 2])
def test_decorated(n):
    assert n


class TestGroup:
    def test_inside(self):
        assert True
"""


def _git(tree: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
    )


def _commit(tree: Path, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", message)


def test_a_patch_brings_its_new_files_and_the_tests_it_touches(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    _commit(
        tmp_path,
        {"tests/v1/test_old.py": EXISTING, "vllm/mod.py": "X = 1\n"},
        "base",
    )
    changed = EXISTING.replace("[1, 2])", "[1, 2, 3])").replace(
        "        assert True", "        assert 1 + 1 == 2"
    )
    changed += "\n\ndef test_added():\n    assert True\n"
    _commit(
        tmp_path,
        {
            "tests/v1/test_old.py": changed,
            "tests/v1/test_new.py": "def test_a():\n    pass\n",
            "tests/v1/conftest.py": "X = 2\n",
            "vllm/mod.py": "X = 2\n",
        },
        "patch",
    )

    assert sorted(changed_tests(tmp_path)) == [
        "tests/v1/test_new.py",
        "tests/v1/test_old.py::TestGroup",
        "tests/v1/test_old.py::test_added",
        "tests/v1/test_old.py::test_decorated",
    ]


def test_a_patch_of_code_alone_brings_no_tests(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    _commit(tmp_path, {"tests/test_x.py": EXISTING, "vllm/a.py": "A = 1\n"}, "base")
    _commit(tmp_path, {"vllm/a.py": "A = 2\n"}, "patch")

    assert changed_tests(tmp_path) == []
