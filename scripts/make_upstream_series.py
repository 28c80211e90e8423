"""Writes upstream/*.patch, the package as a stack of `git format-patch` patches
against vLLM 0.33.0.

    python scripts/make_upstream_series.py # rewrite upstream/*.patch and README.md
    python scripts/make_upstream_series.py --check # regenerate into a temp dir, compare
    python scripts/make_upstream_series.py --tree DIR # also leave the patched vLLM tree
    in DIR

The stack is built, not written: the vLLM 0.33.0 source distribution
(scripts/fetch_vllm_sdist.sh, checked by sha256) is committed as the base of a scratch
git repository, and each patch of upstream/stack.toml is committed on it in order,
then `git format-patch` writes the commits out. Which module, test and docs section each
patch carries is upstream/stack.toml and scripts/upstream_stack.py (which also checks
that every prefix of the stack imports and that the stack meets its size bar, printing
a table per patch). Everything a patch carries comes from this repository:

- the modules of `vllm_cpu_offload/` but the plugin-only ones (`PLUGIN_ONLY`) become
  `vllm/distributed/kv_transfer/kv_connector/v1/cpu_offload/`, imports rewritten; a
  module added to the package must be given a patch in stack.toml;
- the engine flags are the keyword arguments and parser flags `flags.py` defines (its
  `_wrap_init` and `_add_flags`): they become EngineArgs fields and `add_cli_args`
  flags, and flags.py's resolution (`resolve_offload`, `check_engine`, ...) becomes the
  in-tree `cpu_offload/flags.py` minus its patch machinery (`FLAGS_PATCH_ONLY`);
- the unit, kernel, remote-store and vLLM-scheduler tests are copied from `tests/`
  (the remote-store ones into `remote/` of the in-tree test folder, with the store
  servers they start: `vllm_cpu_offload/testing/store_servers.py`);
  `upstream/templates/` holds what has no counterpart in the package (the in-tree engine
  tests, the docs page, the cover letter).

Dates, author and commit ids are fixed, and the Python files are formatted with a pinned
ruff under vLLM's own configuration, so the same package gives the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from string import Template

from upstream_stack import (
    BUILDKITE,
    DOCS_PAGE,
    IN_TREE,
    IN_TREE_MOD,
    PACKAGE,
    REPO,
    TEMPLATES,
    TESTS,
    TESTS_MOD,
    UPSTREAM,
    Manifest,
    PatchStats,
    StackError,
    TestUnit,
    assign_modules,
    assign_tests,
    bar_failures,
    buildkite,
    check_docs,
    count_tests,
    diff_stats,
    docs_page,
    load_manifest,
    module_text,
    prefix_violations,
    stub_inits,
    table,
)

# The series' base, the current vLLM release (scripts/test_upstream.sh tests on it). The
# package supports 0.32 as well, as a plugin; the series has one base.
VLLM_VERSION = "0.33.0"
LINE_LENGTH = 88  # vLLM's ruff line length

CONNECTOR = "CPUOffloadConnector"

# scripts/test_upstream.sh on the 2-core CI machine, measured (upstream/README.md).
STAGE_TIME = "9 minutes"

AUTHOR_NAME = "vllm-cpu-offload"
AUTHOR_EMAIL = "vllm-cpu-offload@users.noreply.github.com"
DATE = "2026-11-24T12:00:00+0000"

# Top-level names of flags.py that patch EngineArgs at runtime; the rest is the
# resolution of the flags, which the in-tree EngineArgs calls.
FLAGS_PATCH_ONLY = {
    "SUPPORTED_VLLM_VERSIONS",
    "PATCH_NAME",
    "_PATCHED_MARK",
    "_from_cli",
    "unsupported_vllm",
    "check_vllm_version",
    "applied",
    "apply",
    "_patch_command_line",
    "_patch_create_engine_config",
    "_wrap_init",
}
FLAGS_RENAMES = {
    "_add_flags": "add_cli_args",
    "_kv_transfer_config_for": "kv_transfer_config_for",
}
# Tests of the plugin machinery, which the tree does not have.
PLUGIN_ONLY_TESTS = {
    "test_design_doc.py",
    "test_flags.py",
    "test_hint_replay.py",  # a benchmark of this repository's, not in the series
    "test_import_graph.py",
    "test_import_hook.py",
    "test_install.py",
    "test_omp_cores.py",
    "test_vllm_suite_plugin.py",
    "test_policies_anchor.py",  # ARC, LIRS and S3-FIFO stay in the plugin
}

# Modules of `vllm_cpu_offload/testing/` that go beside the in-tree tests when a test
# there imports them: the generated models the tests run on, and the store servers the
# remote-store tests start on loopback.
TEST_HELPERS = ("tiny_model", "tiny_mla", "store_servers")
# Folders of `tests/` copied whole into the same folder of the in-tree test folder
# (with their conftest.py and __init__.py); their test files import each other's
# helpers relatively (`from .conftest import ...`).
TEST_FOLDERS = ("kernels", "remote")

# Applied in order to every file taken from this repository.
REWRITES: tuple[tuple[str, str], ...] = (
    *((f"vllm_cpu_offload.testing.{m}", f"{TESTS_MOD}.{m}") for m in TEST_HELPERS),
    ("vllm_cpu_offload.eviction_policies", "vllm.cpu_offload.eviction_policies"),
    ("vllm_cpu_offload.remote_stores", "vllm.cpu_offload.remote_stores"),
    ("tests.external_policy", f"{TESTS_MOD}.external_policy"),
    ("tests.fault_injection", f"{TESTS_MOD}.fault_injection"),
    ("tests.kernels.", f"{TESTS_MOD}.kernels."),
    ("tests.unit.", f"{TESTS_MOD}."),
    ("from vllm_cpu_offload import", f"from {IN_TREE_MOD} import"),
    ("vllm_cpu_offload.", f"{IN_TREE_MOD}."),
    ("vllm-cpu-offload", CONNECTOR),
)
SPDX = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
NOQA = re.compile(r"# noqa: [A-Z]+[0-9]+(?:, [A-Z]+[0-9]+)*")
LEFTOVER = re.compile(r"\bvllm_cpu_offload(\.|\s+import)")


def rewrite(text: str) -> str:
    for old, new in REWRITES:
        text = text.replace(old, new)
    match = LEFTOVER.search(text)
    assert match is None, f"a reference to the package is left: {match.group(0)!r}"
    return text


def replace_once(path: Path, old: str, new: str) -> None:
    """Replaces the one occurrence of `old` in `path`; vLLM's file must still have
    it."""
    text = path.read_text()
    count = text.count(old)
    assert count == 1, f"{path}: expected one anchor, found {count}: {old[:60]!r}"
    path.write_text(text.replace(old, new))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def copy_rewritten(src: Path, dst: Path) -> None:
    write(dst, rewrite(src.read_text()))


# ---------------------------------------------------------------------------- flags.py


@dataclass(frozen=True)
class EngineField:
    name: str
    annotation: str
    default: str


def flags_source() -> tuple[ast.Module, str]:
    text = (PACKAGE / "flags.py").read_text()
    return ast.parse(text), text


def engine_fields() -> list[EngineField]:
    """The keyword arguments flags.py adds to EngineArgs (its `_wrap_init`), in
    order."""
    tree, _ = flags_source()
    wrap = next(
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == "_wrap_init"
    )
    init = next(n for n in wrap.body if isinstance(n, ast.FunctionDef))
    args = init.args
    fields = []
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        assert arg.annotation is not None and default is not None, arg.arg
        fields.append(
            EngineField(arg.arg, ast.unparse(arg.annotation), ast.unparse(default))
        )
    assert [f.name for f in fields][:2] == ["enable_cpu_offload", "swap_space"], fields
    return fields


def in_tree_flags() -> str:
    """flags.py without its patch machinery: the resolution EngineArgs calls in tree."""
    tree, text = flags_source()
    lines = text.splitlines(keepends=True)
    keep: list[str] = []
    names = set()
    cursor = 0
    body = tree.body[1:]  # the module docstring is replaced below
    start_of_body = body[0].lineno - 1
    for node in body:
        decorators: list[ast.expr] = getattr(node, "decorator_list", [])
        start = (decorators[0].lineno if decorators else node.lineno) - 1
        # comments right above a statement belong to it
        while start > cursor and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        end = node.end_lineno or node.lineno
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            name = target.id if isinstance(target, ast.Name) else ""
        else:
            name = ""
        names.add(name)
        if name not in FLAGS_PATCH_ONLY:
            keep.append("".join(lines[max(start, start_of_body) : end]))
        cursor = end
    missing = (FLAGS_PATCH_ONLY | set(FLAGS_RENAMES)) - names
    assert not missing, (
        f"flags.py no longer defines {sorted(missing)}: update this script"
    )
    source = "\n\n".join(part.strip("\n") + "\n" for part in keep)
    for old, new in FLAGS_RENAMES.items():
        source = re.sub(rf"\b{old}\b", new, source)
    # What is kept must not reach what was dropped: a patch helper split out of
    # `apply` belongs in FLAGS_PATCH_ONLY with it.
    used = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    dangling = used & FLAGS_PATCH_ONLY
    assert not dangling, (
        f"in-tree flags.py uses {sorted(dangling)}, which it drops: add the code that "
        "uses them to FLAGS_PATCH_ONLY"
    )
    docstring = (TEMPLATES / "flags_docstring.txt").read_text()
    return rewrite(f'"""{docstring.strip()}\n"""\n\n{source}')


# --------------------------------------------------------------------------- patches


def stage_factory(tree: Path) -> None:
    replace_once(
        tree / "vllm/distributed/kv_transfer/kv_connector/factory.py",
        '    "SimpleCPUOffloadConnector",\n)\n',
        f'    "SimpleCPUOffloadConnector",\n)\n'
        f"KVConnectorFactory.register_connector(\n"
        f'    "{CONNECTOR}",\n    "{IN_TREE_MOD}.connector",\n    "{CONNECTOR}",\n)\n',
    )


def stage_engine_args(tree: Path) -> None:
    write(tree / IN_TREE / "flags.py", in_tree_flags())
    arg_utils = tree / "vllm/engine/arg_utils.py"
    anchor = (
        "    kv_offloading_backend: KVOffloadingBackend"
        " = CacheConfig.kv_offloading_backend\n"
    )
    fields = "".join(
        f"    {f.name}: {f.annotation} = {f.default}\n" for f in engine_fields()
    )
    replace_once(
        arg_utils,
        anchor,
        anchor
        + "    # Host-memory KV tier (CPUOffloadConnector); see its flags.py.\n"
        + fields,
    )
    anchor = (
        "        cache_group.add_argument(\n"
        '            "--kv-offloading-backend", '
        '**cache_kwargs["kv_offloading_backend"]\n'
        "        )\n"
    )
    replace_once(
        arg_utils,
        anchor,
        anchor + "\n        from "
        f"{IN_TREE_MOD}.flags import (\n"
        "            add_cli_args as add_cpu_offload_args,\n        )\n\n"
        "        add_cpu_offload_args(parser)\n",
    )
    replace_once(
        arg_utils,
        "            "
        "**{attr: getattr(args, attr) for attr in attrs if hasattr(args, attr)}\n"
        "        )\n        return engine_args\n",
        "            "
        "**{attr: getattr(args, attr) for attr in attrs if hasattr(args, attr)}\n"
        "        )\n"
        f"        from {IN_TREE_MOD}.config import OffloadConfigError\n"
        f"        from {IN_TREE_MOD}.flags import resolve_offload\n\n"
        "        # Bad host-tier flags end the process with one line, as argparse's\n"
        "        # errors do, before anything starts.\n"
        "        try:\n            resolve_offload(engine_args)\n"
        "        except OffloadConfigError as e:\n"
        '            print(f"error: {e}", file=sys.stderr)\n'
        "            raise SystemExit(2) from None\n"
        "        return engine_args\n",
    )
    anchor = (
        '        NOTE: If VllmConfig is incompatible, we raise an error.\n        """\n'
    )
    replace_once(
        arg_utils,
        anchor,
        anchor + f"        from {IN_TREE_MOD}.flags import (\n"
        "            check_engine,\n            kv_transfer_config_for,\n"
        "            resolve_offload,\n        )\n\n"
        "        # --enable-cpu-offload resolves to the CPUOffloadConnector here, so "
        "every\n"
        "        # process gets it through kv_transfer_config.\n"
        "        cpu_offload = resolve_offload(self)\n"
        "        if cpu_offload is not None:\n"
        "            self.kv_transfer_config = kv_transfer_config_for(\n"
        "                cpu_offload, self.kv_transfer_config\n            )\n",
    )
    replace_once(
        arg_utils,
        "        return config\n\n    def _check_feature_supported(self):\n",
        "        if cpu_offload is not None:\n            check_engine(config, "
        "cpu_offload)\n"
        "        return config\n\n    def _check_feature_supported(self):\n",
    )


def stage_omp_cores(tree: Path) -> None:
    replace_once(
        tree / "vllm/utils/ompmultiprocessing.py",
        "        # reserve at one more core for nixl_connector under p/d case\n"
        "        if config.kv_transfer_config:\n",
        "        # reserve at one more core for nixl_connector under p/d case. The\n"
        f"        # {CONNECTOR} copies on the worker's own thread between forward\n"
        "        # passes and needs none: with it the model keeps the OpenMP threads\n"
        "        # (and so the bf16 outputs) it has without a connector.\n"
        "        kv_transfer_config = config.kv_transfer_config\n"
        "        if (\n            kv_transfer_config\n"
        f'            and kv_transfer_config.kv_connector != "{CONNECTOR}"\n'
        "        ):\n",
    )


def _drop_function(text: str, name: str) -> str:
    """`text` without the top-level function `name` (and its decorators)."""
    tree = ast.parse(text)
    node = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name
    )
    lines = text.splitlines(keepends=True)
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    end = node.end_lineno or node.lineno
    return "".join(lines[:start]) + "".join(lines[end:]).lstrip("\n")


def test_text(src: Path, name: str) -> str:
    """A test file moved deeper: `Path(__file__).parents[n]` that named the repository
    root names vLLM's root."""
    old = len(src.relative_to(REPO).parts) - 1
    new = len(Path(TESTS, name).parts) - 1
    return rewrite(
        re.sub(
            rf"(Path\(__file__\)(?:\.resolve\(\))?\.parents\[){old}\]",
            rf"\g<1>{new}]",
            src.read_text(),
        )
    )


def test_units() -> list[TestUnit]:
    """Every file the stack may put in the in-tree test folder, in-tree text."""
    units = []
    for src in sorted((REPO / "tests/unit").glob("*.py")):
        if src.name not in PLUGIN_ONLY_TESTS:
            units.append(TestUnit(src.name, test_text(src, src.name)))
    for folder in TEST_FOLDERS:
        for src in sorted((REPO / "tests" / folder).glob("*.py")):
            name = f"{folder}/{src.name}"
            units.append(TestUnit(name, test_text(src, name)))
    for src in sorted((REPO / "tests/external_policy").glob("*.py")):
        units.append(TestUnit(f"external_policy/{src.name}", rewrite(src.read_text())))
    units.append(
        TestUnit(
            "fault_injection.py",
            rewrite((REPO / "tests/fault_injection.py").read_text()),
        )
    )
    scheduler_test = (
        REPO / "tests/vllm_helpers/test_vllm_scheduler_with_our_connector.py"
    )
    # In tree vLLM's connector test helpers are a plain import (conftest.py:
    # vllm_utils).
    text = _drop_function(scheduler_test.read_text(), "vllm_utils")
    units.append(TestUnit("test_vllm_scheduler.py", rewrite(text)))
    for src in sorted((TEMPLATES / TESTS).rglob("*.py")):
        units.append(
            TestUnit(src.relative_to(TEMPLATES / TESTS).as_posix(), src.read_text())
        )
    for m in TEST_HELPERS:
        units.append(
            TestUnit(f"{m}.py", rewrite((PACKAGE / f"testing/{m}.py").read_text()))
        )
    names = {u.name for u in units}
    for folder in (*TEST_FOLDERS, "external_policy"):
        if f"{folder}/__init__.py" not in names:
            units.append(TestUnit(f"{folder}/__init__.py", ""))
    if "__init__.py" not in names:
        units.append(TestUnit("__init__.py", ""))
    return units


STAGE_FUNCTIONS: dict[str, Callable[[Path], None]] = {
    "factory": stage_factory,
    "engine_args": stage_engine_args,
    "omp_cores": stage_omp_cores,
}
# What vLLM's CI step watches, by the stage that changes it.
STAGE_SOURCES = {
    "factory": "vllm/distributed/kv_transfer/kv_connector/factory.py",
    "engine_args": "vllm/engine/arg_utils.py",
    "omp_cores": "vllm/utils/ompmultiprocessing.py",
}


def render(tree: Path, manifest: Manifest, upto: int, units: list[TestUnit]) -> None:
    """Writes what the stack holds after patch `upto` (cumulative; what did not change
    formats back to the committed bytes) and runs that patch's stages."""
    patches = manifest.patches[: upto + 1]
    prefix = {m for p in patches for m in p.modules}
    dst = tree / IN_TREE
    for rel in sorted(prefix):
        write(dst / rel, rewrite(module_text(manifest, rel, prefix)))
    for rel, text in stub_inits(prefix).items():
        write(dst / rel, text)
    shutil.copy(TEMPLATES / IN_TREE / "__init__.py", dst / "__init__.py")
    for stage in manifest.patches[upto].stages:
        STAGE_FUNCTIONS[stage](tree)
    shipped = [u for u in units if 0 <= u.patch <= upto]
    for unit in shipped:
        write(tree / TESTS / unit.name, unit.text)
    tests = sorted(u.name for u in shipped if u.is_test)
    if tests:
        sources = [f"{IN_TREE}/", f"{TESTS}/"] + [
            STAGE_SOURCES[s] for p in patches for s in p.stages
        ]
        write(tree / BUILDKITE, buildkite(tests, sources))
    page = docs_page(manifest, upto, rewrite)
    if page is not None:
        write(tree / DOCS_PAGE, page)


def commit_message(manifest: Manifest, upto: int, units: list[TestUnit]) -> str:
    patch = manifest.patches[upto]
    added = [u for u in units if u.patch == upto and u.is_test]
    n_tests = sum(count_tests(u.text) for u in added)
    prefix = {m for p in manifest.patches[: upto + 1] for m in p.modules}
    py_modules = [m for m in prefix if m.endswith(".py")]
    checks = [
        "vLLM's pinned ruff (check and format) and its mypy hook on the Python files "
        "it changes",
        f"an import of each of the {len(py_modules)} in-tree modules present",
    ]
    if added:
        files = ", ".join(Path(u.name).name for u in added)
        checks.append(
            f"pytest on the {len(added)} test files it adds ({n_tests} tests: {files})"
        )
    if patch.e2e:
        checks.append(
            "the end-to-end LLM tests "
            + ", ".join(patch.e2e)
            + ", here and again on the whole stack"
        )
    if "factory" in patch.stages:
        checks.append("vLLM's own tests of the connector factory")
    result = (
        "scripts/test_upstream.sh applies the stack to vLLM "
        f"{VLLM_VERSION} one patch at a time; at this patch it runs "
        + "; ".join(checks)
        + "."
    )
    body = "\n\n".join(
        f"## {h}\n\n{textwrap.fill(t, 72) if h == 'Test Result' else t}"
        for h, t in (
            ("Purpose", patch.purpose),
            ("Test Plan", patch.test_plan),
            ("Test Result", result),
        )
    )
    return f"{patch.title}\n\n{body}\n"


# --------------------------------------------------------------------------- git, ruff


def git_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME=AUTHOR_NAME,
        GIT_AUTHOR_EMAIL=AUTHOR_EMAIL,
        GIT_COMMITTER_NAME=AUTHOR_NAME,
        GIT_COMMITTER_EMAIL=AUTHOR_EMAIL,
        GIT_AUTHOR_DATE=DATE,
        GIT_COMMITTER_DATE=DATE,
        TZ="UTC",
        LC_ALL="C",
    )
    return env


def git(tree: Path, *args: str) -> str:
    cmd = ["git", "-c", "core.abbrev=12", "-c", "diff.algorithm=myers", *args]
    return subprocess.run(
        cmd, cwd=tree, env=git_env(), check=True, capture_output=True, text=True
    ).stdout


def ruff_version(sdist: Path) -> str:
    """The ruff that vLLM's pre-commit pins, so that a maintainer's pre-commit run
    changes nothing in the series."""
    config = (sdist / ".pre-commit-config.yaml").read_text()
    match = re.search(r"astral-sh/ruff-pre-commit\s+rev:\s*v?([\w.]+)", config)
    assert match, "vLLM's .pre-commit-config.yaml no longer pins ruff-pre-commit"
    return match.group(1)


def ruff_command(version: str) -> list[str]:
    """That ruff: this interpreter's when it is that version, else one installed once
    into .cache/ (PyPI)."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True
        ).stdout
    except OSError:
        out = ""
    if out.split()[-1:] == [version]:
        return [sys.executable, "-m", "ruff"]
    target = REPO / ".cache" / f"ruff-{version}"
    binary = target / "bin" / "ruff"
    if not binary.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--target",
                str(target),
                f"ruff=={version}",
            ],
            check=True,
        )
    return [str(binary)]


def relative_imports(name: str, text: str) -> str:
    """An in-tree module imports its package's modules relatively, as many of vLLM's
    packages do: the absolute in-tree paths run past vLLM's line length."""
    parts = name.removesuffix(".py").split("/")
    package = parts[:-1]  # the package a relative import starts from
    prefix = IN_TREE_MOD.split(".")

    def relative(match: re.Match[str]) -> str:
        target = (IN_TREE_MOD + (match.group(2) or "")).split(".")
        common = 0
        while common < min(len(package), len(target)) and (
            package[common] == target[common]
        ):
            common += 1
        assert common >= len(prefix), (name, match.group(0))
        dots = "." * (1 + len(package) - common)
        rest = ".".join(target[common:])
        return f"{match.group(1)}from {dots}{rest} import"

    pattern = rf"^(\s*)from {re.escape(IN_TREE_MOD)}((?:\.\w+)*) import"
    return re.sub(pattern, relative, text, flags=re.M)


def mark_long_imports(path: Path) -> None:
    """A test's import of an in-tree module that still runs past the line length gets
    the `# noqa: E501` that vLLM gives such lines."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    starts = {
        node.lineno - 1
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ImportFrom)
    }
    for i in sorted(starts):
        line = lines[i].rstrip("\n")
        if len(line) <= LINE_LENGTH:
            continue
        if NOQA.search(line):  # one noqa comment per line: add the code to it
            lines[i] = NOQA.sub(lambda m: f"{m.group(0)}, E501", line) + "\n"
        else:
            lines[i] = line + "  # noqa: E501\n"
    path.write_text("".join(lines))


def format_python(tree: Path, ruff: list[str]) -> None:
    """Formats the Python files the patch touched with vLLM's ruff configuration."""
    changed = git(tree, "status", "--porcelain", "--untracked-files=all").splitlines()
    files = [line[3:] for line in changed if line.endswith(".py")]
    files = [f for f in files if (tree / f).exists()]
    if not files:
        return
    for name in files:
        path = tree / name
        text = path.read_text()
        if not text.startswith("# SPDX"):
            text = SPDX + text
        if name.startswith(IN_TREE + "/"):
            text = relative_imports(name, text)
        path.write_text(text)
    # isort under vLLM's settings, and the imports left unused where this script cut a
    # part out (the package itself has none: its own ruff checks F401).
    subprocess.run(
        [*ruff, "check", "-q", "--no-cache", "--fix-only", "--select", "I,F401"]
        + files,
        cwd=tree,
    )
    subprocess.run([*ruff, "format", "-q", "--no-cache", *files], cwd=tree, check=True)
    for name in files:
        mark_long_imports(tree / name)


# ----------------------------------------------------------------------------- main


def fetch_full_sdist() -> Path:
    out = subprocess.run(
        ["bash", str(REPO / "scripts/fetch_vllm_sdist.sh"), VLLM_VERSION],
        env={**os.environ, "VLLM_SDIST_FULL": "1"},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return Path(out.strip())


def base_tree(sdist: Path, tree: Path) -> None:
    version = re.search(r"^Version: (\S+)$", (sdist / "PKG-INFO").read_text(), re.M)
    assert version and version.group(1) == VLLM_VERSION, (
        f"{sdist} is not vLLM {VLLM_VERSION}'s source distribution, the series' base"
    )
    shutil.copytree(
        sdist, tree, symlinks=True, ignore=shutil.ignore_patterns(".complete")
    )
    git(tree, "init", "-q", "-b", "main")
    git(tree, "add", "-A", "-f")
    git(
        tree,
        "commit",
        "-q",
        "--no-verify",
        "-m",
        f"vLLM {VLLM_VERSION} (source distribution)",
    )
    git(tree, "tag", "base")


@dataclass(frozen=True)
class Stack:
    manifest: Manifest
    units: list[TestUnit]
    stats: list[PatchStats]
    patches: list[Path]


def plan() -> tuple[Manifest, list[TestUnit]]:
    """The manifest with every module, test and docs section placed; raises
    StackError where the package and upstream/stack.toml disagree."""
    manifest = load_manifest()
    check_docs(manifest)
    units = test_units()
    assign_tests(manifest, units)
    return manifest, units


def build(sdist: Path, tree: Path, out: Path) -> Stack:
    """Builds the stack on a copy of `sdist` in `tree`; writes it and the cover to
    `out`."""
    manifest, units = plan()
    base_tree(sdist, tree)
    version = ruff_version(sdist)
    ruff = ruff_command(version)
    stats = []
    for i, patch in enumerate(manifest.patches):
        render(tree, manifest, i, units)
        format_python(tree, ruff)
        git(tree, "add", "-A", "-f")
        git(
            tree,
            "commit",
            "-q",
            "--no-verify",
            "--allow-empty",
            "--cleanup=verbatim",
            "-m",
            commit_message(manifest, i, units),
        )
        diff = git(tree, "show", "-U0", "--format=", "HEAD")
        stats.append(diff_stats(patch.title, diff, bool(patch.modules)))
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.patch"):
        old.unlink()
    git(
        tree,
        "format-patch",
        "-q",
        "--zero-commit",
        "--no-signature",
        "--stat=80",
        "-o",
        str(out),
        "base..HEAD",
    )
    patches = sorted(out.glob("*.patch"))
    stack = Stack(manifest, units, stats, patches)
    write(out / "README.md", cover_letter(tree, stack, version))
    return stack


def cover_letter(tree: Path, stack: Stack, ruff_version: str) -> str:
    listing = "\n".join(
        f"{i}. `{p.name}`: {s.title}"
        for i, (p, s) in enumerate(zip(stack.patches, stack.stats, strict=True), 1)
    )
    diffstat = git(tree, "diff", "--stat=100", "--summary", "base..HEAD").rstrip()
    fields = ", ".join(
        f"`{f.name}: {f.annotation} = {f.default}`" for f in engine_fields()
    )
    template = Template((TEMPLATES / "README.md.in").read_text())
    return template.substitute(
        patches=listing,
        table=table(stack.stats),
        num_patches=len(stack.patches),
        diffstat=diffstat,
        fields=fields,
        version=VLLM_VERSION,
        ruff=ruff_version,
        stage_time=STAGE_TIME,
    )


def static_report() -> int:
    """The manifest's checks that need no vLLM tree: modules placed, docs sections
    placed, tests placed, every prefix importing only modules of the prefix."""
    try:
        manifest, units = plan()
    except StackError as e:
        print(f"error: {e}")
        return 1
    unmatched = assign_modules(load_manifest())
    for pattern in unmatched:
        print(f"note: stack.toml names {pattern}, which the package does not have")
    violations = prefix_violations(manifest)
    for v in violations:
        print(f"prefix violation: {v}")
    for i, patch in enumerate(manifest.patches):
        tests = [u.name for u in units if u.patch == i and u.is_test]
        print(f"{i + 1:>2} {patch.title}\n     modules: {' '.join(patch.modules)}")
        print(f"     tests: {' '.join(tests)}")
    return 1 if violations else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with upstream/, write nothing"
    )
    parser.add_argument(
        "--sdist",
        type=Path,
        help=f"an unpacked vLLM {VLLM_VERSION} sdist (default: fetch)",
    )
    parser.add_argument("--tree", type=Path, help="build the patched tree here (kept)")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print where modules and tests go, and the prefix check; build nothing",
    )
    parser.add_argument(
        "--allow-violations",
        action="store_true",
        help="write the stack even where a prefix does not import or the bar is broken",
    )
    parser.add_argument(
        "--print-ruff",
        action="store_true",
        help="print the command of the ruff vLLM's pre-commit pins, build nothing",
    )
    args = parser.parse_args()
    if args.plan:
        return static_report()
    if args.print_ruff:
        sdist = args.sdist or fetch_full_sdist()
        print(shlex.join(ruff_command(ruff_version(sdist))))
        return 0
    try:
        manifest, _ = plan()
    except StackError as e:
        print(f"error: {e}")
        return 1
    violations = prefix_violations(manifest)
    for v in violations:
        print(f"prefix violation: {v}")
    sdist = args.sdist or fetch_full_sdist()
    with tempfile.TemporaryDirectory(prefix="upstream-") as tmp:
        tree = args.tree or Path(tmp) / "vllm"
        if tree.exists():
            shutil.rmtree(tree)
        out = Path(tmp) / "series"
        stack = build(sdist, tree, out)
        patches = stack.patches
        print(table(stack.stats))
        failures = bar_failures(stack.stats)
        for failure in failures:
            print(f"bar: {failure}")
        broken = bool(failures or violations)
        if broken and not args.allow_violations:
            print("the stack does not meet its bar (above); nothing written")
            return 1
        if not args.check:
            for old in UPSTREAM.glob("*.patch"):
                old.unlink()
            for new in [*patches, out / "README.md"]:
                shutil.copy(new, UPSTREAM / new.name)
                print(f"upstream/{new.name}")
            return 1 if broken else 0
        names = sorted(p.name for p in out.iterdir() if p.suffix in (".patch", ".md"))
        committed = sorted(
            p.name
            for p in UPSTREAM.iterdir()
            if p.suffix in (".patch", ".md") and p.name != "RFC.md"  # hand-written
        )
        differ = [
            n
            for n in names
            if n in committed and not filecmp.cmp(out / n, UPSTREAM / n, shallow=False)
        ]
        stale = sorted(set(names) ^ set(committed))
        if differ or stale:
            print(
                "upstream/ is out of date with the package "
                f"(differ: {differ}, missing or extra: {stale}); "
                "run: python scripts/make_upstream_series.py"
            )
            for name in differ[:3]:
                subprocess.run(["diff", "-u", str(UPSTREAM / name), str(out / name)])
            return 1
        print(f"upstream/ is in sync: {len(patches)} patches")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
