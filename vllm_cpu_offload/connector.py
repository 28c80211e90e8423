"""`CPUOffloadConnector`: the thin KV connector that joins vLLM to the host tier.

It only forwards: `OffloadSpec` works the tier out from vLLM's config and builds the
scheduler role's `HostTierScheduler` (engine core process) or the worker role's
`HostTierWorker` (each worker).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_cpu_offload.layers import layer_classes
from vllm_cpu_offload.metadata import OffloadStepMetadata, OffloadWorkerReport
from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler
from vllm_cpu_offload.spec import OffloadSpec
from vllm_cpu_offload.worker.tier_worker import HostTierWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class CPUOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Keeps evicted KV blocks in host memory and loads them back within the step.

    Supports vLLM's hybrid KV cache manager (full and sliding-window attention groups).
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.spec = OffloadSpec(vllm_config, kv_cache_config)
        self.num_host_blocks = self.spec.num_host_blocks
        self.scheduler: HostTierScheduler | None = None
        self.worker: HostTierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = self.spec.build_scheduler()
        else:
            self.worker = self.spec.build_worker()

    def _sched(self) -> HostTierScheduler:
        assert self.scheduler is not None, "scheduler-side method called on a worker"
        return self.scheduler

    def _work(self) -> HostTierWorker:
        assert self.worker is not None, "worker-side method called on the scheduler"
        return self.worker

    # ---- worker side ----

    @override
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    @override
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, OffloadStepMetadata)
        self._work().handle_preemptions(kv_connector_metadata)

    @override
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Bound before the forward; start_load_kv may come after it when the step loads
        # nothing, so the step's stores are registered here.
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, OffloadStepMetadata)
        self._work().begin_step(connector_metadata)

    @override
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, OffloadStepMetadata)
        self._work().start_loads(metadata)

    @override
    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    @override
    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._work().save_layer(layer_name)

    @override
    def wait_for_save(self) -> None:
        self._work().finish_step()

    @override
    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished()

    @override
    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        # A load of several KV cache groups that missed a block loaded nothing: its
        # request is failed whole (vLLM takes no load error of single blocks there)
        # and recomputed.
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving |= self._work().take_failed_loads()
        return results

    @override
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    @override
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().take_report()

    # vLLM 0.33's sleep-mode hooks (absent in 0.32, hence no @override). Sleep at level
    # 1 or 2 first pauses the scheduler and resets the prefix cache, which empties the
    # host tier too (reset_cache): its blocks may have been computed with weights that
    # the sleep replaces.
    def unregister_kv_caches(self) -> None:
        """Before sleep releases the KV memory: no copy may still read or write it."""
        if self.worker is not None:
            self.worker.drain()

    def restore_kv_caches(self) -> None:
        """After wake-up: nothing to redo. Sleep maps the KV cache back at the same
        virtual addresses, so the registered tensors stay valid, and nothing else was
        dropped."""

    @override
    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.spec.close()

    @classmethod
    @override
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Loads wait per layer and stores follow each layer's KV write: both need Python
        # between the graph pieces, which a full CUDA graph would skip.
        return True

    # ---- scheduler side ----

    @override
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind_kv_cache_manager(kv_cache_manager)

    @override
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        sched = self._sched()
        tokens = sched.get_num_new_matched_tokens(request, num_computed_tokens)
        return tokens, sched.load_is_async(request)

    @override
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids() if num_external_tokens else ()
        self._sched().update_state_after_alloc(request, block_ids, num_external_tokens)

    @override
    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    @override
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        assert report is None or isinstance(report, OffloadWorkerReport)
        if connector_output.invalid_block_ids:
            self._sched().forget_unloaded_blocks(connector_output.invalid_block_ids)
        released = self._sched().update_connector_output(report)
        if released:
            # vLLM frees the blocks of `finished_sending` right after this call, in
            # the same step: an engine that goes idle now keeps no block for a
            # store already done.
            sending = connector_output.finished_sending or set()
            connector_output.finished_sending = sending | released

    @override
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request), None

    @override
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # The stores hold every group's blocks alike: one answer for the request.
        return self._sched().request_finished(request), None

    @override
    def take_events(self) -> Iterable[KVCacheEvent]:
        sched = self._sched()
        events = sched.take_pool_events()  # counts evictions, events on or off
        return [e for layer in self.spec.layers for e in layer.kv_events(sched, events)]

    @override
    def reset_cache(self) -> bool | None:
        return self._sched().reset_cache()

    # ---- metrics (both sides), from the layers that report them ----

    @override
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        for layer in self.spec.layers:
            if self.scheduler is not None:
                stats = layer.scheduler_stats(self.scheduler)
            else:
                stats = layer.worker_stats(self._work())
            if stats is not None:
                return stats
        return None

    @classmethod
    @override
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        for layer in layer_classes():
            if (stats := layer.stats_from(data or {})) is not None:
                return stats
        return None

    @classmethod
    @override
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        for layer in layer_classes():
            metrics = layer.prom_metrics(
                vllm_config, metric_types, labelnames, per_engine_labelvalues
            )
            if metrics is not None:
                return metrics
        return None
