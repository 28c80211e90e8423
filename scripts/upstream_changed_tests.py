"""The tests a patch of upstream/ brings: `python upstream_changed_tests.py TREE`.

Prints pytest node ids, one per line, for the commit at TREE's HEAD: every test file the
commit adds, and in a test file it changes, every test function (or test class) whose
lines it adds or changes. A file vLLM already had is not run whole here: its other tests
are vLLM's, which the stage runs apart (scripts/test_upstream.sh).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), *args], capture_output=True, text=True, check=True
    ).stdout


def _is_test_file(path: str) -> bool:
    return path.startswith("tests/") and Path(path).name.startswith("test_")


def _added_lines(tree: Path, path: str) -> set[int]:
    """The line numbers (in the new file) the commit adds or changes."""
    lines: set[int] = set()
    diff = _git(tree, "diff", "--unified=0", "HEAD~1", "HEAD", "--", path)
    for line in diff.splitlines():
        if not line.startswith("@@"):
            continue
        # "@@ -a,b +c,d @@": d lines from c (d omitted means 1)
        new = line.split()[2].lstrip("+")
        start, _, count = new.partition(",")
        lines.update(range(int(start), int(start) + int(count or 1)))
    return lines


def _touched_tests(source: str, lines: set[int]) -> list[str]:
    touched = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        prefix = "Test" if isinstance(node, ast.ClassDef) else "test"
        if not node.name.startswith(prefix):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if lines & set(range(first, (node.end_lineno or node.lineno) + 1)):
            touched.append(node.name)
    return touched


def changed_tests(tree: Path) -> list[str]:
    ids = []
    status = _git(tree, "diff", "--name-status", "HEAD~1", "HEAD")
    for row in status.splitlines():
        kind, path = row.split("\t")[0], row.split("\t")[-1]
        if not (_is_test_file(path) and path.endswith(".py")):
            continue
        if kind.startswith("A"):
            ids.append(path)
        elif kind.startswith(("M", "R")):
            source = (tree / path).read_text()
            touched = _touched_tests(source, _added_lines(tree, path))
            ids.extend(f"{path}::{name}" for name in touched)
    return ids


if __name__ == "__main__":
    print("\n".join(changed_tests(Path(sys.argv[1]))))
