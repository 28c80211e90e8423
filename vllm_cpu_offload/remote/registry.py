"""Remote stores by URL: the built-ins, entry points, and classes named by import path.

`check_remote_url(url)` validates a `--swap-space-remote` URL without connecting
(before the engine starts); `open_store(url, role=...)` builds the store. The backend
comes from the URL's scheme:
- `mooncake`: `MooncakeRemoteStore`; `redis`, `rediss`, `redis+cluster`,
  `rediss+cluster`: `RedisRemoteStore` (each needs its client library, an extra of
  this package);
- a scheme that an installed distribution declares in the entry point group
  `vllm_cpu_offload.remote_stores` (`s3 = "my_pkg.stores:S3Store"`);
- `py://my_pkg.module:MyStore?...`: that class.

A backend class subclasses `RemoteStore` and is built as `cls(url, role=role)`, where
`url` is the parsed `RemoteUrl` and `role` is "scheduler" (the scheduler's process:
`exists` only) or "worker" (it moves bytes and registers its host memory). Bad input
raises `OffloadConfigError` with one line that names the fix. This module imports no
backend it is not asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib.metadata import entry_points

from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.user_classes import checked_subclass, import_attribute

from .store import RemoteStore
from .url import (
    ENTRY_POINT_GROUP,
    MOONCAKE_SCHEMES,
    REDIS_SCHEMES,
    USER_CLASS_SCHEME,
    RemoteUrl,
    parse_remote_url,
    remote_password,
)
from .value_format import CHECKSUM_MODULE

ROLES = ("scheduler", "worker")

# Built-in backends, one line each: their URL schemes and "module:class". A class
# names the client library it needs (imported when it connects) and the extra that
# installs it.
_BACKENDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (MOONCAKE_SCHEMES, f"{__package__}.mooncake_store:MooncakeRemoteStore"),
    (REDIS_SCHEMES, f"{__package__}.redis_store:RedisRemoteStore"),
)
_BUILTINS = {scheme: path for schemes, path in _BACKENDS for scheme in schemes}


def check_remote_url(url: str) -> tuple[type[RemoteStore], RemoteUrl]:
    """The backend class and parsed URL that `url` stands for, checked as far as can
    be without connecting: the form, the class, its client library, the password."""
    parsed = parse_remote_url(url)
    if importlib.util.find_spec(CHECKSUM_MODULE) is None:
        raise OffloadConfigError(
            f"--swap-space-remote checks every value with CRC-32C and needs the "
            f"{CHECKSUM_MODULE!r} module; pip install google-crc32c"
        )
    if parsed.scheme in _BUILTINS:
        cls = _checked(url, _import(_BUILTINS[parsed.scheme], url))
        library = cls.client_library
        if library and importlib.util.find_spec(library.partition(".")[0]) is None:
            raise OffloadConfigError(
                f"--swap-space-remote {parsed.scheme}:// needs the {library!r} "
                f"module; pip install 'vllm-cpu-offload[{cls.install_extra}]'"
            )
        if parsed.scheme in REDIS_SCHEMES:
            remote_password()  # a missing or unreadable password file fails here
        return cls, parsed
    if parsed.scheme == USER_CLASS_SCHEME:
        return _checked(url, _import(parsed.host, url)), parsed
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name.lower() == parsed.scheme:
            try:
                loaded = entry.load()
            except Exception as e:  # noqa: BLE001 - any import failure is the user's
                raise OffloadConfigError(
                    f"--swap-space-remote {parsed.scheme}://: entry point "
                    f"{entry.value!r} of group {ENTRY_POINT_GROUP} failed to load "
                    f"({type(e).__name__}: {e}); fix or reinstall the package that "
                    "declares it"
                ) from None
            return _checked(url, loaded), parsed
    raise AssertionError(f"parse_remote_url accepted an unknown scheme: {url}")


def open_store(url: str, *, role: str) -> RemoteStore:
    """The store `url` names, built for `role` ("scheduler" or "worker"). It does not
    wait for the store: one that is down now connects when it comes up."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    cls, parsed = check_remote_url(url)
    return cls(parsed, role=role)  # type: ignore[call-arg]


def _import(path: str, url: str) -> object:
    module_name, _, attr = path.partition(":")
    return import_attribute(module_name, attr, f"--swap-space-remote {url}")


def _checked(url: str, obj: object) -> type[RemoteStore]:
    return checked_subclass(
        obj,
        RemoteStore,
        RemoteStore.__module__,
        f"--swap-space-remote {url}",
        "method",
    )
