"""Eviction policies by name: the built-ins, entry points, and classes named by import
path.

`eviction_policy` in the connector's extra config takes any of:
- a built-in name, `prefix_aware` and `lru` among them (`BUILTIN_POLICIES` below,
  the one list);
- the name of an entry point in the group `vllm_cpu_offload.eviction_policies`, which
  any installed distribution may declare (`fifo = "my_pkg.policies:FIFOPolicy"`);
- an import path, `my_pkg.policies:FIFOPolicy` (or `my_pkg.policies.FIFOPolicy`).

The class must subclass `EvictionPolicy` and implement its abstract hooks. Resolving a
bad name raises `OffloadConfigError` with one line that names the fix, before the engine
starts. This module imports neither vLLM nor a policy it is not asked for.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.user_classes import checked_subclass, import_attribute

from .base import EvictionPolicy

ENTRY_POINT_GROUP = "vllm_cpu_offload.eviction_policies"

# The built-in policies, registered here and nowhere else, as module:class paths
# in this package.
BUILTIN_POLICIES: dict[str, str] = {
    "prefix_aware": f"{__package__}.prefix_aware:PrefixAwarePolicy",
    "lru": f"{__package__}.lru:LRUPolicy",
    "arc": f"{__package__}.arc:ARCPolicy",
    "lirs": f"{__package__}.lirs:LIRSPolicy",
    "s3fifo": f"{__package__}.s3fifo:S3FIFOPolicy",
}


def resolve_policy(name: str) -> type[EvictionPolicy]:
    """The policy class `name` stands for; see the module docstring for the forms."""
    if not isinstance(name, str) or not name:
        raise OffloadConfigError(
            f"eviction_policy must be a name or an import path, got {name!r}"
        )
    if name in BUILTIN_POLICIES:
        return _checked(name, _import(BUILTIN_POLICIES[name], name))
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            try:
                loaded = entry.load()
            except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
                raise OffloadConfigError(
                    f"eviction_policy {name!r}: entry point {entry.value!r} of group "
                    f"{ENTRY_POINT_GROUP} failed to load ({type(e).__name__}: {e}); "
                    "fix or reinstall the package that declares it"
                ) from None
            return _checked(name, loaded)
    if "." in name or ":" in name:
        return _checked(name, _import(name, name))
    known = ", ".join(available_policy_names())
    raise OffloadConfigError(
        f"eviction_policy {name!r} is not known; choose one of: {known}, or name a "
        "policy class by import path ('my_pkg.module:MyPolicy')"
    )


def available_policy_names() -> list[str]:
    """Built-in names first, then the entry points installed now."""
    names = list(BUILTIN_POLICIES)
    names += sorted(
        e.name for e in entry_points(group=ENTRY_POINT_GROUP) if e.name not in names
    )
    return names


def _import(path: str, name: str) -> object:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise OffloadConfigError(
            f"eviction_policy {name!r} is not an import path; write it as "
            "'my_pkg.module:MyPolicy'"
        )
    return import_attribute(module_name, attr, f"eviction_policy {name!r}")


def _checked(name: str, obj: object) -> type[EvictionPolicy]:
    return checked_subclass(
        obj, EvictionPolicy, str(__package__), f"eviction_policy {name!r}", "hook"
    )


POLICY_NAMES: tuple[str, ...] = tuple(BUILTIN_POLICIES)


def make_policy(name: str, num_blocks: int) -> EvictionPolicy:
    """Builds the policy `name` (a built-in, an entry point or an import path) for a
    pool of `num_blocks` blocks.

    Raises:
        OffloadConfigError: `name` names no usable policy; the message says what to fix.

    """
    return resolve_policy(name)(num_blocks)
