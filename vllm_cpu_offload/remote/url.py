"""`--swap-space-remote URL`: the store behind the host tier, parsed once, before the
engine starts.

The forms:
- `mooncake://HOST:PORT`: a Mooncake Store master. Its HTTP metadata server is taken
  to be on the master's host at Mooncake's default port 8080 unless
  `?metadata=http://H:P/metadata` says otherwise; TCP unless `?protocol=rdma` (with
  `&device=mlx5_0`); `?local_hostname=ADDR` is the address the storage nodes reach
  this engine at (by default the one that routes to the master).
- `redis://[USER@]HOST:PORT[/DB]`, `rediss://...` (TLS, `?ssl_ca_certs=PATH`), and
  `redis+cluster://` / `rediss+cluster://` for a Redis (or Valkey) cluster.
- a scheme an installed distribution registers as an entry point of the group
  `vllm_cpu_offload.remote_stores`, or `py://my_pkg.module:MyStore?...`: a user's
  backend (`registry.py` resolves it; its options are its own).

A password never travels in the URL (it would show in `ps` and the logs): it comes
from `VLLM_CPU_OFFLOAD_REMOTE_PASSWORD` or a file named by
`VLLM_CPU_OFFLOAD_REMOTE_PASSWORD_FILE`. Every bad input raises `OffloadConfigError`
with one line that names the fix. Imports the standard library only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib.metadata import entry_points
from urllib.parse import SplitResult, parse_qsl, urlsplit

from vllm_cpu_offload.errors import OffloadConfigError

ENTRY_POINT_GROUP = "vllm_cpu_offload.remote_stores"
PASSWORD_ENV = "VLLM_CPU_OFFLOAD_REMOTE_PASSWORD"
PASSWORD_FILE_ENV = "VLLM_CPU_OFFLOAD_REMOTE_PASSWORD_FILE"
MOONCAKE_METADATA_PORT = 8080
# "user:password@" after the scheme (or at the start of a URL without one).
_USER_PART = re.compile(
    r"^([^/?#]*//)?[^/?#@]*@"
)  # mooncake_master --http_metadata_server_port default

MOONCAKE_SCHEMES = ("mooncake",)
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
USER_CLASS_SCHEME = "py"

# The options each built-in scheme accepts; anything else is refused, not ignored.
_OPTIONS: dict[str, frozenset[str]] = {
    "mooncake": frozenset({"metadata", "protocol", "device", "local_hostname"}),
    "redis": frozenset(),
    "rediss": frozenset({"ssl_ca_certs"}),
}


@dataclass(frozen=True)
class RemoteUrl:
    """A parsed store URL. `host` of a `py://` URL is the class's import path and
    `port` is None; `options` are the query's pairs in order, each name once."""

    scheme: str
    host: str
    port: int | None
    options: tuple[tuple[str, str], ...] = ()
    username: str | None = None
    db: int = 0

    def option(self, name: str, default: str | None = None) -> str | None:
        for key, value in self.options:
            if key == name:
                return value
        return default

    @property
    def is_cluster(self) -> bool:
        return self.scheme.endswith("+cluster")

    @property
    def is_tls(self) -> bool:
        return self.scheme.startswith("rediss")

    def __str__(self) -> str:
        """The URL as the log shows it (it never holds a secret)."""
        user = f"{self.username}@" if self.username else ""
        where = self.host if self.port is None else f"{self.host}:{self.port}"
        db = f"/{self.db}" if self.db else ""
        query = "&".join(f"{k}={v}" for k, v in self.options)
        return f"{self.scheme}://{user}{where}{db}" + (f"?{query}" if query else "")


def parse_remote_url(url: str) -> RemoteUrl:
    """The `RemoteUrl` that `url` stands for; see the module docstring for the forms."""
    if not isinstance(url, str) or "://" not in url:
        raise _error(
            url, "is not a URL; write e.g. mooncake://HOST:PORT or redis://HOST:PORT"
        )
    if any(c.isspace() for c in url):
        raise _error(url, "contains whitespace; remove it")
    scheme = url.partition("://")[0].lower()
    if scheme == USER_CLASS_SCHEME:
        return _parse_user_class(url)
    known = (*MOONCAKE_SCHEMES, *REDIS_SCHEMES)
    plugins = registered_schemes()
    if scheme not in known and scheme not in plugins:
        names = ", ".join([*known, *plugins, USER_CLASS_SCHEME])
        raise _error(
            url,
            f"has an unknown scheme {scheme!r}; use one of: {names} "
            "(py://my_pkg.module:MyStore names a class of your own)",
        )
    parts = urlsplit(url)
    if parts.password is not None:
        raise _error(
            url,
            f"holds a password; remove it from the URL and set "
            f"{PASSWORD_ENV} or {PASSWORD_FILE_ENV} instead",
        )
    host, port = _host_port(url, parts)
    options = _options(url, parts.query)
    if scheme in plugins and scheme not in known:
        # A plugin's URL: its path and options are the plugin's to judge.
        return RemoteUrl(scheme, host, port, options, parts.username)
    if port is None:
        default = "6379" if scheme in REDIS_SCHEMES else "50051"
        raise _error(url, f"has no port; write {scheme}://{host}:{default}")
    if scheme in MOONCAKE_SCHEMES:
        _check_mooncake(url, parts, options)
        return RemoteUrl(scheme, host, port, options)
    db = _check_redis(url, scheme, parts, options)
    return RemoteUrl(scheme, host, port, options, parts.username or None, db)


def registered_schemes() -> list[str]:
    """The schemes installed distributions register as remote store backends."""
    return sorted({e.name.lower() for e in entry_points(group=ENTRY_POINT_GROUP)})


def remote_password() -> str | None:
    """The store's password from the environment or the file it names, or None."""
    value = os.environ.get(PASSWORD_ENV)
    path = os.environ.get(PASSWORD_FILE_ENV)
    if value and path:
        raise OffloadConfigError(
            f"both {PASSWORD_ENV} and {PASSWORD_FILE_ENV} are set; unset one of them"
        )
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read().strip()
        except OSError as e:
            raise OffloadConfigError(
                f"{PASSWORD_FILE_ENV}={path!r} cannot be read ({e.strerror}); point it "
                "at a readable file that holds the password"
            ) from None
        if not value:
            raise OffloadConfigError(
                f"{PASSWORD_FILE_ENV}={path!r} is empty; write the password into it"
            )
    return value or None


def _parse_user_class(url: str) -> RemoteUrl:
    target, _, query = url.partition("://")[2].partition("?")
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr or "/" in target:
        raise _error(url, "does not name a class; write py://my_pkg.module:MyStore")
    return RemoteUrl(USER_CLASS_SCHEME, target, None, _options(url, query))


def _host_port(url: str, parts: SplitResult) -> tuple[str, int | None]:
    try:
        port = parts.port
    except ValueError:
        raise _error(
            url, "has a bad port; write a number from 1 to 65535 after the host"
        ) from None
    host = parts.hostname
    if not host:
        raise _error(url, f"has no host; write {parts.scheme}://HOST:PORT")
    if port == 0:
        raise _error(url, "has port 0; write the port the server listens on")
    return host, port


def _options(url: str, query: str) -> tuple[tuple[str, str], ...]:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise _error(
            url, "has a malformed query; write ?name=value&name=value"
        ) from None
    seen: set[str] = set()
    for name, value in pairs:
        if name in seen:
            raise _error(url, f"sets option {name!r} twice; keep one")
        if not value:
            raise _error(url, f"gives option {name!r} no value; write {name}=VALUE")
        seen.add(name)
    return tuple(pairs)


def _check_known_options(
    url: str, allowed: frozenset[str], options: tuple[tuple[str, str], ...]
) -> None:
    for name, _ in options:
        if name not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise _error(url, f"has unknown option {name!r}; allowed here: {known}")


def _check_mooncake(
    url: str, parts: SplitResult, options: tuple[tuple[str, str], ...]
) -> None:
    if parts.username is not None:
        raise _error(
            url,
            "names a user, but Mooncake has no authentication; remove "
            "it and keep the store on a private network",
        )
    if parts.path not in ("", "/"):
        raise _error(url, "has a path; write mooncake://HOST:PORT")
    _check_known_options(url, _OPTIONS["mooncake"], options)
    given = dict(options)
    protocol = given.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise _error(
            url, f"has protocol={protocol}; write protocol=tcp or protocol=rdma"
        )
    if "device" in given and protocol != "rdma":
        raise _error(
            url,
            "names a device without protocol=rdma; add protocol=rdma or remove device",
        )
    metadata = given.get("metadata")
    if metadata is not None:
        meta = urlsplit(metadata)
        if meta.scheme not in ("http", "https") or not meta.hostname:
            raise _error(
                url,
                f"has metadata={metadata}; write metadata=http://HOST:PORT/metadata",
            )


def _check_redis(
    url: str, scheme: str, parts: SplitResult, options: tuple[tuple[str, str], ...]
) -> int:
    tls = scheme.startswith("rediss")
    _check_known_options(url, _OPTIONS["rediss" if tls else "redis"], options)
    ca = dict(options).get("ssl_ca_certs")
    if ca is not None and not os.path.isfile(ca):
        raise _error(
            url,
            f"has ssl_ca_certs={ca}, which is not a file; name the CA bundle's path",
        )
    path = parts.path.strip("/")
    if not path:
        return 0
    if scheme.endswith("+cluster"):
        raise _error(
            url, "names a database, but a cluster has only database 0; remove the path"
        )
    if not path.isdigit():
        raise _error(
            url,
            f"has path /{path}; write a database number, e.g. {scheme}://HOST:PORT/0",
        )
    return int(path)


def _error(url: object, problem: str) -> OffloadConfigError:
    # A refused URL may hold a password: its user part is never shown.
    shown = _USER_PART.sub(r"\1***@", url) if isinstance(url, str) else repr(url)
    return OffloadConfigError(f"--swap-space-remote {shown} {problem}")
