"""The identity of KV bytes follows what the model's layers read from vLLM's configs,
not a list of fields: a LongRoPE model's K depends on `max_model_len`, a config field
no list here names changes the identity when the layers can read it, and what only the
scheduler reads leaves engines sharing."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.unit.test_kv_identity import (  # noqa: E402
    fingerprint,
    namespace,
    one_layer_kv_config,
    vllm_config,
)
from vllm_cpu_offload.kv_identity import (  # noqa: E402
    RANKS,
    REPLICATED,
    host_region_per_stage,
    kv_sharding,
)
from vllm_cpu_offload.persist.fingerprint import differences  # noqa: E402

ORIGINAL_LEN = 4096
HEAD_SIZE = 64


@pytest.fixture
def long_rope_model(tiny_model: str, tmp_path: Path) -> str:
    """The tiny model with Phi-3's LongRoPE: short factors up to 4,096 tokens, long
    ones past it, chosen by vLLM from `max_model_len`."""
    folder = tmp_path / "long-rope"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    half = HEAD_SIZE // 2
    config["max_position_embeddings"] = 8 * ORIGINAL_LEN
    config["original_max_position_embeddings"] = ORIGINAL_LEN
    config["rope_scaling"] = {
        "type": "longrope",
        "short_factor": [1.0 + i / half for i in range(half)],
        "long_factor": [4.0 + i for i in range(half)],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _rotated_key(config: Any) -> torch.Tensor:
    """A fixed key over the first 64 positions, as vLLM's rotary embedding built under
    `config` rotates it before it is cached."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding

    # vLLM keeps one embedding per set of arguments, made under the first config.
    rotary_embedding._ROPE_DICT.clear()
    text = config.model_config.hf_text_config
    with set_current_vllm_config(config):
        rope = rotary_embedding.get_rope(
            HEAD_SIZE,
            max_position=text.max_position_embeddings,
            rope_parameters=text.rope_parameters,
            dtype=torch.float32,
        )
    positions = torch.arange(64)
    key = torch.ones(64, HEAD_SIZE)
    _, rotated = rope.forward(positions, torch.ones(64, HEAD_SIZE), key.clone())
    assert rotated is not None
    return rotated


def test_max_model_len_picks_long_rope_factors_and_the_identity_follows(
    long_rope_model: str,
) -> None:
    # Two engines of one LongRoPE model, --max-model-len 4096 and 32768, one store.
    short = vllm_config(long_rope_model, max_model_len=ORIGINAL_LEN)
    long = vllm_config(long_rope_model, max_model_len=8 * ORIGINAL_LEN)
    # Their K differs for the same tokens: vLLM rotates by other factors.
    assert not torch.equal(_rotated_key(short), _rotated_key(long))
    assert namespace(short) != namespace(long)
    assert fingerprint(short) != fingerprint(long)
    assert "max_model_len 4096 -> 32768" in differences(
        fingerprint(short), fingerprint(long)
    )
    # Within the short factors' range the bytes are the same, and so is what the
    # layers read, but for the length itself: not shared (the safe side).
    shorter = vllm_config(long_rope_model, max_model_len=ORIGINAL_LEN // 2)
    assert torch.equal(_rotated_key(short), _rotated_key(shorter))


def test_a_length_fitted_to_memory_is_not_taken_for_the_length_the_layers_saw(
    long_rope_model: str,
) -> None:
    # --max-model-len -1: vLLM builds the layers at a length of its choosing (for
    # LongRoPE the original length, short factors), then shrinks max_model_len to
    # what fits in memory; layers that read the length saw the former.
    auto = vllm_config(long_rope_model, max_model_len=-1)
    built = _rotated_key(auto)
    auto.model_config.max_model_len = ORIGINAL_LEN // 2  # what auto-fit sets
    explicit = vllm_config(long_rope_model, max_model_len=ORIGINAL_LEN // 2)
    assert torch.equal(built, _rotated_key(explicit))
    # Equal bytes here, but the identity cannot know which lengths a model's layers
    # tell apart: it keeps them apart (the safe side).
    assert namespace(auto) != namespace(explicit)


# Config fields the identity names nowhere, each read by some model's attention
# layers: the identity must change with every one.
UNNAMED_FIELDS: dict[str, dict[str, Any]] = {
    "sliding-window": {"sliding_window": 64},
    "dynamic-ntk-rope": {
        "rope_parameters": {
            "rope_type": "dynamic",
            "factor": 2.0,
            "rope_theta": 10000.0,
        }
    },
    "attention-soft-cap": {"attn_logit_softcapping": 50.0},
    "query-pre-attention-scalar": {"query_pre_attn_scalar": 144},
    "attention-sinks": {"num_sink_tokens": 4},
    "head-dim": {"head_dim": 32},
    "max-position-embeddings": {"max_position_embeddings": 8192},
}


@pytest.mark.parametrize("overrides", UNNAMED_FIELDS.values(), ids=UNNAMED_FIELDS)
def test_a_config_field_no_list_names_changes_the_identity(
    tiny_model: str, overrides: dict[str, Any]
) -> None:
    # --hf-overrides, or a config.json of other values: vLLM applies both to the
    # Hugging Face config its layers read.
    base = vllm_config(tiny_model)
    changed = vllm_config(tiny_model, hf_overrides=overrides)
    assert namespace(changed) != namespace(base)
    assert fingerprint(changed) != fingerprint(base)


ENGINE_SETTINGS: dict[str, Callable[[Any], None]] = {
    "disable-sliding-window": lambda c: setattr(
        c.model_config, "disable_sliding_window", True
    ),
    "cache-sliding-window": lambda c: setattr(c.cache_config, "sliding_window", 128),
    "kv-cache-dtype": lambda c: setattr(c.cache_config, "cache_dtype", "fp8"),
    "model-implementation": lambda c: setattr(
        c.model_config, "model_impl", "transformers"
    ),
}


@pytest.mark.parametrize("change", ENGINE_SETTINGS.values(), ids=ENGINE_SETTINGS)
def test_an_engine_setting_the_layers_read_changes_the_identity(
    tiny_model: str, change: Callable[[Any], None]
) -> None:
    base, changed = vllm_config(tiny_model), vllm_config(tiny_model)
    change(changed)
    assert namespace(changed) != namespace(base)


SCHEDULER_ONLY: dict[str, Callable[[Any], None]] = {
    "max-num-seqs": lambda c: setattr(c.scheduler_config, "max_num_seqs", 7),
    "gpu-memory-utilization": lambda c: setattr(
        c.cache_config, "gpu_memory_utilization", 0.5
    ),
    "num-gpu-blocks-override": lambda c: setattr(
        c.cache_config, "num_gpu_blocks_override", 99
    ),
    "device-blocks-counted": lambda c: setattr(c.cache_config, "num_gpu_blocks", 123),
    "enforce-eager": lambda c: setattr(c.model_config, "enforce_eager", True),
    "served-model-name": lambda c: setattr(
        c.model_config, "served_model_name", "other"
    ),
}


@pytest.mark.parametrize("change", SCHEDULER_ONLY.values(), ids=SCHEDULER_ONLY)
def test_what_only_the_scheduler_reads_leaves_engines_sharing(
    tiny_model: str, change: Callable[[Any], None]
) -> None:
    # A fleet sized differently per host still shares; and the engine core's count
    # of device blocks, set after the workers made their namespace, is not in it.
    base, changed = vllm_config(tiny_model), vllm_config(tiny_model)
    change(changed)
    assert namespace(changed) == namespace(base)


@pytest.mark.parametrize("context", ["decode", "prefill"])
def test_context_parallel_kv_is_each_ranks_own_even_for_mla(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, context: str
) -> None:
    # With context parallelism each rank holds its own tokens of a block: MLA's KV
    # is not the same on every rank then, and no rank maps another's host region.
    config = vllm_config(tiny_model)
    config.parallel_config.tensor_parallel_size = 2
    monkeypatch.setattr(type(config.model_config), "use_mla", property(lambda _: True))
    assert kv_sharding(config) == REPLICATED
    assert host_region_per_stage(config, None)
    setattr(config.parallel_config, f"{context}_context_parallel_size", 2)
    assert kv_sharding(config) == RANKS
    assert not host_region_per_stage(config, None)


@pytest.mark.parametrize(
    "flag", ["decode_context_parallel_size", "prefill_context_parallel_size"]
)
def test_context_parallelism_is_refused_before_the_engine_starts_in_one_line(
    tiny_model: str, flag: str
) -> None:
    # Each rank would cache its own share of a block's tokens: refused, never run.
    from vllm.engine.arg_utils import EngineArgs

    from vllm_cpu_offload.errors import OffloadConfigError

    parallel: dict[str, Any] = {flag: 2}
    args = EngineArgs(
        model=tiny_model, enable_cpu_offload=True, swap_space="0.01", **parallel
    )  # type: ignore[call-arg]
    with pytest.raises(OffloadConfigError) as info:
        args.create_engine_config()
    message = str(info.value)
    assert "\n" not in message and f"--{flag.replace('_', '-')} 1" in message


def test_a_connector_named_without_the_flags_refuses_context_parallelism(
    tiny_model: str,
) -> None:
    from vllm.config import KVTransferConfig

    from vllm_cpu_offload.errors import OffloadConfigError
    from vllm_cpu_offload.spec import OffloadSpec

    config = vllm_config(tiny_model)
    config.parallel_config.decode_context_parallel_size = 2
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="CPUOffloadConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"swap_space_gib": 0.01},
    )
    with pytest.raises(OffloadConfigError, match="context parallelism"):
        OffloadSpec(config, one_layer_kv_config())
