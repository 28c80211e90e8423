"""docs/design.md's module table names every module of the package, and only those."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "vllm_cpu_offload"


def _modules_in_table() -> set[str]:
    text = (REPO / "docs/design.md").read_text()
    table = text.split("| module | process | role |", 1)[1].split("\n\n", 1)[0]
    named: set[str] = set()
    for row in table.splitlines()[2:]:
        directory = ""
        for token in re.findall(r"`([\w/.]+)`", row):
            if token.endswith("/"):
                directory = token
            elif token.endswith(".py"):
                if "/" in token:
                    directory = token.rsplit("/", 1)[0] + "/"
                    named.add(token)
                else:
                    named.add(directory + token)
    return named


def _modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        # An empty __init__.py only marks a package.
        if path.name != "__init__.py" or path.read_text().strip():
            found.add(rel)
    return found


def test_the_module_table_names_every_module_and_only_those() -> None:
    named = _modules_in_table()
    assert _modules() - named == set(), "modules missing from docs/design.md"
    # The import hook lives beside the package.
    gone = {m for m in named if not (PACKAGE / m).exists() and not (REPO / m).exists()}
    assert gone == set(), "docs/design.md names modules that do not exist"
