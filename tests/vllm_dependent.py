"""Which test files can give another result on another vLLM: those whose code reaches
vLLM.

CI runs this repository's tests on vLLM 0.32 and again on vLLM 0.33
(scripts/test_vllm033.sh). A test of the block pool, a policy or a copier runs the same
code on the same torch under either, so the second run proves nothing the first did
not. `reaches_vllm(path)` follows a test file's imports through this repository (every
import statement of every module, those inside functions too, the conftest.py files
above it, and strings that name a module of this repository or import vLLM, as a
subprocess's code does) and says whether any of them is vLLM's. Importing the package
itself applies the plugin to vLLM, whatever the test is about: `vllm_cpu_offload`'s own
`__init__` is not followed. The answer errs towards True.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = ("vllm_cpu_offload", "tests", "benchmarks")
# The benchmarks put their folder first on sys.path and import each other by bare
# name (`import trace_replay`), and so do the tests of them.
BENCHMARKS = REPO / "benchmarks"
# "from vllm...", "import vllm" in code that a test runs in a subprocess.
VLLM_IN_CODE = re.compile(r"\b(?:from|import)\s+vllm\b(?!_)")
# A dotted module path of this repository in a string: "tests.external_policy.fifo:X",
# "python -m tests.e2e.long_document_run", "py://vllm_cpu_offload.testing...".
OUR_MODULE_IN_TEXT = re.compile(r"\b(?:vllm_cpu_offload|tests|benchmarks)(?:\.\w+)+")
PACKAGE_INIT = REPO / "vllm_cpu_offload" / "__init__.py"


def module_file(name: str) -> Path | None:
    """The file of module `name` of this repository, or None (another package, or an
    attribute rather than a module)."""
    parts = name.split(".")
    if parts[0] not in OURS:
        bare = BENCHMARKS / f"{parts[0]}.py"
        return bare if bare.is_file() and len(parts) <= 2 else None
    base = REPO.joinpath(*parts)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _package_of(path: Path) -> list[str]:
    rel = path.relative_to(REPO).with_suffix("").parts
    return list(rel[:-1])


def imported_names(path: Path) -> set[str]:
    """Every module name `path` imports (at any depth of its code) or names in a
    string, and its parent packages."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_of(path)[: len(_package_of(path)) - node.level + 1]
                base = ".".join([*package, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if VLLM_IN_CODE.search(node.value):
                names.add("vllm")
            names.update(OUR_MODULE_IN_TEXT.findall(node.value))
    parents = {
        ".".join(name.split(".")[:i])
        for name in names
        for i in range(1, name.count(".") + 1)
    }
    return names | parents


@functools.cache
def _names(path: Path) -> frozenset[str]:
    return frozenset(imported_names(path))


def _imports_vllm(path: Path) -> bool:
    return any(n == "vllm" or n.startswith("vllm.") for n in _names(path))


def _closure(start: list[Path]) -> set[Path]:
    """The files of this repository that `start` import, directly or not."""
    seen, todo = set(start), list(start)
    while todo:
        for name in _names(todo.pop()):
            found = module_file(name)
            if found is not None and found != PACKAGE_INIT and found not in seen:
                seen.add(found)
                todo.append(found)
    return seen


def reaches_vllm(test_file: Path) -> bool:
    """Whether `test_file`, or a conftest.py above it in this repository, reaches
    vLLM."""
    test_file = test_file.resolve()
    conftests = [
        folder / "conftest.py"
        for folder in test_file.parents
        if folder == REPO or REPO in folder.parents
    ]
    start = [f for f in [test_file, *conftests] if f.is_file()]
    return any(_imports_vllm(f) for f in _closure(start))


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:] or ["tests"]:
        root = Path(arg)
        files = sorted(root.rglob("test_*.py")) if root.is_dir() else [root]
        for f in files:
            print(f"{'vllm' if reaches_vllm(f) else 'same':5} {f}")
