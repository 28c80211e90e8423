"""Installs `vllm_cpu_offload.pth` beside the package: it runs
`vllm_cpu_offload_hook.install()` at interpreter start, so the flags reach every vLLM
tool without an import of this package. Everything else is in pyproject.toml."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).parent))
from vllm_cpu_offload_hook import PTH_NAME, write_pth  # noqa: E402


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


setup(cmdclass={"build_py": BuildWithPth})
