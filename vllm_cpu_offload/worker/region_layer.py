"""One host copy per pipeline stage for replicated KV (MLA), as a layer of the tier
(`layers.py`).

Every tensor-parallel rank of an MLA model holds the same latent KV, so the stage's
ranks map one region (`shared_region.py`) that its first rank stores into, and
`--swap-space` sizes the KV of the engine, not of each worker. The file tier keeps a
file per rank instead (`kv_identity.host_region_per_stage`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_cpu_offload.kv_identity import host_region_per_stage
from vllm_cpu_offload.layers import TierLayer
from vllm_cpu_offload.ranks import this_ranks
from vllm_cpu_offload.worker.shared_region import (
    SharedRegion,
    TensorParallelCollectives,
    region_name,
)

if TYPE_CHECKING:
    from vllm_cpu_offload.spec import OffloadSpec
    from vllm_cpu_offload.worker.host_buffer import MappedMemory


class SharedRegionLayer(TierLayer):
    """The host buffer in one region that every rank of the stage maps."""

    @classmethod
    def wanted(cls, spec: OffloadSpec) -> bool:
        return host_region_per_stage(spec.vllm_config, spec.config.swap_space_path)

    def __init__(self, spec: OffloadSpec) -> None:
        super().__init__(spec)
        spec.sized_for = (
            "per engine, one copy for every rank (MLA: every rank holds the same KV)"
        )

    def host_memory(self) -> MappedMemory:
        tp_rank, pp_rank = this_ranks()
        return SharedRegion(
            region_name(self.spec.vllm_config, pp_rank),
            TensorParallelCollectives(),
            leader=tp_rank == 0,
        )


layer = SharedRegionLayer
