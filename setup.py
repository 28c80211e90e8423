"""Installs `vllm_cpu_offload.pth` beside the package: it runs
`vllm_cpu_offload_hook.install()` at interpreter start, so the flags reach every vLLM
tool without an import of this package. A wheel carries it (`build_py`), and so does an
editable install (`pip install -e .`, `editable_wheel`). Everything else is in
pyproject.toml."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

sys.path.insert(0, str(Path(__file__).parent))
from vllm_cpu_offload_hook import PTH_LINE, PTH_NAME, write_pth  # noqa: E402


class BuildWithPth(build_py):
    """build_py that also writes the .pth into the wheel's root (site-packages)."""

    def run(self) -> None:
        super().run()
        write_pth(self.build_lib)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [
            *super().get_outputs(include_bytecode),
            str(Path(self.build_lib) / PTH_NAME),
        ]


class _StrategyWithPth:
    """An editable install's strategy (how the wheel points at the source tree), plus
    the hook's .pth at the wheel's root, as a regular wheel has it."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    def __call__(self, wheel: Any, files: list[str], mapping: Any) -> object:
        result = self._strategy(wheel, files, mapping)
        wheel.writestr(PTH_NAME, PTH_LINE)
        return result

    def __enter__(self) -> _StrategyWithPth:
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        # setuptools then says that folders named like the package take precedence
        # on imports, on every editable install: here that folder is the package.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Editable installation")
            self._strategy.__exit__(*exc)


class EditableWithPth(editable_wheel):
    """`pip install -e .`: the editable wheel carries the hook's .pth too. Fails the
    install, rather than leave the flags unreachable, if setuptools changes this
    method."""

    def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
        return _StrategyWithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
