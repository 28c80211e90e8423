"""Configs as the connector receives them, for tests that build either half from
vLLM's config: a vLLM config of a model, the connector named in it, and the KV cache
config of a one-layer model."""

from __future__ import annotations

from typing import Any

import torch

BLOCK_SIZE = 32


def vllm_config(model: str, **model_kwargs: Any) -> Any:
    """A vLLM config as the connector receives it: the KV cache layout is resolved by
    the engine core before either half of the connector is made."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(model=model, **model_kwargs),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
    )
    config.cache_config.kv_cache_layout = "LBNHC"  # vLLM's NHD
    return config


def with_connector(config: Any, **extra: Any) -> Any:
    """`config` naming the connector, with a host tier of 64 blocks of
    `one_layer_kv_config` and the `extra` settings."""
    from vllm.config import KVTransferConfig

    page_bytes = BLOCK_SIZE * 2 * 4
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="CPUOffloadConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "swap_space_gib": 64 * page_bytes / (1 << 30),
            **extra,
        },
    )
    return config


def one_layer_kv_config(block_size: int = BLOCK_SIZE, num_blocks: int = 16) -> Any:
    """The KV cache config of a model of one attention layer of one KV head of size
    1, as the connector receives it."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
