"""A generated MiMo-style model whose MTP layer proposes the model's own next token,
for tests of speculative decoding with `method="mtp"`.

Built as `tiny_eagle.py` builds its pair: the target is a one-layer Qwen2 model
(MiMo's architecture) with embeddings of unit RMS, norms of weight one and an epsilon
of 1e-12; its MTP layer is a copy of that decoder layer behind an `input_proj` that
passes the next token's embedding and drops the target's hidden state, so at position
p it computes what the target computes at p + 1. MTP layers live in the target's own
checkpoint (`model.mtp_layers.0.*`), which the target skips on load.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_cpu_offload.testing.tiny_eagle import TARGET_SHAPE, normalized_target
from vllm_cpu_offload.testing.tiny_model import ensure_generated, ensure_tiny_llama

_VERSION = 2


def ensure_mtp_model(root: Path | None = None) -> Path:
    """The folder of the MiMo-style model with one MTP layer, generated on first use."""
    base = ensure_tiny_llama(TARGET_SHAPE, root)
    stamp: dict[str, object] = {"base": base.name, "version": _VERSION}
    return ensure_generated("tiny-mtp", stamp, lambda f: _write(base, f), root)


def _write(base: Path, folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    config, weights = normalized_target(base)
    config |= {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "llama",  # a Qwen2 config would bring its tokenizer
        "num_nextn_predict_layers": 1,
        "use_sliding_window": False,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    hidden = config["hidden_size"]
    for proj in ("q_proj", "k_proj", "v_proj"):  # Qwen2's attention has biases
        rows = weights[f"model.layers.0.self_attn.{proj}.weight"].shape[0]
        weights[f"model.layers.0.self_attn.{proj}.bias"] = torch.zeros(rows)
    mtp = "model.mtp_layers.0."
    for name in list(weights):
        if name.startswith("model.layers.0."):
            weights[mtp + name.removeprefix("model.layers.0.")] = weights[name].clone()
    eye = torch.eye(hidden)
    weights[mtp + "input_proj.weight"] = torch.cat([torch.zeros_like(eye), eye], 1)
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[mtp + norm + ".weight"] = torch.ones(hidden)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    print(ensure_mtp_model())
