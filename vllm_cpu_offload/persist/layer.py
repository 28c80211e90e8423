"""The file tier (`--swap-space-path`), as a layer of the tier (`layers.py`).

The scheduler's pool records every block it makes visible in the directory's index
(`block_index.py`) and starts from what the index restores; each worker's host buffer
is its data file, mapped (`data_file.py`). Both are written for one fingerprint
(`fingerprint.py`): a tier written by another configuration starts empty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_cpu_offload.kv_identity import check_stable_block_hashes, unshared_notice
from vllm_cpu_offload.layers import TierLayer
from vllm_cpu_offload.persist.block_index import BlockIndex
from vllm_cpu_offload.persist.data_file import TierDataFile
from vllm_cpu_offload.persist.directory import check_tier_directory, check_tier_fits
from vllm_cpu_offload.persist.fingerprint import tier_fingerprint
from vllm_cpu_offload.ranks import rank_name, this_ranks, worker_names

if TYPE_CHECKING:
    from vllm_cpu_offload.config import OffloadConfig
    from vllm_cpu_offload.scheduler.block_pool import HostBlockPool
    from vllm_cpu_offload.scheduler.pool_events import PersistenceListener
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler
    from vllm_cpu_offload.spec import OffloadSpec
    from vllm_cpu_offload.worker.host_buffer import MappedMemory

# Under vLLM's logger, as the spec's lines.
logger = init_logger("vllm.cpu_offload")


class FileTierLayer(TierLayer):
    """The tier kept in files under `--swap-space-path`."""

    settings = ("swap_space_path",)

    @classmethod
    def check_settings(cls, config: OffloadConfig) -> None:
        if config.swap_space_path is not None:
            check_tier_directory(config.swap_space_path)

    @classmethod
    def check_engine(cls, vllm_config: Any, config: OffloadConfig) -> None:
        if config.swap_space_path is not None:
            hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
            check_stable_block_hashes(hash_algo, "--swap-space-path")

    @classmethod
    def check_fits(
        cls, config: OffloadConfig, wanted: int, copies: int, each: str
    ) -> bool:
        path = config.swap_space_path
        if path is None:
            return False
        check_tier_fits(path, wanted, config.swap_space_gib, copies, each)
        return True

    @classmethod
    def wanted(cls, spec: OffloadSpec) -> bool:
        return spec.config.swap_space_path is not None

    def __init__(self, spec: OffloadSpec) -> None:
        super().__init__(spec)
        path = spec.config.swap_space_path
        assert path is not None
        self.path = path
        self.fingerprint = tier_fingerprint(
            spec.vllm_config,
            spec.kv_groups,
            spec.num_host_blocks,
            spec.blocks_per_host_block,
        )
        self._index: BlockIndex | None = None

    def pool_persistence(self) -> PersistenceListener:
        spec = self.spec
        self._index = BlockIndex(
            self.path,
            self.fingerprint,
            spec.num_host_blocks,
            worker_names(spec.vllm_config),
        )
        return self._index

    def pool_built(self, pool: HostBlockPool) -> None:
        index = self._index
        assert index is not None
        restored = index.open()
        adopted = pool.restore((b.host_id, b.key, b.parent) for b in restored)
        _log_restore(index, adopted)

    def attach_scheduler(self, scheduler: HostTierScheduler) -> None:
        notice = unshared_notice(self.spec.vllm_config, persisted=True, shared=False)
        if notice is not None:
            logger.warning(notice)
        index = self._index
        assert index is not None
        scheduler.on_identity_change.append(index.make_private)

    def host_memory(self) -> MappedMemory:
        return TierDataFile(self.path, rank_name(*this_ranks()), self.fingerprint)

    def close(self) -> None:
        if self._index is not None:
            self._index.close()


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


layer = FileTierLayer
