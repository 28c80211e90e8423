"""A small Llama-style model generated locally, for tests, benchmarks and the demo.

Nothing can be downloaded here, and KV reuse does not depend on the weights, so the
model is a config, a word-level tokenizer (one token per word, which makes prompt
lengths exact) and random weights, written in seconds to a cache folder and reused when
present.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from vllm_cpu_offload.file_digest import cache_root

VOCAB_WORDS = 4000
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
BOS_ID, EOS_ID = 1, 2  # "<s>", "</s>"
# The words of vLLM's own long-document benchmark script (documents are "{i}hi hi hi
# ...", warm-up prompts "This is warm up request {i}hi hi ..."), after the `w` words so
# that the ids and weights of everything before them stay as they were.
EXTRA_WORDS = (
    "hi",
    *(f"{i}hi" for i in range(256)),
    "This",
    "is",
    "warm",
    "up",
    "request",
)


@dataclass(frozen=True)
class TinyLlamaShape:
    """The shape of a generated model; the cache folder is keyed by it."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 16384
    seed: int = 0
    # Gemma-2 style when set: even layers attend to a sliding window of this many
    # tokens, odd layers to the whole context, and vLLM's hybrid KV cache manager
    # makes two groups.
    sliding_window: int | None = None

    @property
    def name(self) -> str:
        window = f"-sw{self.sliding_window}" if self.sliding_window else ""
        return (
            f"tiny-llama-l{self.num_layers}-h{self.hidden_size}-a{self.num_heads}"
            f"-kv{self.num_kv_heads}-i{self.intermediate_size}-s{self.seed}{window}"
        )


# The shape the tests and the demo use: starts in about 20 s on a 2-core CPU.
TEST_SHAPE = TinyLlamaShape()


def vocabulary() -> list[str]:
    """Special tokens, the words `w0 .. w{VOCAB_WORDS-1}`, then `EXTRA_WORDS`."""
    return [*SPECIAL_TOKENS, *(f"w{i}" for i in range(VOCAB_WORDS)), *EXTRA_WORDS]


def _stamp(shape: TinyLlamaShape) -> dict[str, object]:
    stamp = asdict(shape) | {"vocab_size": len(vocabulary())}
    if stamp["sliding_window"] is None:
        # the stamp of models written before the field existed
        del stamp["sliding_window"]
    return stamp


def random_words(rng: random.Random, n: int) -> str:
    """A prompt of exactly `n` tokens for the generated tokenizer."""
    return " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(n))


def random_token_ids(rng: random.Random, n: int) -> list[int]:
    """`n` token ids of words (no special tokens) of the generated tokenizer."""
    first = len(SPECIAL_TOKENS)
    return [first + rng.randrange(VOCAB_WORDS) for _ in range(n)]


def ensure_tiny_llama(
    shape: TinyLlamaShape = TEST_SHAPE, root: Path | None = None
) -> Path:
    """Returns the folder of the model of `shape`, generating it on first use."""

    def write(folder: Path) -> None:
        _write_config(folder, shape)
        _write_weights(folder, shape)

    return ensure_generated(shape.name, _stamp(shape), write, root)


def ensure_other_weights(shape: TinyLlamaShape = TEST_SHAPE) -> tuple[Path, Path]:
    """The folders of the model of `shape` and of one laid out alike with other
    weights (the next seed): what a weight update or reload puts in its place."""
    return ensure_tiny_llama(shape), ensure_tiny_llama(
        replace(shape, seed=shape.seed + 1)
    )


def ensure_generated(
    name: str,
    stamp: dict[str, object],
    write: Callable[[Path], None],
    root: Path | None = None,
) -> Path:
    """The cache folder `models/{name}` of a generated model: the tokenizer, its
    generation config and what `write(folder)` writes (the model's config and weights),
    made again unless the folder's stamp equals `stamp`."""
    folder = (root or cache_root()) / "models" / name
    stamp_file = folder / "shape.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    )
    write(folder)
    stamp_file.write_text(json.dumps(stamp))  # last: a half-written folder is redone
    return folder


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "model_max_length": 1 << 20,
                "chat_template": (
                    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
                ),
            }
        )
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )


def _write_config(folder: Path, shape: TinyLlamaShape) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": len(vocabulary()),
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if shape.sliding_window:
        config["sliding_window"] = shape.sliding_window
        config["layer_types"] = [
            "sliding_attention" if layer % 2 == 0 else "full_attention"
            for layer in range(shape.num_layers)
        ]
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def _write_weights(folder: Path, shape: TinyLlamaShape) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(shape.seed)
    h, i = shape.hidden_size, shape.intermediate_size
    head_dim = h // shape.num_heads
    kv = shape.num_kv_heads * head_dim
    base = len(vocabulary()) - len(EXTRA_WORDS)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * dims[-1] ** -0.5).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": rand(base, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rand(base, h),
    }
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
    # The extra words' rows come last from the generator: every other
    # weight is unchanged.
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = torch.cat([tensors[name], rand(len(EXTRA_WORDS), h)])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    print(ensure_tiny_llama())
