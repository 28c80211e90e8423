"""Both ways a user installs the package carry the import hook: a wheel built from the
tree, and an editable install (`pip install -e .`).

Each case installs a copy of the tree into a new virtual environment that sees this
environment's packages (vLLM, setuptools) behind its own, then runs a script that
builds its parser from EngineArgs, as vLLM's benchmark scripts do, without importing
the package: it knows the flags only if the install put the hook's .pth in place.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

import vllm_cpu_offload_hook as hook

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]

PARSE = """
import sys
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
args = parser.parse_args(sys.argv[1:])
print("PARSED", EngineArgs.from_cli_args(args).enable_cpu_offload)
print("FROM", __import__("vllm_cpu_offload").__file__)
"""


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PIP_USER")}
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


def _tree_copy(tmp: Path) -> Path:
    """The tracked files of the repository, as a fresh clone has them."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    src = tmp / "src"
    for name in filter(None, files.split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    return src


def _environment(tmp: Path) -> Path:
    """A new venv whose site-packages lists this environment's after its own."""
    venv.create(tmp / "venv", with_pip=True)
    python = tmp / "venv" / "bin" / "python"
    # The setuptools a new venv may bring is older than the build needs; this
    # environment's is used instead.
    _run([str(python), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], tmp)
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        tmp,
    ).stdout.strip()
    # A path line adds the directory without running its .pth files (this
    # environment's own hook stays out).
    (Path(purelib) / "zz_base_environment.pth").write_text(
        sysconfig.get_path("purelib") + "\n"
    )
    return python


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_an_install_carries_the_hook(tmp_path: Path, kind: str) -> None:
    src = _tree_copy(tmp_path)
    python = _environment(tmp_path)
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps"]
    pip += ["--no-build-isolation", "--no-index"]
    if kind == "wheel":
        build = _run(
            [
                str(python),
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "-w",
                str(tmp_path / "dist"),
                str(src),
            ],
            tmp_path,
        )
        assert build.returncode == 0, build.stderr[-2000:]
        wheels = list((tmp_path / "dist").glob("*.whl"))
        assert len(wheels) == 1
        install = _run([*pip, str(wheels[0])], tmp_path)
    else:
        install = _run([*pip, "-e", str(src)], tmp_path)
    assert install.returncode == 0, install.stderr[-2000:]
    # The install says nothing (no deprecation or build notices).
    assert "Warning" not in install.stderr, install.stderr[-2000:]
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        tmp_path,
    ).stdout.strip()
    assert (Path(site) / hook.PTH_NAME).read_text() == hook.PTH_LINE
    proc = _run([str(python), "-c", PARSE, "--enable-cpu-offload"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PARSED True" in proc.stdout
    # The package came from this install, not from the environment behind it.
    origin = Path(proc.stdout.split("FROM", 1)[1].strip())
    assert origin.is_relative_to(src if kind == "editable" else Path(site))
