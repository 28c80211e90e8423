"""TTFT of a re-read served from vLLM's own host tier, on the patched vLLM tree of
`upstream/` ([KV offload][4/4]), CPU platform: three ways to load the hit.

    across   --kv-offloading-size alone: the request waits for its load, then is
             scheduled a step later (vLLM's default)
    whole    sync_load_budget_bytes: loaded inside the step, as one job before the
             forward pass
    layered  sync_load_budget_bytes and layerwise_sync_loads ([4/4]): loaded inside
             the step, layer by layer as the forward pass reaches each layer

One engine per arm, all three alive; each round empties every engine's device prefix
cache and re-reads one document in each arm in turn (the arms' order rotates), so the
arms see the same machine load. A generated Llama with random weights (nothing to
download). Prints a table (median and range per arm) and writes JSON.

Run on the patched tree (this repository's dev runner overlays it on the vLLM 0.33
environment):

    bash .cache/dev/run.sh python $PWD/benchmarks/upstream_layered_loads.py \
        --out /tmp/layered_loads.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
from vllm.v1.kv_offload.cpu.cpu_worker import CPUPlatformOffloadingWorker
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

BLOCK_SIZE = 32
VOCAB_SIZE = 1024
ARMS = ("across", "whole", "layered")


class AcrossStepsWorker(CPUPlatformOffloadingWorker):
    """The CPU platform worker, asserting that every load spans steps."""

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        assert not expedited, "an in-step load in the across arm"
        return super().submit_load(job_id, src_spec, dst_spec)

    def submit_layered_load(self, job_id, src_spec, dst_spec):
        raise AssertionError("a layered load in the across arm")


class LayeredWorker(CPUPlatformOffloadingWorker):
    """The CPU platform worker, asserting that every load is layered."""

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        raise AssertionError("a whole-job load in the layered arm")


class WholeJobWorker(CPUPlatformOffloadingWorker):
    """The CPU platform worker, asserting that every load is one in-step job."""

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        assert expedited, "a load across steps in the whole arm"
        return super().submit_load(job_id, src_spec, dst_spec, expedited)

    def submit_layered_load(self, job_id, src_spec, dst_spec):
        raise AssertionError("a layered load in the whole arm")


class AcrossSpec(CPUOffloadingSpec):
    def get_worker(self, kv_caches):
        return AcrossStepsWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)


class WholeSpec(CPUOffloadingSpec):
    def get_worker(self, kv_caches):
        return WholeJobWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)


class LayeredSpec(CPUOffloadingSpec):
    def get_worker(self, kv_caches):
        return LayeredWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)


def make_model(path: str, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def make_engine(model: str, arm: str, doc_tokens: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    # Each arm's worker asserts that its loads take the arm's path.
    extra: dict = {
        "spec_name": arm.capitalize() + "Spec",
        "spec_module_path": "upstream_layered_loads",
    }
    if arm != "across":
        extra["sync_load_budget_bytes"] = 1 << 30
    if arm == "layered":
        extra["layerwise_sync_loads"] = True
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        max_model_len=doc_tokens + 64,
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        seed=0,
        num_gpu_blocks_override=doc_tokens // BLOCK_SIZE + 8,
        kv_offloading_size=0.25,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
    )


def read(llm, prompt: list[int]) -> tuple[float, int, list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    [out] = llm.generate(TokensPrompt(prompt_token_ids=prompt), params, use_tqdm=False)
    return time.perf_counter() - start, out.num_cached_tokens, out.outputs[0].token_ids


def empty_device_cache(llm) -> None:
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "stores did not finish"
        read(llm, [3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    # Not a whole number of blocks: the tokens past the last full block are
    # computed, which an in-step load needs (a hit of a whole prompt is not).
    parser.add_argument("--doc-tokens", type=int, default=4010)
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    # The engines' processes import the arms' specs from this file.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("VLLM_SLEEP_WHEN_IDLE", "1")

    rng = random.Random(0)
    docs = [
        [rng.randrange(3, VOCAB_SIZE) for _ in range(args.doc_tokens)]
        for _ in range(args.docs)
    ]
    with tempfile.TemporaryDirectory() as model:
        make_model(model, args.layers)
        engines = {arm: make_engine(model, arm, args.doc_tokens) for arm in ARMS}
        for llm in engines.values():
            for doc in docs:
                read(llm, doc)  # cold: computed, then stored to host memory
        hit_tokens = args.doc_tokens // BLOCK_SIZE * BLOCK_SIZE
        ttft: dict[str, list[float]] = {arm: [] for arm in ARMS}
        outputs: dict[str, set] = {arm: set() for arm in ARMS}
        for r in range(args.rounds):
            doc = docs[r % len(docs)]
            order = ARMS[r % 3 :] + ARMS[: r % 3]
            for arm in order:
                empty_device_cache(engines[arm])
                seconds, cached, tokens = read(engines[arm], doc)
                assert cached == hit_tokens, (arm, cached)
                ttft[arm].append(seconds)
                outputs[arm].add((r % len(docs), tuple(tokens)))
        for llm in engines.values():
            del llm
    assert outputs["across"] == outputs["whole"] == outputs["layered"]

    # per token and layer: K and V of 2 KV heads of 64 bf16 values
    kv_bytes = args.layers * 2 * 2 * 64 * 2 * hit_tokens
    print(
        f"{args.layers} layers, {args.doc_tokens}-token documents, "
        f"{kv_bytes / 2**20:.1f} MiB loaded per re-read, {args.rounds} rounds"
    )
    print(f"{'arm':8} {'TTFT median ms':>15} {'min':>8} {'max':>8}")
    result = {"args": vars(args), "kv_bytes_per_reread": kv_bytes, "arms": {}}
    for arm in ARMS:
        ms = [s * 1e3 for s in ttft[arm]]
        med = statistics.median(ms)
        print(f"{arm:8} {med:15.1f} {min(ms):8.1f} {max(ms):8.1f}")
        result["arms"][arm] = {"ttft_ms": ms, "median_ms": med}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
