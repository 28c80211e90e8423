"""Config-only stand-ins for the Hugging Face models vLLM's unit-test helpers name.

Those helpers build a `ModelConfig` for a hub model (facebook/opt-125m, ...) only to
read its architecture and sizes; no test here loads weights or a tokenizer. This machine
cannot reach the hub, so each model gets its config.json in a Hugging Face cache laid
out as the hub client writes it, and the suite runs with HF_HUB_OFFLINE=1 against that
cache. The sizes are the published ones, since some tests derive block counts from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REVISION = "0" * 40  # the snapshot's commit; offline lookups resolve refs/main to it

_LLAMA_7B_TEXT: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "vocab_size": 32064,
    "torch_dtype": "float16",
}

CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 768,
        "ffn_dim": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 2048,
        "word_embed_proj_dim": 768,
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "vocab_size": 50272,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "torch_dtype": "float16",
    },
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 1024,
        "ffn_dim": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "max_position_embeddings": 2048,
        "word_embed_proj_dim": 512,
        "do_layer_norm_before": False,
        "activation_function": "relu",
        "vocab_size": 50272,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "torch_dtype": "float16",
    },
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": 32000,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "pad_token_id": 32001,
        "torch_dtype": "float16",
        "text_config": _LLAMA_7B_TEXT,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "image_size": 336,
            "patch_size": 14,
            "projection_dim": 768,
        },
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-6,
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    },
}


def write(hf_home: Path) -> Path:
    """Writes every stand-in under hf_home/hub (idempotent); returns hf_home for
    HF_HOME."""
    hub = hf_home / "hub"
    for repo, config in CONFIGS.items():
        entry = hub / ("models--" + repo.replace("/", "--"))
        snapshot = entry / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (entry / "refs").mkdir(exist_ok=True)
        (entry / "refs" / "main").write_text(REVISION)
    return hf_home
