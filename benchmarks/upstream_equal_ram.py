"""Equal-RAM re-read of documents on vLLM's CPU platform, with the series' [6/8].

(a) prefix caching, small device cache; (b) prefix caching, device cache
given the tier's bytes; (c) OffloadingConnector (CPUOffloadingSpec), small
device cache + tier. Three engines live side by side (same OMP binding);
each repetition reads a fresh set of documents once (cold), then again
(timed), the arms interleaved. Then (d) TieringOffloadingSpec with an fs
tier: an engine reads the documents, exits, and a new engine re-reads them.

    OVERLAY="$(bash scripts/patched_vllm033.sh upstream .cache/patched-vllm033)"
    PYTHONPATH="$OVERLAY" VLLM_TARGET_DEVICE=cpu VLLM_PLUGINS= \
        VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \
        .venv-vllm033/bin/python benchmarks/upstream_equal_ram.py 3

Its figures are in upstream/RFC.md ("The equal-RAM question").
"""

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.config import KVTransferConfig

BLOCK = 32
DOC_TOKENS = 1024
NUM_DOCS = 8
SMALL_BLOCKS = 48  # holds one document (32 blocks)
TIER_BYTES = 40 << 20
VOCAB = 1024
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 5

cfg = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
# fp32 KV per block: layers * (K, V) * kv heads * head dim * 4 B * BLOCK
BLOCK_BYTES = 4 * 2 * 2 * 64 * 4 * BLOCK
MODEL = ""
PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def llm(**kw) -> LLM:
    return LLM(
        model=MODEL,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=DOC_TOKENS + 64,
        block_size=BLOCK,
        enforce_eager=True,
        seed=0,
        **kw,
    )


def read(engine: LLM, docs: list[list[int]]) -> tuple[float, int]:
    start = time.perf_counter()
    cached = 0
    for doc in docs:
        [out] = engine.generate(
            TokensPrompt(prompt_token_ids=doc), PARAMS, use_tqdm=False
        )
        cached += out.num_cached_tokens or 0
    return time.perf_counter() - start, cached


def main() -> None:
    global MODEL
    work = Path(tempfile.mkdtemp(prefix="bench-equal-ram-"))
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(work / "model")
    MODEL = str(work / "model")
    tier_blocks = TIER_BYTES // BLOCK_BYTES
    arms = {
        "a_prefix_small": llm(num_gpu_blocks_override=SMALL_BLOCKS),
        "b_prefix_equal_ram": llm(num_gpu_blocks_override=SMALL_BLOCKS + tier_blocks),
        "c_offloading": llm(
            num_gpu_blocks_override=SMALL_BLOCKS,
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={"cpu_bytes_to_use": TIER_BYTES},
            ),
        ),
    }
    rng = random.Random(0)
    times: dict[str, list[float]] = {k: [] for k in arms}
    cold: dict[str, list[float]] = {k: [] for k in arms}
    hits: dict[str, list[int]] = {k: [] for k in arms}
    for rep in range(REPS):
        docs = [
            [rng.randrange(3, VOCAB) for _ in range(DOC_TOKENS)]
            for _ in range(NUM_DOCS)
        ]
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for name in order:
            t_cold, _ = read(arms[name], docs)
            t, cached = read(arms[name], docs)
            cold[name].append(t_cold)
            times[name].append(t)
            hits[name].append(cached)
        print(rep, {k: round(v[-1], 3) for k, v in times.items()}, flush=True)
    for engine in arms.values():
        del engine
    arms.clear()

    def summary(v: list[float]) -> dict:
        return {
            "median_s": round(statistics.median(v), 3),
            "min_s": round(min(v), 3),
            "max_s": round(max(v), 3),
        }

    result = {
        "docs": NUM_DOCS,
        "doc_tokens": DOC_TOKENS,
        "tier_bytes": TIER_BYTES,
        "small_blocks": SMALL_BLOCKS,
        "equal_ram_blocks": SMALL_BLOCKS + tier_blocks,
        "reps": REPS,
        "reread": {k: summary(v) for k, v in times.items()},
        "cold": {k: summary(v) for k, v in cold.items()},
        "reread_cached_tokens": hits,
    }

    # (d) the fs tier across a restart
    fs_root = work / "fs"
    tiering = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": TIER_BYTES,
            "secondary_tiers": [{"type": "fs", "root_dir": str(fs_root)}],
        },
    )
    docs = [
        [rng.randrange(3, VOCAB) for _ in range(DOC_TOKENS)] for _ in range(NUM_DOCS)
    ]
    first = llm(num_gpu_blocks_override=SMALL_BLOCKS, kv_transfer_config=tiering)
    t_first, _ = read(first, docs)
    deadline = time.monotonic() + 120
    want = NUM_DOCS * (DOC_TOKENS // BLOCK)
    while sum(1 for p in fs_root.rglob("*") if p.is_file()) < want:
        assert time.monotonic() < deadline
        read(first, [[3]])
        time.sleep(0.5)
    del first
    second = llm(num_gpu_blocks_override=SMALL_BLOCKS, kv_transfer_config=tiering)
    t_second, cached = read(second, docs)
    del second
    result["fs_restart"] = {
        "first_engine_cold_s": round(t_first, 3),
        "restarted_engine_reread_s": round(t_second, 3),
        "restarted_cached_tokens": cached,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
