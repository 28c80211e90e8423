"""Applies the plugin the moment vLLM's `vllm.engine.arg_utils` is first imported.

vLLM loads its general plugins late: after `EngineArgs(...)` has accepted its keyword
arguments and, in `EngineArgs.add_cli_args`, not at all. So `LLM(...,
enable_cpu_offload=True)` and every script that builds its parser with
`EngineArgs.add_cli_args` (vLLM's own benchmark scripts among them) would not know the
two flags unless they imported this package.

`vllm_cpu_offload.pth`, installed beside this module, runs `install()` at interpreter
start. That costs one entry in `sys.meta_path` and nothing else: this module imports
only the standard library, and the finder answers for a single module name. When that
module is imported, the finder lets the normal import run, then applies the plugin (the
same `register()` vLLM's entry point calls) before anyone can use `EngineArgs`. The
plugin itself changes nothing while the flags are off. `VLLM_PLUGINS` is honoured as
vLLM honours it: when it is set and does not name `cpu_offload`, nothing is applied.
Uninstalling the package removes the .pth and this module, and with them the hook.
"""

from __future__ import annotations

import os
import sys

# Not typing's: interpreter start imports nothing `site` did not load.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

TARGET = "vllm.engine.arg_utils"
PLUGIN_NAME = "cpu_offload"  # the entry point's name in pyproject.toml
PTH_NAME = "vllm_cpu_offload.pth"
PTH_LINE = "import vllm_cpu_offload_hook; vllm_cpu_offload_hook.install()\n"


def plugin_allowed() -> bool:
    """vLLM's rule for VLLM_PLUGINS: unset loads every plugin, else the listed ones."""
    allowed = os.environ.get("VLLM_PLUGINS")
    return allowed is None or PLUGIN_NAME in allowed.split(",")


def _apply() -> None:
    if not plugin_allowed():
        return
    try:
        from vllm_cpu_offload.plugin import register

        register()
    # Never break vLLM's import; vLLM's own plugin load says more.
    except Exception as e:
        import warnings

        warnings.warn(
            f"vllm-cpu-offload was not applied: {e}", RuntimeWarning, stacklevel=2
        )


class _ApplyAfterLoad:
    """Runs the real loader, then applies the plugin."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _apply()

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for tracebacks
        return getattr(self._loader, name)


class _ArgUtilsFinder:
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname != TARGET:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # once per process, and no recursion below
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ApplyAfterLoad(spec.loader)  # type: ignore[assignment]
        return spec


def install() -> None:
    """Called by the .pth at interpreter start; idempotent."""
    if TARGET in sys.modules or any(
        isinstance(f, _ArgUtilsFinder) for f in sys.meta_path
    ):
        return
    sys.meta_path.insert(0, _ArgUtilsFinder())  # type: ignore[arg-type]


def write_pth(site_dir: str | None = None) -> str:
    """Writes the .pth into `site_dir` (this interpreter's site-packages by default).

    setup.py writes it into every wheel it builds, editable ones included.
    """
    import sysconfig

    path = os.path.join(site_dir or sysconfig.get_path("purelib"), PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path
