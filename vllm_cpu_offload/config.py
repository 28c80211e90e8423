"""The host tier's configuration: one frozen dataclass, parsed once at the boundary.

Both routes end here: the `--enable-cpu-offload` / `--swap-space` flags and an explicit
`--kv-transfer-config` that names our connector with its `kv_connector_extra_config`.
Bad values raise `OffloadConfigError` (a `ValueError`) with a one-line message that
names the fix. This module does not import vLLM.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_cpu_offload.errors import GIB, OffloadConfigError

CONNECTOR_NAME = "CPUOffloadConnector"
CONNECTOR_MODULE = "vllm_cpu_offload.connector"

# The size `--swap-space` had in vLLM before it was removed; used when only
# `--enable-cpu-offload` is given.
DEFAULT_SWAP_SPACE_GIB = 4.0

# Also any policy class by entry point or import path: scheduler/policies/registry.py.
DEFAULT_EVICTION_POLICY = "prefix_aware"

# How a CUDA worker copies blocks: Triton kernels, the copy engines (DMA), whole blocks
# through device staging (staged), or the engine's pick by run length. The CPU platform
# always copies with torch views.
COPY_BACKENDS = ("auto", "triton", "dma", "staged")
DEFAULT_COPY_BACKEND = "auto"

# Every call to a shared store is bounded by this (lookups, writes, fetches): a store
# that does not answer in time costs a miss. Generous for a loaded loopback store.
DEFAULT_REMOTE_TIMEOUT_S = 2.0

# Host hits of at least this many tokens load across steps while other requests run
# (the request waits, they do not) when `async_load_tokens` is not set. Measured on CPU:
# docs/design.md, "Loads that span steps".
DEFAULT_ASYNC_LOAD_TOKENS = 4096

# How the shared store holds sharded attention's blocks: one value per KV head (any TP
# size reads them), or one per rank (only engines of the writer's TP size do; fewer,
# larger values for a fleet of one TP size). kv_shards.py.
REMOTE_VALUES = ("per_head", "per_rank")
DEFAULT_REMOTE_VALUES = "per_head"

# Requests' `retain` hints keep at most this share of the host tier from eviction
# (scheduler/retention.py), each for at most `max_retain_s` seconds. A quarter, not
# half: replayed (benchmarks/hint_replay.py), half cost the requests without hints
# 6-7% of their hits on the agent workload at 4k-8k host blocks, a quarter at most
# 1.2%, and still doubled the best hindsight rule's share on the conversation trace.
DEFAULT_RETAIN_SHARE = 0.25
DEFAULT_MAX_RETAIN_S = 3600.0


def names_our_connector(kv_transfer_config: Any) -> bool:
    """Whether a vLLM `kv_transfer_config` (or None) selects this connector."""
    return (
        kv_transfer_config is not None
        and kv_transfer_config.kv_connector == CONNECTOR_NAME
    )


@dataclass(frozen=True)
class OffloadConfig:
    """What the host tier needs to know, validated.

    Attributes:
        swap_space_gib: host memory for offloaded KV blocks, per worker, in GiB.
        eviction_policy: the host tier's eviction policy: a built-in name, an entry
            point name, or a policy class by import path
            (scheduler/policies/registry.py).
        copy_backend: how CUDA workers copy blocks (see `COPY_BACKENDS`).
        offload_block_size: tokens per host block, a multiple of vLLM's block size (a
            host block then holds that many device blocks); None: vLLM's block size.
        swap_space_path: a directory where the host tier lives in memory-mapped files
            with its index, so that a restarted engine serves the blocks (persist/);
            None: the tier is anonymous memory, lost with the engine.
        remote_url: a store shared by every engine behind host memory (remote/):
            `mooncake://`, `redis://`, `rediss://` or a user's backend; None: none.
        remote_timeout_s: the bound of every call to that store, in seconds.
        async_load_tokens: host hits of at least this many tokens load across steps
            while other requests run, as a shared store's hits do: the request waits in
            vLLM's waiting-for-remote-KV state, the others go on; 0: every host hit
            loads inside its step.
        remote_values: how the shared store holds sharded attention's blocks
            (`REMOTE_VALUES`): per KV head, so that engines of any TP size read them,
            or per rank, for a fleet of one TP size.
        retain_share: the share of the host tier that requests' `retain` hints may
            keep from eviction (0: hints to retain are ignored).
        max_retain_s: the longest a `retain` hint keeps blocks, in seconds.
        weights_id: the operator's name for the weights this engine loads, for the
            shared and file tiers (`kv_identity`): engines that give the same name
            share KV as if their weights were proven equal. None: the tiers share
            only what they can prove.

    """

    swap_space_gib: float = DEFAULT_SWAP_SPACE_GIB
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    copy_backend: str = DEFAULT_COPY_BACKEND
    offload_block_size: int | None = None
    swap_space_path: str | None = None
    remote_url: str | None = None
    remote_timeout_s: float = DEFAULT_REMOTE_TIMEOUT_S
    async_load_tokens: int = DEFAULT_ASYNC_LOAD_TOKENS
    retain_share: float = DEFAULT_RETAIN_SHARE
    max_retain_s: float = DEFAULT_MAX_RETAIN_S
    remote_values: str = DEFAULT_REMOTE_VALUES
    weights_id: str | None = None

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space_gib * GIB)

    def to_extra_config(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "swap_space_gib": self.swap_space_gib,
            "eviction_policy": self.eviction_policy,
            "copy_backend": self.copy_backend,
        }
        if self.offload_block_size is not None:
            extra["offload_block_size"] = self.offload_block_size
        if self.swap_space_path is not None:
            extra["swap_space_path"] = self.swap_space_path
        if self.remote_url is not None:
            extra["remote_url"] = self.remote_url
        if self.remote_timeout_s != DEFAULT_REMOTE_TIMEOUT_S:
            extra["remote_timeout_s"] = self.remote_timeout_s
        if self.async_load_tokens != DEFAULT_ASYNC_LOAD_TOKENS:
            extra["async_load_tokens"] = self.async_load_tokens
        if self.retain_share != DEFAULT_RETAIN_SHARE:
            extra["retain_share"] = self.retain_share
        if self.max_retain_s != DEFAULT_MAX_RETAIN_S:
            extra["max_retain_s"] = self.max_retain_s
        if self.remote_values != DEFAULT_REMOTE_VALUES:
            extra["remote_values"] = self.remote_values
        if self.weights_id is not None:
            extra["weights_id"] = self.weights_id
        return extra

    def blocks_per_host_block(self, block_size: int) -> int:
        """Device blocks of `block_size` tokens in one host block; refuses a size that
        is not a multiple of it."""
        size = self.offload_block_size
        if size is None or size == block_size:
            return 1
        if size % block_size:
            raise OffloadConfigError(
                f"offload_block_size {size} is not a multiple of the block size "
                f"{block_size}; set offload_block_size to a multiple of {block_size} "
                f"(e.g. {2 * block_size})"
            )
        return size // block_size

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> OffloadConfig:
        """Parses `kv_connector_extra_config`; unknown keys and bad values raise."""
        extra = dict(extra or {})
        allowed = (
            "swap_space_gib",
            "eviction_policy",
            "copy_backend",
            "offload_block_size",
            "swap_space_path",
            "remote_url",
            "remote_timeout_s",
            "async_load_tokens",
            "retain_share",
            "max_retain_s",
            "remote_values",
            "weights_id",
        )
        unknown = sorted(set(extra) - set(allowed))
        if unknown:
            raise OffloadConfigError(
                f"unknown key(s) {', '.join(map(repr, unknown))} in "
                f"kv_connector_extra_config of {CONNECTOR_NAME}; allowed keys: "
                f"{', '.join(allowed)}"
            )
        swap = parse_swap_space(
            extra.get("swap_space_gib", DEFAULT_SWAP_SPACE_GIB), "swap_space_gib"
        )
        policy = extra.get("eviction_policy", DEFAULT_EVICTION_POLICY)
        if not isinstance(policy, str) or not policy:
            raise OffloadConfigError(
                f"eviction_policy must be a name or an import path, got {policy!r}"
            )
        backend = extra.get("copy_backend", DEFAULT_COPY_BACKEND)
        if backend not in COPY_BACKENDS:
            raise OffloadConfigError(
                f"copy_backend {backend!r} is not known; choose one of: "
                f"{', '.join(COPY_BACKENDS)}"
            )
        size = extra.get("offload_block_size")
        path = extra.get("swap_space_path")
        url = extra.get("remote_url")
        timeout = extra.get("remote_timeout_s", DEFAULT_REMOTE_TIMEOUT_S)
        threshold = extra.get("async_load_tokens", DEFAULT_ASYNC_LOAD_TOKENS)
        _check_numbers(size, url, timeout, threshold)
        share = extra.get("retain_share", DEFAULT_RETAIN_SHARE)
        longest = extra.get("max_retain_s", DEFAULT_MAX_RETAIN_S)
        _check_retention(share, longest)
        values = extra.get("remote_values", DEFAULT_REMOTE_VALUES)
        if values not in REMOTE_VALUES:
            raise OffloadConfigError(
                f"remote_values {values!r} is not known; choose one of: "
                f"{', '.join(REMOTE_VALUES)}"
            )
        weights_id = extra.get("weights_id")
        if weights_id is not None and (
            not isinstance(weights_id, str) or not weights_id.strip()
        ):
            raise OffloadConfigError(
                "weights_id must be a non-empty name for the weights (e.g. "
                f"'llama-3-8b-ft-2026-11-20'), got {weights_id!r}"
            )
        return cls(
            swap_space_gib=swap,
            eviction_policy=policy,
            copy_backend=backend,
            offload_block_size=size,
            swap_space_path=None if path is None else parse_swap_space_path(path),
            remote_url=url,
            remote_timeout_s=float(timeout),
            async_load_tokens=threshold,
            retain_share=float(share),
            max_retain_s=float(longest),
            remote_values=values,
            weights_id=weights_id,
        )


def _is_number(value: object) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
    )


def _check_retention(share: object, longest: object) -> None:
    """`retain_share` and `max_retain_s`, refused with the fix when out of range."""
    if not _is_number(share) or not 0 <= share <= 1:  # type: ignore[operator]
        raise OffloadConfigError(
            "retain_share must be a share of the host tier from 0 to 1 (e.g. 0.5), "
            f"got {share!r}"
        )
    if not _is_number(longest) or longest <= 0:  # type: ignore[operator]
        raise OffloadConfigError(
            "max_retain_s must be a positive number of seconds (e.g. 600), got "
            f"{longest!r}"
        )


def _check_numbers(
    size: object, url: object, timeout: object, threshold: object
) -> None:
    """`offload_block_size`, `remote_url`, `remote_timeout_s` and `async_load_tokens`
    of the extra config, each refused with the fix when it is not what it must be."""
    if size is not None and (
        isinstance(size, bool) or not isinstance(size, int) or size < 1
    ):
        raise OffloadConfigError(
            "offload_block_size must be a positive number of tokens, a multiple "
            f"of the block size (e.g. 64), got {size!r}"
        )
    if url is not None and (not isinstance(url, str) or not url.strip()):
        raise OffloadConfigError(
            "remote_url must be a store URL (e.g. mooncake://10.0.0.5:50051), "
            f"got {url!r}"
        )
    if not _is_number(timeout) or timeout <= 0:  # type: ignore[operator]
        raise OffloadConfigError(
            "remote_timeout_s must be a positive number of seconds (e.g. 2), got "
            f"{timeout!r}"
        )
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise OffloadConfigError(
            "async_load_tokens must be a number of tokens (e.g. 8192), or 0 to "
            f"load every host hit inside its step, got {threshold!r}"
        )


def parse_swap_space(value: object, name: str = "--swap-space") -> float:
    """Returns the swap space in GiB as a positive finite float, or raises."""
    if isinstance(value, bool):
        raise OffloadConfigError(f"{name} must be a number of GiB, got {value!r}")
    try:
        gib = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise OffloadConfigError(
            f"{name} must be a number of GiB (e.g. {name} 8), got {value!r}"
        ) from None
    if not math.isfinite(gib) or gib <= 0:
        raise OffloadConfigError(
            f"{name} must be a positive number of GiB (e.g. {name} 8), got {value!r}"
        )
    return gib


def parse_swap_space_path(value: object, name: str = "--swap-space-path") -> str:
    """Returns the tier directory as an absolute path, or raises. Checks only the value;
    the directory itself is checked by `persist.directory.check_tier_directory`."""
    if not isinstance(value, str) or not value.strip():
        raise OffloadConfigError(
            f"{name} must be a directory path (e.g. {name} /dev/shm/vllm-kv), got "
            f"{value!r}"
        )
    return os.path.abspath(os.path.expanduser(value))
