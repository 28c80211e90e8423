"""The package's modules import each other as a tree: no circle, function-level imports
included.

A circle hides behind an import moved into a function; this reads every import
statement of every module, wherever it stands, so such an import counts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_cpu_offload

PACKAGE = Path(vllm_cpu_offload.__file__).parent
NAME = "vllm_cpu_offload"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith(NAME):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in modules else source)
    found.discard(name)
    return {m for m in found if m in modules}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_package_imports_form_no_circle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and sum(len(e) for e in graph.values()) > 60
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


POLICIES = f"{NAME}.scheduler.policies"


def test_the_policies_package_imports_no_policy_but_lru() -> None:
    # The other built-ins are a module and a registry line each, loaded by name.
    from vllm_cpu_offload.scheduler.policies.registry import BUILTIN_POLICIES

    graph = _graph()
    on_demand = {path.partition(":")[0] for path in BUILTIN_POLICIES.values()}
    assert on_demand <= set(graph) and len(on_demand) == 5
    reached = _reachable(POLICIES, graph)
    assert f"{POLICIES}.lru" in reached
    assert reached & on_demand == {f"{POLICIES}.lru"}


def test_the_package_imports_nothing_of_its_tests() -> None:
    # Test-only code (the fault injector) lives in tests/ and plugs into seams.
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert not (node.module or "").startswith("tests"), name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("tests") for a in node.names), name
