"""Real store servers on loopback, for tests and benchmarks: a Mooncake master with
one storage node (`MooncakeServers`) and a `redis-server` (`RedisServer`).

Each picks free ports, starts its processes with their output in a temporary folder,
waits (bounded) until they answer, and stops them on `stop()` or on leaving its `with`
block, an exception included. A missing binary, or a missing client library of the
store it serves, raises `ServerUnavailable`, whose message says how to install it (a
test fixture turns it into a skip).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

LOOPBACK = "127.0.0.1"
_READY_TIMEOUT_S = 60.0
# A bound of store calls (`remote_timeout_s`) far beyond any test, for the stores of
# tests whose hits depend on their writes: a call that a loaded machine makes slow
# is then late, never dropped, and a miss it would cost is not taken for a fault of
# the tier. Tests of the bound itself keep a short one.
UNBOUNDED_CALL_S = 3600.0


class ServerUnavailable(RuntimeError):
    """A server's binary is not installed; the message says how to install it."""


class _Processes:
    """Processes started by name, with their output in one temporary folder."""

    def __init__(self, prefix: str) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix=prefix))
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        assert name not in self._procs, f"{name} runs already"
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self._procs[name] = subprocess.Popen(
                _dies_with_parent(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                cwd=self.log_dir,
            )

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self._procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.send_signal(signal.SIGCONT)  # a paused process acts on it only so
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def kill_all(self) -> None:
        for name in list(self._procs):
            self.kill(name, signal.SIGTERM)

    def signal(self, name: str, sig: int) -> None:
        self._procs[name].send_signal(sig)

    def wait_stopped(self, name: str) -> None:
        """Until every thread of `name` is stopped (state T in /proc)."""
        tasks = Path(f"/proc/{self._procs[name].pid}/task")
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            states = []
            for task in tasks.iterdir():
                with contextlib.suppress(OSError):  # a thread that just ended
                    # the state follows the command name, which is in parentheses
                    states.append(
                        (task / "stat").read_text().rpartition(")")[2].split()[0]
                    )
            if states and all(state in ("T", "t") for state in states):
                return
            time.sleep(0.01)
        raise RuntimeError(f"{name} did not stop within {_READY_TIMEOUT_S} s")

    def wait_port(self, name: str, port: int) -> None:
        """Until `port` takes connections; raises if `name` exits or time runs out."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            proc = self._procs[name]
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode}: {self.tail(name)}"
                )
            try:
                with socket.create_connection((LOOPBACK, port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(
            f"{name} did not listen on {port} in "
            f"{_READY_TIMEOUT_S:g} s: {self.tail(name)}"
        )

    def tail(self, name: str) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-5:])


def _dies_with_parent(argv: list[str]) -> list[str]:
    """`argv` run so that it gets SIGKILL when the thread that started it ends: a test
    run that is killed leaves no server behind (util-linux's setpriv; without it,
    `argv` as it is). setpriv execs, so the child's pid is the server's."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv


def free_port() -> int:
    """A port free on loopback now (another process may take it before we do)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class MooncakeServers:
    """A Mooncake master (with its HTTP metadata server) and one storage node of
    `global_segment_size` bytes (Mooncake's syntax: "512MB"), all on loopback.
    `url` is the `mooncake://` URL an engine would take."""

    def __init__(self, global_segment_size: str = "512MB") -> None:
        package = importlib.util.find_spec("mooncake")
        folder = Path(package.origin).parent if package and package.origin else None
        self._master_bin = folder / "mooncake_master" if folder else None
        self._node_bin = folder / "mooncake_client" if folder else None
        if self._master_bin is None or not self._master_bin.exists():
            raise ServerUnavailable(
                "Mooncake is not installed; pip install "
                "mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)"
            )
        self.segment_size = global_segment_size
        self.rpc_port = free_port()
        self.metadata_port = free_port()
        self._metrics_port = free_port()
        self._procs = _Processes("mooncake-")
        # Otherwise Mooncake advertises the machine's first non-loopback address.
        self._env = {"MC_TCP_BIND_ADDRESS": LOOPBACK}

    @property
    def metadata_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metadata_port}/metadata"

    @property
    def url(self) -> str:
        return f"mooncake://{LOOPBACK}:{self.rpc_port}?metadata={self.metadata_url}"

    def start(self) -> MooncakeServers:
        self.start_master()
        self.restart_storage_node()
        return self

    def start_master(self) -> None:
        self._procs.start(
            "master",
            [
                str(self._master_bin),
                f"--rpc_address={LOOPBACK}",
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={LOOPBACK}",
                f"--http_metadata_server_port={self.metadata_port}",
                f"--metrics_host={LOOPBACK}",
                f"--metrics_port={self._metrics_port}",
            ],
            self._env,
        )
        self._procs.wait_port("master", self.rpc_port)
        self._procs.wait_port("master", self.metadata_port)

    def restart_master(self) -> None:
        """SIGKILL and start again on the same ports: every value is gone, and the
        storage node mounts its segment again by itself."""
        self._procs.kill("master")
        self.start_master()

    def pause_master(self) -> None:
        """SIGSTOP: the master takes connections and never answers (a hung host).
        Returns once every thread of it is stopped: a signal is only queued when
        kill() returns, and on a busy machine the master may answer a call first."""
        self._procs.signal("master", signal.SIGSTOP)
        self._procs.wait_stopped("master")

    def resume_master(self) -> None:
        self._procs.signal("master", signal.SIGCONT)

    def kill_storage_node(self) -> None:
        """SIGKILL, as a machine that dies: the values it held are gone."""
        self._procs.kill("node")

    def restart_storage_node(self) -> None:
        self.kill_storage_node()
        port = free_port()
        self._procs.start(
            "node",
            [
                str(self._node_bin),
                f"--master_server_address={LOOPBACK}:{self.rpc_port}",
                f"--metadata_server={self.metadata_url}",
                "--protocol=tcp",
                f"--global_segment_size={self.segment_size}",
                f"--host={LOOPBACK}",
                f"--port={port}",
            ],
            self._env,
        )
        # It serves its port once its segment is mounted on the master.
        self._procs.wait_port("node", port)

    def stop(self) -> None:
        self._procs.kill_all()
        shutil.rmtree(self._procs.log_dir, ignore_errors=True)

    def __enter__(self) -> MooncakeServers:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RedisServer:
    """A `redis-server` on loopback without persistence; with `username` and
    `password`, that ACL user is the only one (the default user is off).
    `cluster=True` makes it a one-node cluster that owns every slot. It serves the
    `redis://` store, whose client (redis-py) must be installed too."""

    def __init__(
        self,
        username: str | None = None,
        password: str | None = None,
        maxmemory: str | None = None,
        cluster: bool = False,
        tls: bool = False,
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServerUnavailable(
                "redis-server is not installed; apt-get install redis-server"
            )
        if importlib.util.find_spec("redis") is None:
            raise ServerUnavailable(
                "the redis Python client is not installed; pip install redis"
            )
        self._binary = binary
        self._username = username
        self._password = password
        self._maxmemory = maxmemory
        self._cluster = cluster
        self._tls = tls
        if tls and shutil.which("openssl") is None:
            raise ServerUnavailable(
                "openssl is not installed (it makes the test certificates); "
                "apt-get install openssl"
            )
        self.port = free_port()
        self._procs = _Processes("redis-")

    @property
    def url(self) -> str:
        user = f"{self._username}@" if self._username else ""
        scheme = ("rediss" if self._tls else "redis") + (
            "+cluster" if self._cluster else ""
        )
        query = f"?ssl_ca_certs={self.ca_file}" if self._tls else ""
        return f"{scheme}://{user}{LOOPBACK}:{self.port}{query}"

    @property
    def ca_file(self) -> Path:
        """The CA that signed the server's certificate (with `tls=True`)."""
        return self._procs.log_dir / "ca.crt"

    def start(self) -> RedisServer:
        argv = [
            self._binary,
            "--port",
            "0" if self._tls else str(self.port),  # with TLS, no plain port
            "--bind",
            LOOPBACK,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._procs.log_dir),
        ]
        if self._username and self._password:
            argv += [
                "--user",
                "default",
                "off",
                "--user",
                self._username,
                "on",
                f">{self._password}",
                "~*",
                "&*",
                "+@all",
            ]
        if self._tls:
            self._make_certificates()
            folder = self._procs.log_dir
            argv += [
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(folder / "server.crt"),
                "--tls-key-file",
                str(folder / "server.key"),
                "--tls-ca-cert-file",
                str(self.ca_file),
                "--tls-auth-clients",
                "no",
            ]
        if self._maxmemory:
            argv += ["--maxmemory", self._maxmemory, "--maxmemory-policy", "noeviction"]
        if self._cluster:
            argv += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{self.port}.conf",
                # Else the bus takes port + 10000, which may be taken or past 65535.
                "--cluster-port",
                str(free_port()),
            ]
        self._procs.start("redis", argv, {})
        self._procs.wait_port("redis", self.port)
        if self._cluster:
            self._own_all_slots()
        return self

    def pause(self) -> None:
        """SIGSTOP: the server takes connections and never answers (a hung host)."""
        self._procs.signal("redis", signal.SIGSTOP)

    def resume(self) -> None:
        self._procs.signal("redis", signal.SIGCONT)

    def stop_server(self) -> None:
        """Stops the server only (`start()` brings it back on the same port)."""
        self._procs.kill("redis")

    def stop(self) -> None:
        self._procs.kill_all()
        shutil.rmtree(self._procs.log_dir, ignore_errors=True)

    def _make_certificates(self) -> None:
        """A CA and a server certificate for 127.0.0.1 that it signed."""
        folder = self._procs.log_dir
        if (folder / "server.crt").exists():
            return
        (folder / "san.ext").write_text(f"subjectAltName=IP:{LOOPBACK}\n")
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for argv in (
            ["req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=vllm-cpu-offload test CA"],
            ["req", *key, "-keyout", "server.key", "-out", "server.csr",
             "-subj", f"/CN={LOOPBACK}"],
            ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "2",
             "-extfile", "san.ext"],
        ):  # fmt: skip
            subprocess.run(
                ["openssl", *argv], cwd=folder, check=True, capture_output=True
            )

    def _own_all_slots(self) -> None:
        import redis

        client = redis.Redis(
            LOOPBACK, self.port, username=self._username, password=self._password
        )
        with client:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
            deadline = time.monotonic() + _READY_TIMEOUT_S
            while client.cluster("info")["cluster_state"] != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError("the one-node cluster did not become ok")
                time.sleep(0.05)

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
