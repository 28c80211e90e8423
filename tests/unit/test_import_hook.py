"""The flags reach vLLM's own tools with no import of this package: the .pth import
hook.

Each case runs a fresh interpreter of this environment, as a user's script would run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import vllm_cpu_offload_hook as hook

pytest.importorskip("vllm")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"} | env
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        env=full_env,
    )


def test_the_pth_is_installed_in_this_environment() -> None:
    # The development environment's editable install put it there (test_install.py
    # checks both kinds of install).
    pth = Path(sysconfig.get_path("purelib")) / hook.PTH_NAME
    assert pth.read_text() == hook.PTH_LINE


def test_interpreter_start_imports_nothing_of_vllm_or_the_package() -> None:
    # The hook is one finder in sys.meta_path; vLLM and the plugin stay unimported.
    proc = _python(
        "import sys; print(sorted(m for m in sys.modules if m.startswith(('vllm', "
        "'torch'))))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['vllm_cpu_offload_hook']"


PARSE = """
import sys
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
args = parser.parse_args(sys.argv[1:])
engine_args = EngineArgs.from_cli_args(args)
print("PARSED", engine_args.enable_cpu_offload, engine_args.swap_space)
kwargs = EngineArgs(model="m", enable_cpu_offload=True, swap_space=2)
print("KWARGS", kwargs.enable_cpu_offload, kwargs.swap_space)
"""


def test_a_script_that_builds_its_parser_from_engine_args_knows_the_flags() -> None:
    # vLLM's benchmark scripts call EngineArgs.add_cli_args before vLLM loads plugins.
    proc = subprocess.run(
        [sys.executable, "-c", PARSE, "--enable-cpu-offload", "--swap-space", "1.5"],
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PARSED True 1.5" in proc.stdout and "KWARGS True 2" in proc.stdout


def test_vllm_plugins_without_ours_leaves_vllm_untouched() -> None:
    # VLLM_PLUGINS is honoured as vLLM honours it: not named, not applied.
    proc = _python(
        "import sys\nfrom vllm.engine.arg_utils import EngineArgs\n"
        "print('flags' if hasattr(EngineArgs, '_vllm_cpu_offload_patched') else "
        "'plain',"
        " 'vllm_cpu_offload' in sys.modules)",
        VLLM_PLUGINS="some_other_plugin",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["plain", "False"]


def test_a_plugin_that_cannot_apply_never_breaks_vllms_import() -> None:
    # A vLLM the package is not tested against: vLLM's module loads unpatched, and one
    # line says which releases the package supports.
    proc = _python(
        "import vllm\n"
        "vllm.__version__ = '0.99.0'\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "print('LOADED', hasattr(EngineArgs, '_vllm_cpu_offload_patched'))"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED False" in proc.stdout
    assert proc.stderr.count("supports vLLM 0.32.0 and 0.33.0 but vLLM 0.99.0") == 1
