"""The shared tier (`--swap-space-remote`), as a layer of the tier (`layers.py`).

The scheduler half asks the store how much of a prefix it holds past the host hit,
and writes every store through (`scheduler/shared_tier.py`); each worker fetches and
writes its values on a thread of its own (`worker/shared_tier.py`). Keys live under a
namespace made of everything a block's bytes depend on (`namespace.py`): where nothing
identifies the weights there is nothing to share under, and the layer stays out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_cpu_offload.kv_identity import check_stable_block_hashes, unshared_notice
from vllm_cpu_offload.kv_shards import shard_names, worker_shards
from vllm_cpu_offload.layers import TierLayer
from vllm_cpu_offload.ranks import this_ranks
from vllm_cpu_offload.remote.namespace import namespace_of
from vllm_cpu_offload.remote.registry import check_remote_url, open_store
from vllm_cpu_offload.remote.store import wait_until_answering
from vllm_cpu_offload.scheduler.remote_lookup import RemoteLookup
from vllm_cpu_offload.scheduler.shared_tier import SharedTier, attach_shared_tier
from vllm_cpu_offload.worker.shared_tier import (
    RemoteSettings,
    attach_shared_tier_worker,
)

if TYPE_CHECKING:
    from vllm_cpu_offload.config import OffloadConfig
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler
    from vllm_cpu_offload.spec import OffloadSpec
    from vllm_cpu_offload.worker.tier_worker import HostTierWorker

# Under vLLM's logger, as the spec's lines.
logger = init_logger("vllm.cpu_offload")


class SharedTierLayer(TierLayer):
    """A store every engine of the fleet shares, at `remote_url`."""

    settings = ("remote_url",)

    @classmethod
    def check_settings(cls, config: OffloadConfig) -> None:
        if config.remote_url is not None:
            check_remote_url(config.remote_url)

    @classmethod
    def check_engine(cls, vllm_config: Any, config: OffloadConfig) -> None:
        if config.remote_url is not None:
            hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
            check_stable_block_hashes(hash_algo, "--swap-space-remote")

    @classmethod
    def wanted(cls, spec: OffloadSpec) -> bool:
        return spec.config.remote_url is not None

    def __init__(self, spec: OffloadSpec) -> None:
        super().__init__(spec)
        url = spec.config.remote_url
        assert url is not None
        self.url = url
        # None: nothing identifies the weights, nothing to share under.
        self.namespace = namespace_of(
            spec.vllm_config, spec.kv_groups, spec.blocks_per_host_block
        )
        self._lookup: RemoteLookup | None = None

    def attach_scheduler(self, scheduler: HostTierScheduler) -> None:
        spec = self.spec
        notice = unshared_notice(spec.vllm_config, persisted=False, shared=True)
        if notice is not None:
            logger.warning(notice)
        if self.namespace is None:
            return
        timeout_s = spec.config.remote_timeout_s
        store = open_store(self.url, role="scheduler")
        lookup = RemoteLookup(store, shard_names(spec.vllm_config), timeout_s=timeout_s)
        self._lookup = lookup
        answering = wait_until_answering(store, timeout_s)
        logger.info(
            "CPU offload shared tier: %s, namespace %s%s",
            store.description,
            self.namespace,
            "" if answering else " (not answering yet: connects when it does)",
        )
        attach_shared_tier(scheduler, lookup, self.namespace)
        shared = scheduler.shared
        assert isinstance(shared, SharedTier)
        scheduler.on_identity_change.append(shared.seal)

    def attach_worker(self, worker: HostTierWorker) -> None:
        if self.namespace is None:
            return
        url, spec = self.url, self.spec
        tp_rank, pp_rank = this_ranks()
        settings = RemoteSettings(
            lambda: open_store(url, role="worker"),
            self.namespace,
            worker_shards(spec.vllm_config, tp_rank, pp_rank),
            spec.config.remote_timeout_s,
        )
        attach_shared_tier_worker(worker, settings)

    def close(self) -> None:
        if self._lookup is not None:
            self._lookup.close()


layer = SharedTierLayer
