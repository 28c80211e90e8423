"""`OffloadSpec`: the host tier worked out once from vLLM's config, and the builder of
its two halves.

The connector's settings are parsed and checked here, once per process, at the
boundary (`OffloadConfig.from_extra_config`); everything after reads the spec's
numbers. Both roles size the tier alike, from `--swap-space` and the KV bytes of one
block of this worker's shard, so the scheduler's host block ids and the workers'
slots agree. The spec opens what the tier lives on: the persistent index and data
file (`--swap-space-path`) and the shared store under its namespace
(`--swap-space-remote`), and builds `HostTierScheduler` or `HostTierWorker`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger

from vllm_cpu_offload.config import OffloadConfig
from vllm_cpu_offload.errors import GIB, OffloadConfigError
from vllm_cpu_offload.kv_identity import (
    context_parallel_sizes,
    host_region_per_stage,
    unshared_notice,
)
from vllm_cpu_offload.kv_shards import (
    check_context_parallelism,
    shard_names,
    worker_shards,
)
from vllm_cpu_offload.persist.block_index import BlockIndex
from vllm_cpu_offload.persist.data_file import TierDataFile
from vllm_cpu_offload.persist.fingerprint import (
    rank_name,
    this_ranks,
    tier_fingerprint,
    worker_names,
)
from vllm_cpu_offload.remote.namespace import namespace_of
from vllm_cpu_offload.remote.registry import open_store
from vllm_cpu_offload.remote.store import wait_until_answering
from vllm_cpu_offload.scheduler.block_pool import HostBlockPool
from vllm_cpu_offload.scheduler.kv_groups import describe, kv_groups_of
from vllm_cpu_offload.scheduler.policies import make_policy
from vllm_cpu_offload.scheduler.remote_lookup import RemoteLookup
from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler
from vllm_cpu_offload.worker.shared_region import (
    SharedRegion,
    TensorParallelCollectives,
    region_name,
)
from vllm_cpu_offload.worker.tier_worker import HostTierWorker, RemoteSettings

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
    """The tier's numbers and media for one process (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        assert vllm_config.kv_transfer_config is not None
        self.vllm_config = vllm_config
        self.config = OffloadConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        # Also where a kv_transfer_config names the connector without the flags.
        check_context_parallelism(*context_parallel_sizes(vllm_config))
        self.block_size = vllm_config.cache_config.block_size
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
        self.fingerprint = (
            tier_fingerprint(vllm_config, self.kv_groups, self.num_host_blocks, k)
            if self.config.swap_space_path is not None
            else {}
        )
        self.remote_url = self.config.remote_url
        namespace = (
            namespace_of(vllm_config, self.kv_groups, k) if self.remote_url else ""
        )
        if namespace is None:  # nothing identifies the weights: nothing to share under
            self.remote_url, namespace = None, ""
        self.namespace = namespace
        # MLA: every tensor-parallel rank holds the same KV, stored once per engine
        # (kv_shards.py). The persistent tier keeps a file per rank.
        self.shares_host_region = host_region_per_stage(
            vllm_config, self.config.swap_space_path
        )
        # What the scheduler half lives on, closed by `close`.
        self._index: BlockIndex | None = None
        self._lookup: RemoteLookup | None = None

    def build_scheduler(self) -> HostTierScheduler:
        """The scheduler half, with its pool (restored from `--swap-space-path`) and
        its view of the shared store."""
        config = self.config
        notice = unshared_notice(
            self.vllm_config,
            persisted=config.swap_space_path is not None,
            shared=config.remote_url is not None,
        )
        if notice is not None:
            logger.warning(notice)
        logger.info(
            "CPU offload host tier: %d blocks of %d tokens, %.2f GiB %s",
            self.num_host_blocks,
            self.block_size * self.blocks_per_host_block,
            self.num_host_blocks * self.blocks_per_host_block * self.block_bytes / GIB,
            "per engine, one copy for every rank (MLA: every rank holds the same KV)"
            if self.shares_host_region
            else "per worker",
        )
        if len(self.kv_groups) > 1:
            logger.info(
                "CPU offload serves KV cache groups: %s", describe(self.kv_groups)
            )
        parallel = self.vllm_config.parallel_config
        return HostTierScheduler(
            self._pool(),
            block_size=self.block_size,
            num_workers=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
            block_bytes=self.block_bytes,
            groups=self.kv_groups,
            record_stored_blocks=self.publish_events,
            blocks_per_host_block=self.blocks_per_host_block,
            remote=self._remote_lookup(),
            namespace=self.namespace,
            async_load_tokens=config.async_load_tokens,
            retain_blocks=int(config.retain_share * self.num_host_blocks),
            max_retain_s=config.max_retain_s,
        )

    def build_worker(self) -> HostTierWorker:
        """This worker's half: its host slots, data file and store client."""
        path, url = self.config.swap_space_path, self.remote_url
        tp_rank, pp_rank = this_ranks()
        return HostTierWorker(
            self.num_host_blocks * self.blocks_per_host_block,
            self.num_device_blocks,
            data_file=(
                TierDataFile(path, rank_name(tp_rank, pp_rank), self.fingerprint)
                if path is not None
                else None
            ),
            copy_backend=self.config.copy_backend,
            blocks_per_host_block=self.blocks_per_host_block,
            remote=(
                RemoteSettings(
                    lambda: open_store(url, role="worker"),
                    self.namespace,
                    worker_shards(self.vllm_config, tp_rank, pp_rank),
                    self.config.remote_timeout_s,
                )
                if url is not None
                else None
            ),
            # A sliding-window group releases blocks while its request runs: a store
            # still reading one must end before the next step's compute may reuse it.
            fence_stores=not all(g.is_full for g in self.kv_groups),
            shared_region=(
                SharedRegion(
                    region_name(self.vllm_config, pp_rank),
                    TensorParallelCollectives(),
                    leader=tp_rank == 0,
                )
                if self.shares_host_region
                else None
            ),
        )

    def close(self) -> None:
        """Closes the persistent index and the scheduler's store client."""
        if self._index is not None:
            self._index.close()
        if self._lookup is not None:
            self._lookup.close()

    def _pool(self) -> HostBlockPool:
        path = self.config.swap_space_path
        index = (
            BlockIndex(
                path,
                self.fingerprint,
                self.num_host_blocks,
                worker_names(self.vllm_config),
            )
            if path is not None
            else None
        )
        self._index = index
        restored = index.open() if index is not None else []
        pool = HostBlockPool(
            self.num_host_blocks,
            make_policy(self.config.eviction_policy, self.num_host_blocks),
            persistence=index,
        )
        if index is not None:
            adopted = pool.restore((b.host_id, b.key, b.parent) for b in restored)
            _log_restore(index, adopted)
        return pool

    def _remote_lookup(self) -> RemoteLookup | None:
        url, timeout_s = self.remote_url, self.config.remote_timeout_s
        if url is None:
            return None
        store = open_store(url, role="scheduler")
        lookup = RemoteLookup(store, shard_names(self.vllm_config), timeout_s=timeout_s)
        self._lookup = lookup
        answering = wait_until_answering(store, timeout_s)
        logger.info(
            "CPU offload shared tier: %s, namespace %s%s",
            store.description,
            self.namespace,
            "" if answering else " (not answering yet: connects when it does)",
        )
        return lookup


def _log_restore(index: BlockIndex, adopted: int) -> None:
    why = index.rebuilt_because
    if why is None:
        torn = (
            f", {index.torn_records} torn record(s) dropped"
            if index.torn_records
            else ""
        )
        logger.info(
            "CPU offload tier at %s: %d blocks restored%s", index.path, adopted, torn
        )
    elif why == "new":
        logger.info("CPU offload tier at %s: created", index.path)
    else:
        logger.warning("CPU offload tier at %s starts empty: %s", index.path, why)
