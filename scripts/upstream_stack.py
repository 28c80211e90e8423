"""The stack of upstream/: which patch carries which module, test and docs section.

upstream/stack.toml lists the patches in the order a vLLM reviewer takes them and the
package modules each introduces. This module reads it and derives the rest from the
package and its tests:

- every shipped module is in exactly one patch (an unassigned or twice-assigned module
  is an error naming it);
- every import of a patch's modules (AST, imports inside functions too, and module
  names written as strings, as registries do) resolves to modules of the same patch or
  an earlier one: each prefix of the stack imports;
- each test file goes to the first patch whose modules cover what it imports, directly
  or through other test files, relative imports (`from .conftest import ...`) included
  (stack.toml may pin a test to a later patch); a helper goes with the first test that
  uses it, a conftest.py with the first test of its folder, and what a conftest.py
  imports at its top no later than it;
- registration tables (files listing modules by name) keep, at each prefix, only the
  lines whose modules exist, so each module's patch adds its line; `until` rules give a
  line its text before the patch that changes it (the default eviction policy);
- the docs page is assembled from the sections each patch names, and
  `.buildkite/test_areas/kv_cpu_offload.yaml` lists the test files of the prefix.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vllm_cpu_offload"
UPSTREAM = REPO / "upstream"
TEMPLATES = UPSTREAM / "templates"
MANIFEST = UPSTREAM / "stack.toml"
PKG = "vllm_cpu_offload"

IN_TREE = "vllm/distributed/kv_transfer/kv_connector/v1/cpu_offload"
IN_TREE_MOD = IN_TREE.replace("/", ".")
TESTS = "tests/v1/kv_connector/cpu_offload"
TESTS_MOD = TESTS.replace("/", ".")
DOCS_PAGE = "docs/features/cpu_offload_connector.md"
BUILDKITE = ".buildkite/test_areas/kv_cpu_offload.yaml"

# Package modules that only exist to patch vLLM from outside: in tree they are real code
# in vLLM's own files (EngineArgs, KVConnectorFactory, the CPU executor) or not needed
# at all.
PLUGIN_ONLY = {"__init__.py", "plugin.py", "flags.py", "omp_cores.py", "testing"}
# Modules the plugin keeps and the stack leaves out: they duplicate what vLLM has or
# bring nothing measured over what the stack ships (upstream/RFC.md, "Overlaps"). A
# registration line naming one is left out of every prefix.
PLUGIN_KEPT = {
    "scheduler/policies/arc.py",
    "scheduler/policies/lirs.py",
    "scheduler/policies/s3fifo.py",
}
# flags.py becomes the in-tree flags.py in the patch with the engine_args stage.
FLAGS = "flags.py"
STAGES = ("factory", "engine_args", "omp_cores")

# The bar of the stack (upstream/README.md).
MIN_PATCHES = 10
MAX_CODE_LINES = 800
MAX_MEDIAN_CODE_LINES = 500


class StackError(Exception):
    """The manifest and the package disagree; the message names what to fix."""


# ---------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class Until:
    """`file` reads `old` where it has `new` until `module` is in the prefix."""

    file: str
    old: str
    new: str
    module: str


@dataclass
class PatchSpec:
    title: str
    purpose: str
    test_plan: str
    patterns: list[str]
    stages: list[str]
    docs: list[str]
    pinned_tests: list[str]
    e2e: list[str]
    modules: list[str] = field(default_factory=list)  # resolved, package-relative


@dataclass
class Manifest:
    patches: list[PatchSpec]
    tables: list[str]
    untils: list[Until]
    allowed_refs: set[tuple[str, str]] = field(default_factory=set)


def shipped_modules() -> list[str]:
    """Package-relative paths of every file the stack ships."""
    found = []
    for path in sorted(PACKAGE.rglob("*")):
        rel = path.relative_to(PACKAGE)
        if path.is_dir() or rel.parts[0] in PLUGIN_ONLY or "__pycache__" in rel.parts:
            continue
        if rel.as_posix() in PLUGIN_KEPT:
            continue
        if path.suffix == ".pyc":
            continue
        found.append(rel.as_posix())
    return found


def load_manifest(path: Path = MANIFEST) -> Manifest:
    data = tomllib.loads(path.read_text())
    patches = []
    for i, p in enumerate(data["patch"], 1):
        unknown = set(p.get("stages", ())) - set(STAGES)
        if unknown:
            raise StackError(
                f"patch {i}: unknown stages {sorted(unknown)}; know {STAGES}"
            )
        patches.append(
            PatchSpec(
                title=p["title"],
                purpose=p["purpose"].strip(),
                test_plan=p["test_plan"].strip(),
                patterns=list(p.get("modules", ())),
                stages=list(p.get("stages", ())),
                docs=list(p.get("docs", ())),
                pinned_tests=list(p.get("tests", ())),
                e2e=list(p.get("e2e", ())),
            )
        )
    untils = [Until(**u) for u in data.get("until", ())]
    allowed = {
        tuple(part.strip() for part in ref.split("->"))
        for ref in data.get("allowed_refs", ())
    }
    manifest = Manifest(
        patches,
        list(data.get("registration_tables", ())),
        untils,
        allowed,  # type: ignore[arg-type]
    )
    assign_modules(manifest)
    return manifest


def assign_modules(manifest: Manifest) -> list[str]:
    """Resolves each patch's module patterns; every shipped module exactly once.
    Returns the patterns that match nothing (modules not in the package yet)."""
    modules = shipped_modules()
    owner: dict[str, int] = {}
    unmatched = []
    for i, patch in enumerate(manifest.patches):
        for pattern in patch.patterns:
            hits = [m for m in modules if fnmatch.fnmatchcase(m, pattern)]
            if not hits:
                unmatched.append(pattern)
            for m in hits:
                if m in owner:
                    raise StackError(
                        f"{m} is in patch {owner[m] + 1} and patch {i + 1} "
                        f"({pattern!r}): a module belongs to one patch"
                    )
                owner[m] = i
                patch.modules.append(m)
    missing = [m for m in modules if m not in owner]
    if missing:
        raise StackError(
            "modules in no patch of upstream/stack.toml: "
            + ", ".join(missing)
            + "; add each to the patch that introduces it"
        )
    return unmatched


def patch_of(manifest: Manifest) -> dict[str, int]:
    """Module (package-relative path, and the pseudo-module flags.py) -> patch index."""
    index = {m: i for i, p in enumerate(manifest.patches) for m in p.modules}
    for i, p in enumerate(manifest.patches):
        if "engine_args" in p.stages:
            index[FLAGS] = i
    return index


# ------------------------------------------------------------------------- import graph


@dataclass(frozen=True)
class Ref:
    """A reference of a file to a module: an import, or a module name in a string."""

    line: int
    target: str  # package-relative path of the module
    is_string: bool


def module_path(dotted: str, known: Iterable[str]) -> str | None:
    """The package-relative file of package-relative dotted name `dotted`, if any."""
    known = set(known)
    base = dotted.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if candidate in known:
            return candidate
    return None


def package_of(rel: str) -> list[str]:
    """The dotted package (package-relative parts) a module's relative imports start
    from."""
    parts = rel.removesuffix(".py").split("/")
    return parts[:-1]


_STRING_REF = re.compile(r"^(?P<mod>[A-Za-z_][\w.]*?)(?::\w+)?$")


def refs_of(text: str, rel: str, known: Iterable[str], root: str = PKG) -> list[Ref]:
    """Every reference of the module `rel` (text `text`) to modules of `root` (the
    package, or the in-tree module path for in-tree files)."""
    known = set(known)
    tree = ast.parse(text)
    found: list[Ref] = []

    def add(line: int, dotted: str, is_string: bool = False) -> None:
        target = module_path(dotted, known)
        if target is not None and target != rel:
            found.append(Ref(line, target, is_string))

    def strip_root(name: str) -> str | None:
        if name == root:
            return ""
        if name.startswith(root + "."):
            return name[len(root) + 1 :]
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = strip_root(alias.name)
                if name:
                    add(node.lineno, name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of(rel)
                if rel.endswith("__init__.py"):
                    base = rel.split("/")[:-1]
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                stripped = strip_root(node.module or "")
                if stripped is None:
                    continue
                name = stripped
            if name:
                add(node.lineno, name)
            for alias in node.names:
                add(node.lineno, f"{name}.{alias.name}".strip("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _STRING_REF.match(node.value)
            if match:
                name = strip_root(match.group("mod"))
                if name:
                    add(node.lineno, _longest_module(name, known) or name, True)
        elif isinstance(node, ast.JoinedStr) and len(node.values) == 2:
            head, tail = node.values
            if (
                isinstance(head, ast.FormattedValue)
                and isinstance(head.value, ast.Name)
                and head.value.id == "__package__"
                and isinstance(tail, ast.Constant)
                and isinstance(tail.value, str)
            ):
                match = _STRING_REF.match(tail.value.lstrip("."))
                if match and tail.value.startswith("."):
                    base = ".".join(package_of(rel))
                    add(node.lineno, f"{base}.{match.group('mod')}".strip("."), True)
    return found


def _longest_module(dotted: str, known: set[str]) -> str | None:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if module_path(name, known):
            return name
    return None


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    target: str
    patch: int  # where the module is
    target_patch: int | None  # where the target is (None: in no patch)

    def __str__(self) -> str:
        where = (
            f"patch {self.target_patch + 1}"
            if self.target_patch is not None
            else "no patch"
        )
        return (
            f"{self.module}:{self.line} (patch {self.patch + 1}) needs {self.target}, "
            f"which is in {where}"
        )


def prefix_violations(manifest: Manifest) -> list[Violation]:
    """The references of each patch's modules to modules of later patches."""
    index = patch_of(manifest)
    known = set(shipped_modules())
    tables = set(manifest.tables)
    bad = []
    sources = {m: PACKAGE / m for m in index if m.endswith(".py")}
    for rel, path in sorted(sources.items()):
        for ref in refs_of(path.read_text(), rel, known):
            if ref.is_string and (
                rel in tables or (rel, ref.target) in manifest.allowed_refs
            ):
                continue  # the table's line is left out until the module is in
            target_patch = index.get(ref.target)
            if target_patch is None or target_patch > index[rel]:
                bad.append(
                    Violation(rel, ref.line, ref.target, index[rel], target_patch)
                )
    return bad


# -------------------------------------------------------------------------- rendering


def until_text(
    manifest: Manifest, file: str, text: str, prefix: set[str], strict: bool = True
) -> str:
    """`text` of `file` as it reads at the prefix `prefix`."""
    for rule in manifest.untils:
        if rule.file != file or (not strict and rule.new not in text):
            continue
        if rule.new not in text:
            raise StackError(f"{file} no longer reads {rule.new!r}: update stack.toml")
        if rule.module not in prefix:
            text = text.replace(rule.new, rule.old)
    return text


def registration_lines(text: str, rel: str, prefix: set[str]) -> str:
    """A registration table at a prefix: lines naming a module that is not in it left
    out."""
    # Modules the plugin keeps are never in a prefix: their lines go too.
    known = set(shipped_modules()) | PLUGIN_KEPT
    kept = []
    for line in text.splitlines(keepends=True):
        missing = False
        for match in re.finditer(
            rf"{re.escape(PKG)}((?:\.\w+)+)|\{{__package__\}}((?:\.\w+)+)", line
        ):
            if match.group(1):
                dotted = _longest_module(match.group(1)[1:], known)
            else:
                base = ".".join(package_of(rel))
                dotted = _longest_module(f"{base}{match.group(2)}".strip("."), known)
            target = module_path(dotted, known) if dotted else None
            if target is not None and target not in prefix:
                missing = True
        if not missing:
            kept.append(line)
    text = "".join(kept)
    try:
        ast.parse(text)
    except SyntaxError as e:
        raise StackError(
            f"{rel} is a registration table, but leaving out the lines of modules not "
            f"in the prefix breaks it (line {e.lineno}): write one entry per line"
        ) from None
    return text


def module_text(manifest: Manifest, rel: str, prefix: set[str]) -> str:
    """A package module's text at a prefix, before the in-tree rewrite."""
    text = until_text(manifest, rel, (PACKAGE / rel).read_text(), prefix)
    if rel in manifest.tables:
        text = registration_lines(text, rel, prefix)
    return text


def stub_inits(prefix: set[str]) -> dict[str, str]:
    """Packages with a module in the prefix whose `__init__.py` comes later: a stub
    with the first line of its docstring until then."""
    stubs = {}
    for rel in prefix:
        parts = rel.split("/")[:-1]
        for end in range(1, len(parts) + 1):
            init = "/".join(parts[:end]) + "/__init__.py"
            if init in prefix or init in stubs:
                continue
            path = PACKAGE / init
            doc = ""
            if path.exists():
                doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            first = doc.split("\n\n")[0].replace("\n", " ").strip() or "Package."
            stubs[init] = f'"""{first}"""\n'
    return stubs


# ------------------------------------------------------------------------------ docs


def _sections(text: str) -> tuple[str, dict[str, str]]:
    """A markdown text's preamble and its `## ` sections by heading."""
    parts = re.split(r"^## ", text, flags=re.M)
    sections = {}
    for part in parts[1:]:
        heading, _, body = part.partition("\n")
        sections[heading.strip()] = f"## {heading.strip()}\n{body}"
    return parts[0], sections


def doc_sections() -> tuple[str, dict[str, str]]:
    """The docs page's preamble and its sections by key (`page#H`, `design#H`)."""
    preamble, page = _sections((TEMPLATES / DOCS_PAGE).read_text())
    design_text = (REPO / "docs/design.md").read_text()
    design_text = design_text[design_text.index("## One engine step") :]
    # links to the package's other docs dropped
    design_text = re.sub(r"\[([^\]]+)\]\((?!https?:)[^)]*\)", r"\1", design_text)
    _, design = _sections(design_text)
    sections = {f"page#{h}": s for h, s in page.items()}
    sections |= {
        f"design#{h}": re.sub(r"^## ", "### ", s, flags=re.M) for h, s in design.items()
    }
    return preamble, sections


def check_docs(manifest: Manifest) -> None:
    _, sections = doc_sections()
    named = [d for p in manifest.patches for d in p.docs]
    unknown = [d for d in named if d not in sections]
    unassigned = [s for s in sections if s not in named]
    if unknown or unassigned or len(named) != len(set(named)):
        raise StackError(
            f"docs sections: unknown {unknown}, in no patch {unassigned}, "
            f"twice {sorted({d for d in named if named.count(d) > 1})}"
        )


def docs_page(
    manifest: Manifest, upto: int, rewrite: Callable[[str], str]
) -> str | None:
    keys = {d for p in manifest.patches[: upto + 1] for d in p.docs}
    if not keys:
        return None
    preamble, sections = doc_sections()
    page = [preamble.rstrip("\n") + "\n"]
    design = [s for k, s in sections.items() if k in keys and k.startswith("design#")]
    page += [
        s.rstrip("\n") + "\n"
        for k, s in sections.items()
        if k in keys and k.startswith("page#")
    ]
    if design:
        page.append("## Design\n")
        page += [s.rstrip("\n") + "\n" for s in design]
    prefix = {m for p in manifest.patches[: upto + 1] for m in p.modules}
    text = until_text(manifest, DOCS_PAGE, "\n".join(page), prefix, strict=False)
    return rewrite(text)


# ----------------------------------------------------------------------------- tests


@dataclass
class TestUnit:
    """A file of the in-tree test folder: its path there and its in-tree text."""

    name: str  # relative to TESTS
    text: str
    patch: int = -1

    @property
    def is_test(self) -> bool:
        return Path(self.name).name.startswith("test_")


def in_tree_refs(
    unit: TestUnit, known: set[str], names: set[str]
) -> tuple[set[str], set[str]]:
    """The package modules (package-relative) and the test units a unit imports or
    names in a string."""
    modules: set[str] = set()
    units: set[str] = set()
    for match in re.finditer(rf"{re.escape(IN_TREE_MOD)}((?:\.\w+)+)", unit.text):
        dotted = _longest_module(match.group(1)[1:], known)
        if dotted:
            modules.add(module_path(dotted, known) or "")
        elif match.group(1) == ".flags" or match.group(1).startswith(".flags."):
            modules.add(FLAGS)
    for match in re.finditer(rf"{re.escape(TESTS_MOD)}((?:\.\w+)+)", unit.text):
        base = match.group(1)[1:].replace(".", "/")
        parts = base.split("/")
        for end in range(len(parts), 0, -1):
            stem = "/".join(parts[:end])
            for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
                if candidate in names and candidate != unit.name:
                    units.add(candidate)
                    break
            else:
                continue
            break
    tree = ast.parse(unit.text)
    # `from .conftest import ...`: a unit of the same folder (or one above it, within
    # the test folder)
    folder = list(Path(unit.name).parent.parts)
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        if node.level - 1 > len(folder):
            continue  # a package of vLLM's tests, above ours
        base = folder[: len(folder) - (node.level - 1)]
        imported = base + (node.module.split(".") if node.module else [])
        for path in [imported] + [imported + [alias.name] for alias in node.names]:
            stem = "/".join(path)
            for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
                if candidate in names and candidate != unit.name:
                    units.add(candidate)
    # `from <in-tree package>[.sub] import <module>` names the module in the import list
    for node in ast.walk(tree):
        name = node.module or "" if isinstance(node, ast.ImportFrom) else ""
        if name == IN_TREE_MOD or name.startswith(IN_TREE_MOD + "."):
            base = name[len(IN_TREE_MOD) + 1 :]
            for alias in node.names:  # type: ignore[attr-defined]
                dotted = f"{base}.{alias.name}" if base else alias.name
                target = module_path(dotted, known)
                if target:
                    modules.add(target)
    modules.discard("")
    return modules, units


def assign_tests(manifest: Manifest, units: list[TestUnit]) -> None:
    """Sets each unit's patch: a test file at the first patch covering what it
    imports (or where stack.toml pins it); a helper, conftest or package marker with the
    first test file that needs it."""
    index = patch_of(manifest)
    known = set(shipped_modules())
    by_name = {u.name: u for u in units}
    pinned = {t: i for i, p in enumerate(manifest.patches) for t in p.pinned_tests}
    unknown = sorted(set(pinned) - set(by_name))
    if unknown:
        raise StackError(f"stack.toml pins tests that do not exist: {unknown}")
    refs = {u.name: in_tree_refs(u, known, set(by_name)) for u in units}
    need: dict[str, int] = {}

    def needed(name: str, seen: tuple[str, ...] = ()) -> int:
        if name in need:
            return need[name]
        modules, deps = refs[name]
        missing = [m for m in modules if m not in index]
        if missing:
            raise StackError(f"test {name} needs {missing}, which are in no patch")
        level = max((index[m] for m in modules), default=0)
        for dep in deps:
            if dep not in seen:
                level = max(level, needed(dep, (*seen, name)))
                if by_name[dep].is_test:
                    level = max(level, pinned.get(dep, level))
        need[name] = level
        return level

    for unit in units:
        if unit.is_test:
            level = needed(unit.name)
            if unit.name in pinned:
                if pinned[unit.name] < level:
                    raise StackError(
                        f"{unit.name} is pinned to patch {pinned[unit.name] + 1} but "
                        f"imports what patch {level + 1} adds"
                    )
                level = pinned[unit.name]
            unit.patch = level
    tests = [u for u in units if u.is_test]
    for unit in units:
        if unit.is_test:
            continue
        users = [t.patch for t in tests if unit.name in _closure(t.name, refs)]
        if Path(unit.name).name in ("conftest.py", "__init__.py"):
            folder = str(Path(unit.name).parent)
            users += [
                t.patch
                for t in tests
                if folder == "." or t.name.startswith(folder + "/")
            ]
        unit.patch = min(users) if users else -1  # -1: no test needs it, not shipped
    # pytest imports a conftest.py before any test of its folder: what it imports at its
    # top (not inside a fixture) must be there by then, and goes with it at the latest.
    for unit in units:
        if Path(unit.name).name != "conftest.py" or unit.patch < 0:
            continue
        top = TestUnit(unit.name, _top_level_imports(unit.text))
        modules, deps = in_tree_refs(top, known, set(by_name))
        closure = set(deps)
        for dep in deps:
            closure |= _closure(dep, refs)
        for dep in closure:
            helper = by_name[dep]
            if not helper.is_test and not helper.name.endswith("conftest.py"):
                helper.patch = (
                    unit.patch if helper.patch < 0 else min(helper.patch, unit.patch)
                )
        level = max(
            [index[m] for m in modules if m in index]
            + [needed(d) for d in deps if not by_name[d].is_test],
            default=0,
        )
        if level > unit.patch:
            raise StackError(
                f"{unit.name} goes with the first test of its folder, in patch "
                f"{unit.patch + 1}, but imports at its top what patch {level + 1} "
                "adds: import it inside the fixture that uses it"
            )


def _top_level_imports(text: str) -> str:
    """The import statements at the top level of a module's text."""
    return "\n".join(
        ast.unparse(node)
        for node in ast.parse(text).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    )


def _closure(name: str, refs: dict[str, tuple[set[str], set[str]]]) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        for dep in refs[todo.pop()][1]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def count_tests(text: str) -> int:
    return sum(
        1
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test_")
    )


# ------------------------------------------------------------------------- buildkite


def buildkite(test_files: list[str], source_files: list[str]) -> str:
    """vLLM's CI step for the prefix: its CPU-runnable test files in a CPU job, its
    CUDA kernel tests in a GPU job."""
    rel = TESTS.removeprefix("tests/")
    cpu = [f for f in test_files if not f.startswith("kernels/")]
    gpu = [f for f in test_files if f.startswith("kernels/")]
    deps = "".join(f"    - {s}\n" for s in source_files)
    out = (
        "group: KV CPU Offload\n"
        "depends_on:\n  - image-build\n"
        "steps:\n"
        '- label: ":computer: (CPU) CPUOffloadConnector"\n'
        "  key: cpu-offload-connector-cpu\n"
        "  depends_on:\n    - image-build-cpu\n"
        "  timeout_in_minutes: 30\n"
        "  device: cpu-small\n"
        "  source_file_dependencies:\n"
        f"{deps}"
        "  commands:\n" + "".join(f"    - pytest -v -s {rel}/{f}\n" for f in cpu)
    )
    if gpu:
        out += (
            "\n"
            '- label: ":nvidia: (H200 MIG 18GB) CPUOffloadConnector copy kernels"\n'
            "  key: cpu-offload-connector-kernels\n"
            "  timeout_in_minutes: 20\n"
            "  device: h200_18gb\n"
            "  source_file_dependencies:\n"
            f"{deps}"
            "  commands:\n" + "".join(f"    - pytest -v -s {rel}/{f}\n" for f in gpu)
        )
    return out


# ----------------------------------------------------------------------------- the bar


@dataclass(frozen=True)
class PatchStats:
    title: str
    code_lines: int
    test_lines: int
    files: int
    adds_modules: bool


def is_code_file(path: str) -> bool:
    return path.endswith(".py") and not path.startswith(
        ("tests/", "docs/", "benchmarks/")
    )


def diff_stats(title: str, diff: str, adds_modules: bool) -> PatchStats:
    """Counts a patch's added lines from its `git show -U0` text: code lines are the
    non-blank, non-comment lines of .py files outside tests/, docs/, benchmarks/."""
    code = tests = 0
    files: set[str] = set()
    current = ""
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            files.add(current)
        elif line.startswith("+") and not line.startswith("+++"):
            body = line[1:].strip()
            if not body or body.startswith("#"):
                continue
            if is_code_file(current):
                code += 1
            elif current.startswith("tests/"):
                tests += 1
    return PatchStats(title, code, tests, len(files), adds_modules)


def table(stats: list[PatchStats]) -> str:
    width = max(len(s.title) for s in stats)
    lines = [f"{'#':>2}  {'title':<{width}}  {'code':>5}  {'tests':>5}  {'files':>5}"]
    for i, s in enumerate(stats, 1):
        lines.append(
            f"{i:>2}  {s.title:<{width}}  {s.code_lines:>5}  {s.test_lines:>5}  "
            f"{s.files:>5}"
        )
    return "\n".join(lines)


def bar_failures(stats: list[PatchStats]) -> list[str]:
    failures = []
    if len(stats) < MIN_PATCHES:
        failures.append(f"{len(stats)} patches, fewer than {MIN_PATCHES}")
    for i, s in enumerate(stats, 1):
        if s.code_lines > MAX_CODE_LINES:
            failures.append(
                f"patch {i} has {s.code_lines} code lines, over {MAX_CODE_LINES}: "
                "split it in stack.toml"
            )
        if s.adds_modules and s.test_lines == 0:
            failures.append(f"patch {i} adds modules and no tests")
    code = sorted(s.code_lines for s in stats)
    median = (code[(len(code) - 1) // 2] + code[len(code) // 2]) / 2 if code else 0
    if median >= MAX_MEDIAN_CODE_LINES:
        failures.append(
            f"median of {median:g} code lines, not under {MAX_MEDIAN_CODE_LINES}"
        )
    return failures
