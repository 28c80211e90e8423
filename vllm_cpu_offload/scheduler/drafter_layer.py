"""Speculative decoding, as a layer of the tier (`layers.py`).

A drafter's layers (a draft model's, an EAGLE head's, MTP's) keep their KV in the same
device blocks as the target's, so the host tier stores and loads it with them. Two
things differ from a tier without a drafter, both in how far a host hit reaches:

- vLLM's proposers take a request whose first step computes one token for a decode
  step, and their acceptance falls (measured on the CPU platform: ngram 0.47 -> 0.37,
  the target as its own draft model 1.00 -> 0.86). A hit then ends where vLLM's own
  prefix-cache hit ends, a whole block before the prompt's end, never one token before.
- An EAGLE-style drafter (EAGLE, EAGLE-3, MTP) computes its KV at a position from the
  target's hidden state there and the token after it. At a block's last position that
  token lies in the next block, which the block's hash does not cover: another
  request with the same block may go on differently. The last block of every hit is
  recomputed, as vLLM drops it from its own hits (`use_eagle_block_drop`).

Without this layer the tokens are the same (the target verifies every draft); only the
acceptance rate can fall.

The start-up line names the KV cache groups that hold the drafter's KV, whose blocks
the per-group counters (`vllm:cpu_offload_group_stored_blocks_total` and
`..._loaded_blocks_total`, label `kv_cache_group`) count: a drafter group stored but
never loaded shows there.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_cpu_offload.layers import TierLayer

if TYPE_CHECKING:
    from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler
    from vllm_cpu_offload.spec import OffloadSpec

logger = init_logger("vllm.cpu_offload")


def drafter_tail_is_volatile(speculative_config: Any) -> bool:
    """Whether the drafter's KV at a block's last position depends on the token after
    the block (and vLLM drops such blocks from its own hits)."""
    drop = getattr(speculative_config, "use_eagle_block_drop", None)
    if drop is not None:
        return bool(drop())
    return bool(speculative_config.use_eagle())


def drafter_adds_kv(speculative_config: Any) -> bool:
    """Whether the drafter has KV of its own (a model, not n-gram lookup)."""
    return speculative_config.method != "ngram" and (
        getattr(speculative_config, "draft_model_config", None) is not None
    )


def drafter_group_ids(
    speculative_config: Any, kv_cache_config: Any, target_layers: int | None
) -> list[int]:
    """The KV cache groups that hold the drafter's KV: those vLLM marks as an EAGLE or
    MTP drafter's (`is_eagle_group`), else those with a layer numbered past the
    target's `target_layers` (an EAGLE head's layers follow the target's), else every
    group (a draft model's layers share the target's groups); none without KV."""
    if not drafter_adds_kv(speculative_config):
        return []
    groups = kv_cache_config.kv_cache_groups
    marked = [i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)]
    if not marked and target_layers is not None:
        marked = [
            i
            for i, g in enumerate(groups)
            if any(_layer_number(name) >= target_layers for name in g.layer_names)
        ]
    return marked or list(range(len(groups)))


def _layer_number(layer_name: str) -> int:
    """N of a layer named `....layers.N....`; -1 for another name."""
    match = re.search(r"\.layers\.(\d+)\.", f".{layer_name}.")
    return int(match.group(1)) if match else -1


def describe_drafter(speculative_config: Any, group_ids: list[int]) -> str:
    """What the start-up line says of the drafter's KV, in KV cache `group_ids`."""
    method = speculative_config.method
    if not group_ids:
        return f"speculative decoding ({method}) adds no KV"
    volatile = drafter_tail_is_volatile(speculative_config)
    where = "group" if len(group_ids) == 1 else "groups"
    where += " " + ", ".join(map(str, group_ids))
    return (
        f"the {method} drafter's KV (KV cache {where}) is stored and loaded with "
        "the target's" + ("; each hit's last block is recomputed" if volatile else "")
    )


class DrafterLayer(TierLayer):
    """Ends host hits where speculative decoding keeps its acceptance rate."""

    @classmethod
    def wanted(cls, spec: OffloadSpec) -> bool:
        return spec.vllm_config.speculative_config is not None

    def attach_scheduler(self, scheduler: HostTierScheduler) -> None:
        speculative = self.spec.vllm_config.speculative_config
        scheduler.hit_to_last_token = False
        scheduler.drafter_tail_is_volatile = drafter_tail_is_volatile(speculative)
        model = self.spec.vllm_config.model_config
        target_layers = getattr(model.hf_text_config, "num_hidden_layers", None)
        groups = drafter_group_ids(
            speculative, self.spec.kv_cache_config, target_layers
        )
        logger.info("CPU offload: %s", describe_drafter(speculative, groups))


layer = DrafterLayer
