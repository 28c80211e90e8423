"""`OffloadSpec`: the host tier worked out once from vLLM's config, and the builder of
its two halves.

The connector's settings are parsed and checked here, once per process, at the
boundary (`OffloadConfig.from_extra_config`); everything after reads the spec's
numbers. Both roles size the tier alike, from `--swap-space` and the KV bytes of one
block of this worker's shard, so the scheduler's host block ids and the workers'
slots agree. The spec builds `HostTierScheduler` or `HostTierWorker`, and the layers
the settings ask for (`layers.py`), which plug into them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_cpu_offload.config import OffloadConfig
from vllm_cpu_offload.context_parallel import (
    check_context_parallelism,
    context_parallel_sizes,
)
from vllm_cpu_offload.errors import GIB, OffloadConfigError
from vllm_cpu_offload.layers import TierLayer, load_layers
from vllm_cpu_offload.scheduler.block_pool import HostBlockPool
from vllm_cpu_offload.scheduler.kv_groups import describe, kv_groups_of
from vllm_cpu_offload.scheduler.policies.registry import make_policy
from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler
from vllm_cpu_offload.worker.tier_worker import HostTierWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under vLLM's logger, so that its handler and format show these lines as vLLM's own.
logger = init_logger("vllm.cpu_offload")


def block_bytes_of(kv_cache_config: KVCacheConfig) -> int:
    """KV bytes of one device block id over all KV tensors of this worker's shard.

    That is what one host block holds. With the hybrid KV cache manager, layers of
    different groups share tensors and a block id belongs to one group, so a block is
    one slice of each tensor, not one page per layer of the model.
    """
    if kv_cache_config.kv_cache_tensors and kv_cache_config.num_blocks:
        return (
            sum(t.size for t in kv_cache_config.kv_cache_tensors)
            // kv_cache_config.num_blocks
        )
    return sum(
        group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        for group in kv_cache_config.kv_cache_groups
    )


def num_host_blocks_for(config: OffloadConfig, block_bytes: int) -> int:
    """How many blocks `--swap-space` holds; refuses a size that holds none."""
    blocks = config.swap_space_bytes // block_bytes
    if blocks < 1:
        raise OffloadConfigError(
            f"--swap-space {config.swap_space_gib:g} GiB holds no KV block of "
            f"{block_bytes / (1 << 20):.2f} MiB; raise --swap-space to at least "
            f"{block_bytes / GIB:.4f}"
        )
    return blocks


class OffloadSpec:
    """The tier's numbers and layers for one process (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        assert vllm_config.kv_transfer_config is not None
        self.vllm_config = vllm_config
        self.config = OffloadConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        # Also where a kv_transfer_config names the connector without the flags.
        check_context_parallelism(*context_parallel_sizes(vllm_config))
        self.block_size = vllm_config.cache_config.block_size
        self.kv_cache_config = kv_cache_config
        self.kv_groups = kv_groups_of(kv_cache_config, self.block_size)
        # A host block holds k device blocks; the worker's host buffer has k slots
        # for each.
        k = self.blocks_per_host_block = self.config.blocks_per_host_block(
            self.block_size
        )
        if k > 1 and not all(g.is_full for g in self.kv_groups):
            raise OffloadConfigError(
                "offload_block_size needs full attention in every KV cache group, but "
                f"the model has {describe(self.kv_groups)}; drop offload_block_size"
            )
        self.block_bytes = block_bytes_of(kv_cache_config)
        self.num_host_blocks = num_host_blocks_for(self.config, self.block_bytes * k)
        self.num_device_blocks = kv_cache_config.num_blocks
        events = vllm_config.kv_events_config
        self.publish_events = bool(events and events.enable_kv_cache_events)
        # Whose memory `--swap-space` sizes, for the start-up line; a layer that keeps
        # one copy for every rank says so.
        self.sized_for = "per worker"
        self.layers: list[TierLayer] = load_layers(self)

    def build_scheduler(self) -> HostTierScheduler:
        """The scheduler half, with its pool, and its layers plugged in."""
        logger.info(
            "CPU offload host tier: %d blocks of %d tokens, %.2f GiB %s",
            self.num_host_blocks,
            self.block_size * self.blocks_per_host_block,
            self.num_host_blocks * self.blocks_per_host_block * self.block_bytes / GIB,
            self.sized_for,
        )
        if len(self.kv_groups) > 1:
            logger.info(
                "CPU offload serves KV cache groups: %s", describe(self.kv_groups)
            )
        parallel = self.vllm_config.parallel_config
        scheduler = HostTierScheduler(
            self._pool(),
            block_size=self.block_size,
            num_workers=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
            block_bytes=self.block_bytes,
            groups=self.kv_groups,
            record_stored_blocks=self.publish_events,
            blocks_per_host_block=self.blocks_per_host_block,
            async_load_tokens=self.config.async_load_tokens,
        )
        for layer in self.layers:
            layer.attach_scheduler(scheduler)
        if not self.vllm_config.cache_config.enable_prefix_caching:
            # vLLM serves no cached context here: neither does the tier.
            logger.warning(prefix_caching_off_notice(self.vllm_config))
            scheduler.hashes_hold = _never
        return scheduler

    def build_worker(self) -> HostTierWorker:
        """This worker's half: its host slots, and its layers plugged in."""
        memories = [m for layer in self.layers if (m := layer.host_memory())]
        assert len(memories) <= 1, "two layers map the host buffer"
        worker = HostTierWorker(
            self.num_host_blocks * self.blocks_per_host_block,
            self.num_device_blocks,
            memory=memories[0] if memories else None,
            copy_backend=self.config.copy_backend,
            blocks_per_host_block=self.blocks_per_host_block,
            # A sliding-window group releases blocks while its request runs: a store
            # still reading one must end before the next step's compute may reuse it.
            fence_stores=not all(g.is_full for g in self.kv_groups),
        )
        for layer in self.layers:
            layer.attach_worker(worker)
        return worker

    def close(self) -> None:
        """Closes what the layers opened."""
        for layer in self.layers:
            layer.close()

    def _pool(self) -> HostBlockPool:
        listeners = [p for layer in self.layers if (p := layer.pool_persistence())]
        assert len(listeners) <= 1, "two layers persist the pool"
        pool = HostBlockPool(
            self.num_host_blocks,
            make_policy(self.config.eviction_policy, self.num_host_blocks),
            persistence=listeners[0] if listeners else None,
        )
        for layer in self.layers:
            layer.pool_built(pool)
        return pool


def _never(request: object) -> bool:
    return False


def prefix_caching_off_notice(vllm_config: Any) -> str:
    """The start-up line of a tier that serves nothing because vLLM turned prefix
    caching off (by the platform, or the user)."""
    model = vllm_config.model_config
    why = "--no-enable-prefix-caching"
    if getattr(model, "use_mla", False) and current_platform_is_cpu():
        why = (
            "vLLM's CPU platform turns it off for MLA models unless its AMX MLA "
            "backend runs: it does not trust the CPU MLA backend with cached context"
        )
    return (
        f"CPU offload: vLLM has prefix caching off ({why}), so the host tier serves "
        "no hits and stores nothing; run with prefix caching on to use it"
    )


def current_platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
