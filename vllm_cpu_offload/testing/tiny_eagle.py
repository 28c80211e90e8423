"""A generated target model and an EAGLE head that proposes the target's own next
token, for tests of speculative decoding whose acceptance rate is a sensitive check.

The target has one decoder layer, embeddings of unit RMS, RMS norms of weight one and
an epsilon of 1e-12, in fp32: its input norm then changes nothing, and its final norm
only scales the logits. The EAGLE head is a copy of that layer (EAGLE's first layer has
no input norm) behind an `fc` that passes the token's embedding and drops the target's
hidden state; it shares the target's embeddings and LM head. At position p it reads the
token of p + 1 at rotary position p: attention depends on relative positions only, so
it computes what the target computes at p + 1 and proposes the target's next token.
Wrong drafter KV (a position computed from another next token) shows as lost
acceptance.

The hybrid pair's target has a sliding-window layer before that layer, muted (its
output projections are zero, so it adds nothing to the residual stream) but with KV of
its own: vLLM's hybrid manager keeps it in a sliding-window KV cache group, and the
EAGLE head's layer joins the full-attention group, as on hybrid models served with
EAGLE.

An EAGLE-3 head adds its attention to the target's hidden state (normed), not to the
token's embedding, and reads the embedding only through its attention's input (the
embedding and the hidden state side by side). Its pair's target has the layer's output
projections scaled by EAGLE3_SCALE, so that attention and MLP outweigh the embedding in
the residual stream; the head's `hidden_norm` is zero and its attention reads the
embedding half alone. It then proposes the target's next token but where the embedding
the target adds tips the choice (acceptance 0.97 here, not 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_cpu_offload.testing.tiny_model import (
    TinyLlamaShape,
    ensure_generated,
    ensure_tiny_llama,
)

TARGET_SHAPE = TinyLlamaShape(num_layers=1)
# Layer 0 slides over 64 tokens (muted), layer 1 attends to everything.
HYBRID_TARGET_SHAPE = TinyLlamaShape(num_layers=2, sliding_window=64)
EAGLE3_SCALE = 3000.0
_VERSION = 1


def ensure_eagle_pair(
    root: Path | None = None, *, hybrid: bool = False
) -> tuple[Path, Path]:
    """The folders of the target and of its EAGLE head, generated on first use."""
    base = ensure_tiny_llama(HYBRID_TARGET_SHAPE if hybrid else TARGET_SHAPE, root)
    stamp: dict[str, object] = {"base": base.name, "version": _VERSION}
    name = "tiny-eagle-hybrid" if hybrid else "tiny-eagle"
    target = ensure_generated(
        f"{name}-target", stamp, lambda f: _write_target(base, f), root
    )
    head = ensure_generated(
        f"{name}-head", stamp, lambda f: _write_head(target, f), root
    )
    return target, head


def ensure_eagle3_pair(root: Path | None = None) -> tuple[Path, Path]:
    """The folders of the EAGLE-3 pair's target and head, generated on first use."""
    base = ensure_tiny_llama(TARGET_SHAPE, root)
    stamp: dict[str, object] = {"base": base.name, "version": _VERSION}
    target = ensure_generated(
        "tiny-eagle3-target",
        stamp,
        lambda f: _write_target(base, f, scale=EAGLE3_SCALE),
        root,
    )
    head = ensure_generated(
        "tiny-eagle3-head", stamp, lambda f: _write_eagle3_head(target, f), root
    )
    return target, head


def normalized_target(base: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config and fp32 weights of `base` with embeddings of unit RMS and a norm
    epsilon of 1e-12, so that an RMS norm of an embedding changes nothing."""
    from safetensors.torch import load_file

    config = json.loads((base / "config.json").read_text())
    config |= {"rms_norm_eps": 1e-12, "torch_dtype": "float32"}
    weights = {
        name: t.float()
        for name, t in load_file(str(base / "model.safetensors")).items()
    }
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, True).sqrt()
    return config, weights


def _write_target(base: Path, folder: Path, scale: float = 1.0) -> None:
    from safetensors.torch import save_file

    config, weights = normalized_target(base)
    last = config["num_hidden_layers"] - 1
    for layer in range(last + 1):  # all but the last muted, the last scaled
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            weights[f"model.layers.{layer}.{proj}.weight"] *= (
                scale if layer == last else 0.0
            )
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_head(target: Path, folder: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    config["num_hidden_layers"] = 1  # one full-attention layer
    for key in ("sliding_window", "layer_types"):
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    eye = torch.eye(config["hidden_size"])
    weights = {"fc.weight": torch.cat([eye, torch.zeros_like(eye)], dim=1)}
    for name, tensor in load_file(str(target / "model.safetensors")).items():
        if name.startswith(last) and "input_layernorm" not in name:
            weights["layers.0." + name.removeprefix(last)] = tensor
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_eagle3_head(target: Path, folder: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    config |= {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {"use_aux_hidden_state": False},
        "norm_before_residual": True,  # the residual is hidden_norm's output: zero
        "draft_vocab_size": config["vocab_size"],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    hidden = config["hidden_size"]
    target_weights = load_file(str(target / "model.safetensors"))
    weights = {
        "layers.0.hidden_norm.weight": torch.zeros(hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": target_weights["lm_head.weight"].clone(),
    }
    for name, tensor in target_weights.items():
        if not name.startswith("model.layers.0."):
            continue
        if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
            # The attention's input is [embedding, hidden state]: the first half.
            tensor = torch.cat([tensor, torch.zeros_like(tensor)], dim=1)
        weights[name.removeprefix("model.")] = tensor.clone()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    print(*ensure_eagle_pair(), *ensure_eagle3_pair())
