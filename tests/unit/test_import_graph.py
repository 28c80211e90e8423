"""The package's modules import each other as a tree: no circle, function-level imports
included.

A circle hides behind an import moved into a function; this reads every import
statement of every module, wherever it stands, so such an import counts as well. Only
the imports of `if TYPE_CHECKING:` blocks are left out: they never run.
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
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
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


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those of `if TYPE_CHECKING:` blocks."""
    nodes: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


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
    seen: set[str] = set()
    todo = [start]
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


# What the connector stands on: a host tier with LRU eviction, the CPU copier and the
# counters of its statistics. Every other module is a layer, a copier or a policy
# that plugs into the core's seams by name (`layers.LAYERS`,
# `copiers/select.CUDA_COPIERS`, `policies/registry.BUILTIN_POLICIES`).
CORE = {
    f"{NAME}.{m}"
    for m in (
        "block_transfer",
        "config",
        "connector",
        "context_parallel",
        "errors",
        "layers",
        "metadata",
        "spec",
        "user_classes",
        "scheduler",
        "scheduler.block_pool",
        "scheduler.kv_groups",
        "scheduler.load_planning",
        "scheduler.manager",
        "scheduler.policies",
        "scheduler.policies.base",
        "scheduler.policies.lru",
        "scheduler.policies.registry",
        "scheduler.pool_events",
        "scheduler.pool_invariants",  # the pool's own check, split out for length
        "scheduler.request_state",
        "scheduler.stored_blocks",
        "scheduler.tier_scheduler",
        "scheduler.tier_seams",
        "scheduler.tier_stats",
        "worker",
        "worker.copiers",
        "worker.copiers.base",
        "worker.copiers.copy_threads",
        "worker.copiers.device_streams",
        "worker.copiers.select",
        "worker.copiers.torch_views",
        "worker.host_buffer",
        "worker.kv_layout",
        "worker.tier_seams",
        "worker.tier_worker",
        "worker.transfer_engine",
        "worker.transfer_jobs",
    )
}


def _plugged_in_by_name() -> set[str]:
    from vllm_cpu_offload.layers import LAYERS
    from vllm_cpu_offload.scheduler.policies.registry import BUILTIN_POLICIES
    from vllm_cpu_offload.worker.copiers.select import CUDA_COPIERS

    tables = [*BUILTIN_POLICIES.values(), *CUDA_COPIERS.values(), *LAYERS]
    return {path.partition(":")[0] for path in tables}


def _imported_with_parents(start: str, graph: dict[str, set[str]]) -> set[str]:
    """What importing `start` runs: the modules it reaches and, as Python imports
    a module's packages first, every package on the way and what those import."""
    seen, todo = {start}, [start]
    while todo:
        name = todo.pop()
        parents = {name.rsplit(".", i)[0] for i in range(1, name.count("."))}
        for m in (graph[name] | parents) & set(graph) - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_the_core_imports_none_of_the_layers() -> None:
    graph = _graph()
    core = _imported_with_parents(f"{NAME}.connector", graph)
    assert core == CORE, "the core changed: a layer belongs behind a seam"
    by_name = _plugged_in_by_name()
    assert by_name <= set(graph) and len(by_name) >= 12
    # Each layer, copier and policy is reached by name only (LRU, the default when
    # no policy is named, is the one policy of the core).
    assert core & by_name == {f"{POLICIES}.lru"}
    # Everything the layers bring is outside the core, and the layers are most of
    # the package.
    brought = set().union(*(_reachable(m, graph) | {m} for m in by_name)) - core
    assert len(brought) > 30
    assert not any(m.startswith((f"{NAME}.persist", f"{NAME}.remote")) for m in core)
