"""How engine B's KV differs from A's: on each seed, one of the ways two engines on one
store can compute other bytes for the same tokens.

- `rope-theta`: B's config overrides the rope base;
- `max-model-len`: a LongRoPE model (Phi-3's long-context rope), A and A2 started at its
  original length (short factors), B at twice it (long factors): K differs, and nothing
  in the model's files does;
- `fine-tuned-norm`: B serves, under the same path, a checkpoint in which one
  LayerNorm weight of 256 values differs (a fine-tune of small tensors, merged in
  place): the weights' files differ in 512 bytes of several MiB;
- `soft-cap`: B's config sets an attention soft-cap, a field no list of the product
  names;
- `lora-retrained`: the same model on every engine (B's KV for plain requests is A's:
  they share it), and half the requests name one LoRA adapter, by one name and path,
  whose files B's host holds retrained (other bytes): B's adapter requests must not
  take A's blocks, nor A B's. Each engine is a process of its own there, with the
  adapter's identity that process worked out (`World` keeps one per engine);
- `weights-updated`: every engine starts alike (B's KV is A's); at a step mid-run one
  of them (A, A2 or B) has its weights replaced as vLLM replaces them
  (`runtime_events.py`), and from then on computes other KV;
- `adapter-reloaded`: every engine starts alike, half the requests name one LoRA
  adapter (the same files on every host); at a step mid-run the adapter's files are
  rewritten in place on one engine's host and its workers load them, with requests
  hashed under the old files still in flight (`runtime_events.py`).

Every engine of a seed serves one model folder of its own (a copy of the tiny model,
made for the world), so that only the difference above tells B from A. The oracle gives
each engine the values of its own KV, and refuses two engines of other KV under one
namespace; a tier that took B's blocks for A's reads shows as wrong values.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = (
    "rope-theta",
    "max-model-len",
    "fine-tuned-norm",
    "soft-cap",
    "lora-retrained",
    "weights-updated",
    "adapter-reloaded",
)
# The kinds where every engine starts alike and one changes mid-run
# (`runtime_events.py`).
RUNTIME_KINDS = ("weights-updated", "adapter-reloaded")
# The adapter requests of `lora-retrained` name.
ADAPTER_NAME, ADAPTER_ID = "sim-adapter", 1
# The length the engines run at, and a LongRoPE model's original length.
MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class Identities:
    """What A and A2 (alike) and B are built with."""

    kind: str
    model: str
    b_overrides: dict[str, Any] | None = None
    b_max_model_len: int = MAX_MODEL_LEN
    # A file B's host holds other bytes of, and how (put in place for B's start and
    # for what B's process works out of it, and back after).
    b_file: Path | None = None
    b_rewrite: Callable[[Path], None] | None = field(default=None, compare=False)
    # The LoRA adapter folder requests name (`lora-retrained`), else None.
    adapter: str | None = None

    @property
    def b_kv_differs(self) -> bool:
        """Whether B's KV differs from A's for every request, from its start."""
        return self.kind not in ("lora-retrained", *RUNTIME_KINDS)

    @contextmanager
    def as_b(self) -> Iterator[None]:
        """While open: B's files in place of A's, at the same paths."""
        if self.b_file is None or self.b_rewrite is None:
            yield
            return
        original = self.b_file.read_bytes()
        self.b_rewrite(self.b_file)
        try:
            yield
        finally:
            self.b_file.write_bytes(original)


def identities_of(seed: int, base_model: str, folder: Path) -> Identities:
    """B's difference on `seed`, over a copy of `base_model` in `folder`."""
    kind = KINDS[seed % len(KINDS)]
    model = folder / "model"
    shutil.copytree(base_model, model)
    if kind == "rope-theta":
        return Identities(kind, str(model), b_overrides={"rope_theta": 20000.0})
    if kind == "max-model-len":
        _long_rope(model)
        return Identities(kind, str(model), b_max_model_len=2 * MAX_MODEL_LEN)
    if kind == "fine-tuned-norm":
        weights = model / "model.safetensors"
        return Identities(kind, str(model), b_file=weights, b_rewrite=_tune_one_norm)
    if kind == "weights-updated":
        return Identities(kind, str(model))
    if kind == "adapter-reloaded":
        return Identities(kind, str(model), adapter=str(_adapter(folder)))
    if kind == "lora-retrained":
        adapter = _adapter(folder)
        weights = adapter / "adapter_model.safetensors"
        return Identities(
            kind,
            str(model),
            b_file=weights,
            b_rewrite=_retrain,
            adapter=str(adapter),
        )
    return Identities(kind, str(model), b_overrides={"attn_logit_softcapping": 30.0})


def _adapter(folder: Path) -> Path:
    adapter = folder / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (adapter / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 64)
    return adapter


def _retrain(weights: Path) -> None:
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))


def _long_rope(model: Path) -> None:
    config_file = model / "config.json"
    config = json.loads(config_file.read_text())
    half = config["head_dim"] // 2
    config["original_max_position_embeddings"] = MAX_MODEL_LEN
    config["rope_scaling"] = {
        "type": "longrope",
        "short_factor": [1.0] * half,
        "long_factor": [2.0 + i / half for i in range(half)],
    }
    config_file.write_text(json.dumps(config))


def _tune_one_norm(weights: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    norm = "model.layers.1.input_layernorm.weight"
    tensors[norm] = tensors[norm] * 1.25
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert tensors[norm].dtype == torch.bfloat16
