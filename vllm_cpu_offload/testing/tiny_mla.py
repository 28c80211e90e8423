"""A small DeepSeek-V2-shaped model with multi-head latent attention (MLA), generated
locally for tests.

MLA caches one latent vector per token and layer (kv_lora_rank + qk_rope_head_dim
values), the same on every tensor-parallel rank, where a Llama caches keys and values
per KV head. The model is vLLM's DeepseekV2ForCausalLM with dense MLPs only (every layer
comes before `first_k_dense_replace`, so no expert is made or loaded), no query LoRA
(q_proj straight from the hidden state), the word-level tokenizer of tiny_model.py and
random weights, written in seconds to the same cache folder and reused when present.

vLLM's CPU platform runs MLA with one of two backends, both of which take a latent of
512 + 64 = 576 values only. Where the CPU has AMX tiles it picks AMX_MLA unless told
otherwise: bf16 weights only, blocks of a multiple of 32 tokens (128 if none is given),
prefix caching on. Elsewhere, or with CPU_MLA asked for, it runs CPU_MLA, the
reference backend: any dtype, blocks of 16 tokens only (the platform sets the block
size), and prefix caching and chunked prefill off. Engines of this model take
ENGINE_KWARGS (CPU_MLA, the same on every machine) or, where amx_mla_runs_here(),
AMX_ENGINE_KWARGS.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_cpu_offload.testing.tiny_model import (
    BOS_ID,
    EOS_ID,
    ensure_generated,
    vocabulary,
)


@dataclass(frozen=True)
class TinyMlaShape:
    """The shape of a generated MLA model; the cache folder is keyed by it."""

    num_layers: int = 3
    hidden_size: int = 256
    num_heads: int = 4  # even: tensor parallel size 2 splits the heads
    intermediate_size: int = 512
    # The latent: CPU_MLA's decode kernel takes kv_lora_rank 512 with rope 64 only.
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    max_position_embeddings: int = 16384
    seed: int = 0

    @property
    def name(self) -> str:
        return (
            f"tiny-mla-l{self.num_layers}-h{self.hidden_size}-a{self.num_heads}"
            f"-i{self.intermediate_size}-kv{self.kv_lora_rank}-r{self.qk_rope_head_dim}"
            f"-n{self.qk_nope_head_dim}-v{self.v_head_dim}-s{self.seed}"
        )

    @property
    def latent_size(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


# The shape the tests use.
TEST_MLA_SHAPE = TinyMlaShape()
# Tokens per KV block: the only size CPU_MLA's decode kernel takes.
BLOCK_SIZE = 16
# Tokens per KV block for AMX_MLA, whose kernels take multiples of 32.
AMX_BLOCK_SIZE = 32

# vLLM 0.32's CPU rotary kernel rotates the (tokens, heads, dim) views MLA hands it (q's
# rope part, k_pe inside the latent) at wrong positions: outputs differ from the model's
# math, and in batches from run to run. PyTorch's own rotary embedding gives greedy
# tokens equal to a reference forward, batched or not.
_TORCH_ROTARY = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}
# For vllm.LLM / EngineArgs: the CPU_MLA backend on every machine, AMX or not, so that
# an engine's block size, dtypes and prefix caching (off) do not depend on the CPU.
ENGINE_KWARGS: dict[str, object] = {
    **_TORCH_ROTARY,
    "attention_config": {"backend": "CPU_MLA"},
}
# For vllm.LLM / EngineArgs where amx_mla_runs_here(), with dtype bfloat16 and
# block_size AMX_BLOCK_SIZE: the AMX_MLA backend, with which vLLM keeps prefix caching
# on. (Asked for elsewhere, vLLM runs CPU_MLA instead, with a 16-token block.)
AMX_ENGINE_KWARGS: dict[str, object] = {
    **_TORCH_ROTARY,
    "attention_config": {"backend": "AMX_MLA"},
}


def amx_mla_runs_here() -> bool:
    """Whether vLLM's CPU platform can run AMX_MLA on this machine: an x86 CPU with
    AMX tiles (the platform's own test)."""
    import torch
    from vllm.platforms.interface import CpuArchEnum, Platform

    x86 = Platform.get_cpu_architecture() == CpuArchEnum.X86
    return x86 and bool(torch.cpu._is_amx_tile_supported())


def ensure_tiny_mla(
    shape: TinyMlaShape = TEST_MLA_SHAPE, root: Path | None = None
) -> Path:
    """Returns the folder of the MLA model of `shape`, generating it on first use."""

    def write(folder: Path) -> None:
        _write_config(folder, shape)
        _write_weights(folder, shape)

    stamp = asdict(shape) | {"vocab_size": len(vocabulary())}
    return ensure_generated(shape.name, stamp, write, root)


def mla_config(shape: TinyMlaShape) -> dict[str, object]:
    """The model's config.json."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_heads,
        "kv_lora_rank": shape.kv_lora_rank,
        "q_lora_rank": None,
        "qk_nope_head_dim": shape.qk_nope_head_dim,
        "qk_rope_head_dim": shape.qk_rope_head_dim,
        "v_head_dim": shape.v_head_dim,
        # Dense MLPs only: a layer is MoE from index first_k_dense_replace on. vLLM's
        # loader adds n_routed_experts to a count, so it stays a number, unused.
        "first_k_dense_replace": shape.num_layers,
        "n_routed_experts": 2,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": shape.intermediate_size,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "vocab_size": len(vocabulary()),
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def weight_shapes(shape: TinyMlaShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by its name in DeepSeek-V2's checkpoints."""
    h, i = shape.hidden_size, shape.intermediate_size
    heads, rank = shape.num_heads, shape.kv_lora_rank
    qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    vocab = len(vocabulary())
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * qk, h),
            p + "self_attn.kv_a_proj_with_mqa.weight": (shape.latent_size, h),
            p + "self_attn.kv_a_layernorm.weight": (rank,),
            p + "self_attn.kv_b_proj.weight": (
                heads * (shape.qk_nope_head_dim + shape.v_head_dim),
                rank,
            ),
            p + "self_attn.o_proj.weight": (h, heads * shape.v_head_dim),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def _write_config(folder: Path, shape: TinyMlaShape) -> None:
    (folder / "config.json").write_text(json.dumps(mla_config(shape), indent=1))


def _write_weights(folder: Path, shape: TinyMlaShape) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(shape.seed)
    tensors = {}
    for name, dims in weight_shapes(shape).items():
        if len(dims) == 1:  # the RMSNorms' scales
            tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            weight = torch.randn(dims, generator=gen) * dims[-1] ** -0.5
            tensors[name] = weight.to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    print(ensure_tiny_mla())
