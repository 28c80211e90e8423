"""A user's class named by import path, resolved with one-line errors that name the
fix: eviction policies (`eviction_policy`) and store backends (`--swap-space-remote
py://...`) alike. Imports the standard library only.
"""

from __future__ import annotations

import importlib
import inspect

from vllm_cpu_offload.errors import OffloadConfigError


def import_attribute(module_name: str, attr: str, what: str) -> object:
    """`module_name.attr`; `what` names the setting in the error (e.g. "eviction_policy
    'x'")."""
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
        raise OffloadConfigError(
            f"{what}: cannot import module {module_name!r} "
            f"({type(e).__name__}: {e}); install it or fix the path"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise OffloadConfigError(
            f"{what}: module {module_name!r} has no {attr!r}; fix the path"
        ) from None


def checked_subclass(
    obj: object, base: type, where: str, what: str, members: str
) -> type:
    """`obj`, if it is a concrete subclass of `base` (importable from `where`);
    `members` names what a subclass implements ("hook", "method") in the error."""
    if not (inspect.isclass(obj) and issubclass(obj, base)):
        raise OffloadConfigError(
            f"{what} names {obj!r}, which is not a subclass of "
            f"{where}.{base.__name__}; subclass it"
        )
    missing = sorted(getattr(obj, "__abstractmethods__", ()))
    if missing:
        raise OffloadConfigError(
            f"{what}: {obj.__qualname__} does not implement {', '.join(missing)}; "
            f"implement every abstract {members} of {base.__name__}"
        )
    return obj
