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
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from vllm_cpu_offload.testing.tiny_model import (
    TinyLlamaShape,
    ensure_generated,
    ensure_tiny_llama,
)

TARGET_SHAPE = TinyLlamaShape(num_layers=1)
_VERSION = 1


def ensure_eagle_pair(root: Path | None = None) -> tuple[Path, Path]:
    """The folders of the target and of its EAGLE head, generated on first use."""
    base = ensure_tiny_llama(TARGET_SHAPE, root)
    stamp: dict[str, object] = {"base": base.name, "version": _VERSION}
    target = ensure_generated(
        "tiny-eagle-target", stamp, lambda f: _write_target(base, f), root
    )
    head = ensure_generated(
        "tiny-eagle-head", stamp, lambda f: _write_head(target, f), root
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


def _write_target(base: Path, folder: Path) -> None:
    from safetensors.torch import save_file

    config, weights = normalized_target(base)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_head(target: Path, folder: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copy(target / "config.json", folder / "config.json")
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    eye = torch.eye(hidden)
    weights = {"fc.weight": torch.cat([eye, torch.zeros_like(eye)], dim=1)}
    for name, tensor in load_file(str(target / "model.safetensors")).items():
        if name.startswith("model.layers.0.") and "input_layernorm" not in name:
            weights[name.removeprefix("model.")] = tensor
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    print(*ensure_eagle_pair())
