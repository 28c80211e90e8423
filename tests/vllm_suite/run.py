"""Runs vLLM 0.32.0's own unit tests with this package loaded and prints per-file
counts.

    python -m tests.vllm_suite.run # plugin loaded; CI runs this python -m
    tests.vllm_suite.run --mode both # plain and plugin loaded, side by side python -m
    tests.vllm_suite.run --all # every file of the four folders (selection.py)

The tests come from vLLM's source distribution (scripts/fetch_vllm_sdist.sh), run from
its root on the installed vLLM, offline, against config-only stand-ins of the hub models
their helpers name (hub_standins.py). "plain" runs them with VLLM_PLUGINS=none, so
neither vLLM nor the import hook applies the plugin; "plugin" forces it in before
collection (vllm_cpu_offload.testing.vllm_suite_plugin), which fails a test after which
it is gone.

A test that fails with the plugin loaded is rerun plain: if it passes there, the failure
is ours and the run fails; if it fails there too, it is vLLM's on this machine and is
reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.vllm_suite import hub_standins
from tests.vllm_suite.selection import ALL_FILES, DESELECTED, FILES

REPO = Path(__file__).resolve().parents[2]
SUITE_DIR = Path(__file__).resolve().parent
# the selection takes about 2 min here (1,677 passed in 119 s); a hang must not stall CI
RUN_TIMEOUT_S = 45 * 60
COLUMNS = (
    "passed",
    "failed",
    "error",
    "skipped",
    "xfailed",
    "xpassed",
    "collection error",
)

Outcomes = dict[str, str]  # node id -> outcome


def fetch_sdist() -> Path:
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch_vllm_sdist.sh")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return Path(out.strip())


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "vllm_cpu_offload"
    return Path(os.environ.get("VLLM_CPU_OFFLOAD_CACHE", default))


def run_pytest(
    sdist: Path, mode: str, targets: list[str], hf_home: Path, workers: int
) -> tuple[int, Outcomes]:
    """Runs pytest in the sdist's root; returns its exit code and every test's
    outcome."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "outcomes.jsonl"
        # vLLM's tests get no pytest configuration but their own conftest files, and
        # node ids relative to the sdist, wherever it lies: without these, an sdist
        # inside this repository (VLLM_CPU_OFFLOAD_CACHE=./.cache in CI) would pick up
        # this repo's pyproject.toml, and the ids of DESELECTED would not match.
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n")
        env = dict(os.environ)
        env.update(
            HF_HOME=str(hf_home),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_SUITE_OUTCOMES=str(log),
            PYTHONPATH=os.pathsep.join(
                filter(None, [str(SUITE_DIR), env.get("PYTHONPATH")])
            ),
        )
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "outcome_log",
            "-p",
            "cleanup_marks",
        ]
        cmd += ["-c", str(ini), "--rootdir", str(sdist)]
        if mode == "plain":
            env["VLLM_PLUGINS"] = "none"
        else:
            env.pop("VLLM_PLUGINS", None)
            cmd += ["-p", "vllm_cpu_offload.testing.vllm_suite_plugin"]
        if workers > 1:
            cmd += ["-n", str(workers)]  # pytest-xdist
        cmd += [f"--deselect={node}" for node in DESELECTED]
        cmd += targets
        proc = subprocess.run(cmd, cwd=sdist, env=env, timeout=RUN_TIMEOUT_S)
        outcomes: Outcomes = {}
        if log.exists():
            for line in log.read_text().splitlines():
                record = json.loads(line)
                outcomes[record["nodeid"]] = record["outcome"]
        return proc.returncode, outcomes


def per_file(outcomes: Outcomes) -> dict[str, Counter[str]]:
    files: dict[str, Counter[str]] = {}
    for node, outcome in outcomes.items():
        files.setdefault(node.split("::")[0], Counter())[outcome] += 1
    return files


def failures(outcomes: Outcomes) -> list[str]:
    bad = ("failed", "error", "xpassed", "collection error")
    return sorted(node for node, outcome in outcomes.items() if outcome in bad)


def summary(counts: Counter[str]) -> str:
    return ", ".join(f"{counts[c]} {c}" for c in COLUMNS if counts[c]) or "nothing ran"


def print_table(runs: dict[str, Outcomes]) -> None:
    tables = {mode: per_file(outcomes) for mode, outcomes in runs.items()}
    names = sorted(set().union(*tables.values()))
    print(f"\n{'file':<72} " + " | ".join(f"{m:^28}" for m in runs))
    for name in names:
        cells = [summary(tables[m].get(name, Counter())) for m in runs]
        print(f"{name:<72} " + " | ".join(f"{c:<28}" for c in cells))
    for mode, outcomes in runs.items():
        print(f"total, {mode}: {summary(Counter(outcomes.values()))}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("plugin", "plain", "both"), default="plugin")
    parser.add_argument(
        "--sdist", type=Path, help="an unpacked vLLM 0.32.0 sdist (default: fetch)"
    )
    parser.add_argument(
        "--all", action="store_true", help="every file of the four folders"
    )
    parser.add_argument(
        "--json", type=Path, help="write every outcome per mode to this file"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="pytest-xdist processes (1: none)"
    )
    parser.add_argument(
        "targets", nargs="*", help="files or node ids (default: the selection)"
    )
    args = parser.parse_args()

    sdist = args.sdist or fetch_sdist()
    hf_home = hub_standins.write(cache_dir() / "hf-standins")
    targets = args.targets or list(ALL_FILES if args.all else FILES)
    modes = ("plain", "plugin") if args.mode == "both" else (args.mode,)
    runs: dict[str, Outcomes] = {}
    codes: dict[str, int] = {}
    for mode in modes:
        start = time.monotonic()
        codes[mode], runs[mode] = run_pytest(
            sdist, mode, targets, hf_home, args.workers
        )
        print(f"{mode}: pytest exit {codes[mode]} in {time.monotonic() - start:.0f} s")
    print_table(runs)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")

    ok = True
    if "plugin" in codes and codes["plugin"] not in (
        pytest.ExitCode.OK,
        pytest.ExitCode.TESTS_FAILED,
    ):
        print(f"FAIL: pytest exit {codes['plugin']} with the plugin loaded")
        ok = False
    if "plugin" in runs and not runs["plugin"]:
        print("FAIL: no test ran with the plugin loaded")
        ok = False
    failed = failures(runs.get("plugin", {}))
    if failed:
        plain = (
            runs.get("plain")
            or run_pytest(sdist, "plain", failed, hf_home, args.workers)[1]
        )
        ours = [node for node in failed if plain.get(node) == "passed"]
        theirs = [node for node in failed if node not in ours]
        for node in theirs:
            print(
                f"fails without the plugin too ({plain.get(node, 'not run')}): {node}"
            )
        for node in ours:
            print(f"FAIL: fails only with the plugin loaded: {node}")
        ok = ok and not ours
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
