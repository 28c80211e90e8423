"""The generated MLA model is one vLLM takes: an MLA config its CPU backend runs, and a
checkpoint whose tensors are exactly those vLLM's DeepseekV2ForCausalLM loads (built
here in this process, no engine)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_cpu_offload.testing.tiny_mla import (  # noqa: E402
    AMX_BLOCK_SIZE,
    AMX_ENGINE_KWARGS,
    BLOCK_SIZE,
    ENGINE_KWARGS,
    TEST_MLA_SHAPE,
    amx_mla_runs_here,
    ensure_tiny_mla,
    weight_shapes,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Generated afresh, not read from the cache: the check is of the generator.
    return ensure_tiny_mla(root=tmp_path_factory.mktemp("models"))


def _vllm_config(folder: Path, **engine: Any) -> Any:
    """The config of an engine of the model: ENGINE_KWARGS' (CPU_MLA, on any machine)
    in fp32 unless told otherwise."""
    from vllm.engine.arg_utils import EngineArgs

    engine = {**ENGINE_KWARGS, "dtype": "float32", **engine}
    return EngineArgs(model=str(folder), **engine).create_engine_config()


@pytest.fixture(scope="module")
def vllm_model(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The vLLM model of the generated config, on the CPU, with a one-rank process
    group."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = _vllm_config(folder)
    ours = not torch.distributed.is_initialized()
    rendezvous = tmp_path_factory.mktemp("rendezvous") / "init"
    with set_current_vllm_config(config), set_default_torch_dtype(torch.float32):
        if ours:
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{rendezvous}",
                backend="gloo",
            )
            ps.ensure_model_parallel_initialized(1, 1)
        try:
            # vLLM's SupportsLoRA protocol declares `lora_manager` without a value.
            yield DeepseekV2ForCausalLM(vllm_config=config)  # type: ignore[abstract]
        finally:
            if ours:
                ps.destroy_model_parallel()
                ps.destroy_distributed_environment()


def test_config_is_mla_with_the_latent_cpu_mla_takes(folder: Path) -> None:
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    config = _vllm_config(folder)
    model = config.model_config
    assert model.use_mla
    assert model.hf_config.architectures == ["DeepseekV2ForCausalLM"]
    assert model.get_head_size() == TEST_MLA_SHAPE.latent_size
    assert model.get_head_size() in CPUMLABackend.get_supported_head_sizes()
    assert model.get_num_attention_heads(config.parallel_config) % 2 == 0  # TP=2
    # What the CPU platform sets for CPU_MLA, which it runs where ENGINE_KWARGS ask for
    # it, AMX or not; with it, vLLM has no cached context for MLA.
    assert config.cache_config.block_size == BLOCK_SIZE == 16
    assert not config.cache_config.enable_prefix_caching


@pytest.mark.skipif(
    not amx_mla_runs_here(),
    reason="vLLM runs AMX_MLA only on an x86 CPU with AMX tiles (amx_tile)",
)
def test_amx_engine_kwargs_run_amx_mla_with_prefix_caching_on(folder: Path) -> None:
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend

    config = _vllm_config(
        folder, **AMX_ENGINE_KWARGS, dtype="bfloat16", block_size=AMX_BLOCK_SIZE
    )
    assert config.model_config.get_head_size() in (
        AMXMLABackend.get_supported_head_sizes()
    )
    assert AMXMLABackend.supports_block_size(AMX_BLOCK_SIZE)
    assert not AMXMLABackend.supports_block_size(BLOCK_SIZE)  # CPU_MLA's 16
    assert config.cache_config.block_size == AMX_BLOCK_SIZE
    assert config.cache_config.enable_prefix_caching


def test_checkpoint_holds_exactly_the_tensors_vllm_loads(
    folder: Path, vllm_model: Any
) -> None:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(weight_shapes(TEST_MLA_SHAPE))
        # Each one goes through vLLM's own name mapping and weight loader, which
        # raise on a name without a parameter or a tensor of another shape.
        loaded = vllm_model.load_weights((name, f.get_tensor(name)) for name in names)
    params = {name for name, _ in vllm_model.named_parameters()}
    assert loaded == params


def test_every_mlp_is_dense(vllm_model: Any) -> None:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLP

    layers = vllm_model.model.layers
    assert len(layers) == TEST_MLA_SHAPE.num_layers
    assert all(type(layer.mlp) is DeepseekV2MLP for layer in layers)
    assert vllm_model.num_moe_layers == 0


def test_folder_is_reused_and_keyed_by_the_shape(folder: Path) -> None:
    weights = folder / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert ensure_tiny_mla(root=folder.parents[1]) == folder
    assert weights.stat().st_mtime_ns == written
    other = dataclasses.replace(TEST_MLA_SHAPE, num_layers=2)
    assert other.name != TEST_MLA_SHAPE.name
