"""Patch `engine_args_flags`: `--enable-cpu-offload`, `--swap-space` and
`--swap-space-path` on EngineArgs.

vLLM 0.32 and 0.33 have no extension point for engine flags, so this module wraps four
members of `EngineArgs` (and the dataclass `__init__` of `AsyncEngineArgs`), nothing
else:

- `__init__` accepts `enable_cpu_offload`, `swap_space` and `swap_space_path` (so
  `LLM(..., swap_space=8)` works);
- `add_cli_args` adds the flags to every parser vLLM builds (`vllm serve` included);
- `from_cli_args` copies them from the parsed namespace and validates them, printing a
  one-line error and exiting before anything starts;
- `create_engine_config` turns them into a `kv_transfer_config` naming our connector,
  and refuses what the host tier cannot serve (Mamba-style state; host blocks of several
  device blocks with windowed attention).

`check_vllm_version` refuses any vLLM but those this patch was written and tested for.

Flag semantics (also in the README):
- `--enable-cpu-offload` alone: a host tier of `DEFAULT_SWAP_SPACE_GIB` GiB per worker.
- `--swap-space N` without `--enable-cpu-offload`: an error. The flag sizes the host
  tier and turns nothing on by itself, so that vLLM with the package and no enable flag
  behaves exactly as vLLM without it. The same holds for `--swap-space-path DIR`, which
  keeps the tier in files in DIR that outlive the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
import weakref
from typing import Any

import psutil

from vllm_cpu_offload.config import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    DEFAULT_SWAP_SPACE_GIB,
    OffloadConfig,
    names_our_connector,
    parse_swap_space,
    parse_swap_space_path,
)
from vllm_cpu_offload.context_parallel import check_context_parallelism
from vllm_cpu_offload.errors import GIB, OffloadConfigError
from vllm_cpu_offload.layers import check_settings, layer_classes
from vllm_cpu_offload.scheduler.policies.registry import resolve_policy

# Every vLLM release the package is tested against (README: "Supported vLLM").
SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")
PATCH_NAME = "engine_args_flags"
_PATCHED_MARK = "_vllm_cpu_offload_patched"
# ids of the live EngineArgs that from_cli_args built: their errors end the
# process with one line, as argparse's do, instead of a traceback. Kept beside
# them, not as an attribute: scripts copy EngineArgs' attributes into new
# EngineArgs as keyword arguments.
_from_cli: set[int] = set()


def unsupported_vllm(version: str) -> str | None:
    """Why this vLLM version cannot take the patch (a one-line fix), or None when it
    can."""
    if version.split("+")[0] in SUPPORTED_VLLM_VERSIONS:
        return None
    return (
        f"vllm-cpu-offload supports vLLM {' and '.join(SUPPORTED_VLLM_VERSIONS)} but "
        f"vLLM {version} is installed; install vllm=={SUPPORTED_VLLM_VERSIONS[-1]} (or "
        f"vllm-cpu=={SUPPORTED_VLLM_VERSIONS[0]} on CPU-only machines)"
    )


def check_vllm_version(version: str) -> None:
    """Refuses any vLLM but those the patch was written and tested for."""
    reason = unsupported_vllm(version)
    if reason is not None:
        raise RuntimeError(f"patch {PATCH_NAME!r}: {reason}")


def resolve_offload(engine_args: Any) -> OffloadConfig | None:
    """Validates the offload settings of `engine_args`; returns None when offloading is
    off. Settings already validated are not validated again: the command line's
    `from_cli_args` and `create_engine_config` both ask, for the same settings.

    Raises OffloadConfigError for: --swap-space without --enable-cpu-offload, a bad
    size, a size over the host memory available, another KV connector, or vLLM's own
    --kv-offloading-size at the same time. An explicit kv_transfer_config that names our
    connector is validated here too, so that its errors also come before the engine
    starts.
    """
    settings = repr([getattr(engine_args, name, None) for name in _SETTINGS_READ])
    resolved = _resolved.get(id(engine_args))
    if resolved is not None and resolved[0] == settings:
        return resolved[1]
    config = _resolve_offload(engine_args)
    if resolved is None:
        weakref.finalize(engine_args, _resolved.pop, id(engine_args), None)
    _resolved[id(engine_args)] = (settings, config)
    return config


# What `resolve_offload` reads of the engine arguments, and what it resolved them to,
# by the arguments' id while they live. Not an attribute of theirs: vLLM's scripts
# build new arguments from `vars()` of old ones.
_resolved: dict[int, tuple[str, OffloadConfig | None]] = {}
_SETTINGS_READ = (
    "enable_cpu_offload",
    "swap_space",
    "swap_space_path",
    "swap_space_remote",
    "kv_transfer_config",
    "kv_offloading_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
)


def _refuse_without_enable(
    swap_space: object, swap_space_path: object, swap_space_remote: object
) -> None:
    """Each tier flag given without --enable-cpu-offload is an error."""
    if swap_space is not None:
        raise OffloadConfigError(
            "--swap-space sizes the host KV tier and needs --enable-cpu-offload; "
            "add --enable-cpu-offload or drop --swap-space"
        )
    if swap_space_path is not None:
        raise OffloadConfigError(
            "--swap-space-path keeps the host KV tier in files and needs "
            "--enable-cpu-offload; add --enable-cpu-offload or drop "
            "--swap-space-path"
        )
    if swap_space_remote is not None:
        raise OffloadConfigError(
            "--swap-space-remote puts a shared store behind the host KV tier and "
            "needs --enable-cpu-offload; add --enable-cpu-offload or drop "
            "--swap-space-remote"
        )


def _resolve_offload(engine_args: Any) -> OffloadConfig | None:
    enabled = bool(getattr(engine_args, "enable_cpu_offload", False))
    swap_space = getattr(engine_args, "swap_space", None)
    swap_space_path = getattr(engine_args, "swap_space_path", None)
    swap_space_remote = getattr(engine_args, "swap_space_remote", None)
    ktc = engine_args.kv_transfer_config
    names_ours = names_our_connector(ktc)
    if not enabled:
        _refuse_without_enable(swap_space, swap_space_path, swap_space_remote)
        if not names_ours:
            return None
        config = OffloadConfig.from_extra_config(ktc.kv_connector_extra_config)
    else:
        if ktc is not None and ktc.kv_connector is not None and not names_ours:
            raise OffloadConfigError(
                "--enable-cpu-offload cannot be combined with the KV connector "
                f"{ktc.kv_connector!r} of --kv-transfer-config; drop one of them"
            )
        base = (
            OffloadConfig.from_extra_config(ktc.kv_connector_extra_config)
            if names_ours
            else OffloadConfig()
        )
        gib = (
            parse_swap_space(swap_space)
            if swap_space is not None
            else base.swap_space_gib
        )
        path = (
            parse_swap_space_path(swap_space_path)
            if swap_space_path is not None
            else base.swap_space_path
        )
        url = swap_space_remote if swap_space_remote is not None else base.remote_url
        config = dataclasses.replace(
            base, swap_space_gib=gib, swap_space_path=path, remote_url=url
        )
    check_context_parallelism(
        int(getattr(engine_args, "prefill_context_parallel_size", 1) or 1),
        int(getattr(engine_args, "decode_context_parallel_size", 1) or 1),
    )
    if getattr(engine_args, "kv_offloading_size", None) is not None:
        raise OffloadConfigError(
            "--enable-cpu-offload cannot be combined with vLLM's own "
            "--kv-offloading-size; drop --kv-offloading-size"
        )
    # At least one copy of the tier per pipeline stage; how many in all depends on
    # the model (check_engine counts them).
    stages = int(engine_args.pipeline_parallel_size)
    # A bad policy name or class fails here, before the engine starts.
    resolve_policy(config.eviction_policy)
    # The settings of the tier's layers (the file tier's, the shared tier's).
    check_settings(config, ("swap_space_path", "remote_url"))
    check_fits_in_host_memory(config, stages, "pipeline stage(s)")
    return config


def available_host_memory_bytes() -> int:
    """Host memory that can be allocated now (MemAvailable), in bytes."""
    return int(psutil.virtual_memory().available)


def check_fits_in_host_memory(
    config: OffloadConfig, copies: int = 1, each: str = "worker(s)"
) -> None:
    """Refuses `copies` swap spaces larger than the host memory available now (with
    `swap_space_path`: larger than the space its file system has for the tier)."""
    wanted = config.swap_space_bytes * copies
    if any(cls.check_fits(config, wanted, copies, each) for cls in layer_classes()):
        return
    available = available_host_memory_bytes()
    if wanted > available:
        raise OffloadConfigError(
            f"--swap-space {config.swap_space_gib:g} GiB x {copies} {each} "
            f"exceeds the {available / GIB:.1f} GiB of host memory available; lower "
            "--swap-space"
        )


def host_tier_copies(vllm_config: Any, config: OffloadConfig) -> tuple[int, str]:
    """How many swap spaces the engine's workers allocate, and of what: one per
    worker, or what a layer decides (MLA: one per pipeline stage, whose ranks map one
    region, worker/region_layer.py)."""
    for cls in layer_classes():
        copies = cls.host_copies(vllm_config, config)
        if copies is not None:
            return copies
    parallel = vllm_config.parallel_config
    stages = int(parallel.pipeline_parallel_size)
    return int(parallel.tensor_parallel_size) * stages, "worker(s)"


def check_engine(vllm_config: Any, config: OffloadConfig) -> None:
    """Refuses, before the engine starts, a tier larger than the host memory for the
    copies the engine allocates, a model whose state the host tier cannot hold and a
    host block size the engine's KV cache cannot take.

    Mamba and other state-space layers keep one running state per request instead of KV
    blocks per token; the host tier and the shared store hold blocks only. Full,
    sliding-window and chunked local attention are served by both tiers. Host blocks
    of several device blocks need full attention: a window group releases device
    blocks one at a time.
    """
    check_fits_in_host_memory(config, *host_tier_copies(vllm_config, config))
    model_config = vllm_config.model_config
    k = config.blocks_per_host_block(vllm_config.cache_config.block_size)
    windowed = getattr(model_config.hf_text_config, "sliding_window", None) or getattr(
        model_config.hf_text_config, "attention_chunk_size", None
    )
    if (
        k > 1
        and windowed
        and not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    ):
        raise OffloadConfigError(
            f"offload_block_size {config.offload_block_size} needs full attention, but "
            f"{model_config.model} has sliding-window or chunked attention layers; "
            "drop offload_block_size"
        )
    for cls in layer_classes():
        cls.check_engine(vllm_config, config)
    if model_config.is_attention_free or model_config.is_hybrid:
        kind = (
            "attention-free" if model_config.is_attention_free else "hybrid state-space"
        )
        raise OffloadConfigError(
            f"--enable-cpu-offload holds attention KV blocks, but {model_config.model} "
            f"is a {kind} (Mamba-style) model; drop --enable-cpu-offload"
        )


def _kv_transfer_config_for(config: OffloadConfig, previous: Any) -> Any:
    # vLLM is imported on use only, here and below: the import hook loads this module
    # while vLLM itself is still being imported.
    from vllm.config.kv_transfer import KVTransferConfig

    extra = dict(previous.kv_connector_extra_config) if previous is not None else {}
    extra.update(config.to_extra_config())
    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        # The host tier is a cache: a load that fails is a miss that vLLM recomputes,
        # never a failed request (vLLM's default policy fails the request).
        kv_load_failure_policy="recompute",
    )


def _add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "CPU offload", "A second KV-cache tier in host memory (vllm-cpu-offload)."
    )
    group.add_argument(
        "--enable-cpu-offload",
        action="store_true",
        default=False,
        help="Keep KV blocks evicted from device memory in host memory and load them "
        "back instead of recomputing them. Host size: --swap-space (default "
        f"{DEFAULT_SWAP_SPACE_GIB:g} GiB).",
    )
    group.add_argument(
        "--swap-space",
        type=str,
        default=None,
        help="Host memory for offloaded KV blocks, in GiB per worker (per engine "
        "for MLA models, whose KV every rank holds alike). Needs --enable-cpu-offload.",
    )
    group.add_argument(
        "--swap-space-path",
        type=str,
        default=None,
        help="Keep the host KV tier in memory-mapped files in this directory (e.g. on "
        "/dev/shm, or a local disk to survive reboots), so that a restarted engine "
        "with the "
        "same model and layout serves the blocks. Needs --enable-cpu-offload.",
    )
    group.add_argument(
        "--swap-space-remote",
        type=str,
        default=None,
        help="A KV store shared by every engine, behind host memory: "
        "mooncake://MASTER:PORT (Mooncake Store), redis://HOST:PORT or "
        "rediss://HOST:PORT (Redis, Valkey; password from "
        "VLLM_CPU_OFFLOAD_REMOTE_PASSWORD). Needs --enable-cpu-offload.",
    )


def applied() -> bool:
    """Whether apply() has patched vLLM in this process."""
    from vllm.engine.arg_utils import EngineArgs

    return bool(getattr(EngineArgs, _PATCHED_MARK, False))


def apply() -> None:
    """Applies the patch once per process; safe to call again."""
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    check_vllm_version(vllm.__version__)
    if getattr(EngineArgs, _PATCHED_MARK, False):
        return

    for cls in (EngineArgs, AsyncEngineArgs):
        cls.__init__ = _wrap_init(cls.__init__)  # type: ignore[method-assign]
    _patch_command_line(EngineArgs)
    _patch_create_engine_config(EngineArgs)
    setattr(EngineArgs, _PATCHED_MARK, True)


def _patch_command_line(engine_args_cls: Any) -> None:
    """The flags in vLLM's parser, and their values checked as they are parsed."""
    original_add = engine_args_cls.add_cli_args

    def add_cli_args(parser: Any) -> Any:
        parser = original_add(parser)
        if not any("--enable-cpu-offload" in a.option_strings for a in parser._actions):
            _add_flags(parser)
        return parser

    engine_args_cls.add_cli_args = staticmethod(add_cli_args)

    original_from_cli = engine_args_cls.from_cli_args.__func__

    def from_cli_args(cls: Any, args: argparse.Namespace) -> Any:
        engine_args = original_from_cli(cls, args)
        engine_args.enable_cpu_offload = bool(
            getattr(args, "enable_cpu_offload", False)
        )
        engine_args.swap_space = getattr(args, "swap_space", None)
        engine_args.swap_space_path = getattr(args, "swap_space_path", None)
        engine_args.swap_space_remote = getattr(args, "swap_space_remote", None)
        _from_cli.add(id(engine_args))
        weakref.finalize(engine_args, _from_cli.discard, id(engine_args))
        try:
            resolve_offload(engine_args)
        except OffloadConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return engine_args

    engine_args_cls.from_cli_args = classmethod(from_cli_args)


def _patch_create_engine_config(engine_args_cls: Any) -> None:
    """The connector's config from the flags, and the engine checked once vLLM's
    config exists."""
    original_create = engine_args_cls.create_engine_config

    @functools.wraps(original_create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = resolve_offload(self)
        if config is not None:
            self.kv_transfer_config = _kv_transfer_config_for(
                config, self.kv_transfer_config
            )
        with _vllms_own_flags_off(self, config is not None):
            vllm_config = original_create(self, *args, **kwargs)
        if config is not None:
            try:
                check_engine(vllm_config, config)
            except OffloadConfigError as e:
                if id(self) not in _from_cli:
                    raise
                # From the command line: one line and exit, as from_cli_args does.
                print(f"error: {e}", file=sys.stderr)
                raise SystemExit(2) from None
        return vllm_config

    engine_args_cls.create_engine_config = create_engine_config


# Flags a vLLM may declare itself with the same spelling (the upstream series' [8/8]
# makes them a spelling of --kv-offloading-size), and the value that turns each off.
_VLLM_SPELLINGS = {"enable_cpu_offload": False, "swap_space": None}


@contextlib.contextmanager
def _vllms_own_flags_off(engine_args: Any, plugin_serves: bool) -> Any:
    """While the plugin serves the flags, a vLLM that reads them too (as fields of
    its own EngineArgs) sees them off, so that it does not also turn on its own
    OffloadingConnector, whose class name would land on the plugin's module."""
    own = (
        {f.name for f in dataclasses.fields(type(engine_args))} if plugin_serves else ()
    )
    saved = {n: getattr(engine_args, n) for n in _VLLM_SPELLINGS if n in own}
    for name in saved:
        setattr(engine_args, name, _VLLM_SPELLINGS[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(engine_args, name, value)


def _wrap_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(
        self: Any,
        *args: Any,
        enable_cpu_offload: bool = False,
        swap_space: float | str | None = None,
        swap_space_path: str | None = None,
        swap_space_remote: str | None = None,
        **kwargs: Any,
    ) -> None:
        original(self, *args, **kwargs)
        self.enable_cpu_offload = enable_cpu_offload
        self.swap_space = swap_space
        self.swap_space_path = swap_space_path
        self.swap_space_remote = swap_space_remote

    return __init__
