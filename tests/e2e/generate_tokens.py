"""Prints, as JSON, greedy tokens for fixed prompts and whether a KV connector is
configured.

Run as a script by tests that need vLLM in a fresh process (e.g. without the plugin
loaded):
    python -m tests.e2e.generate_tokens MODEL
"""

from __future__ import annotations

import json
import os
import random
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(model: str) -> None:
    # Nothing of vllm_cpu_offload is imported here: importing the package
    # applies the plugin.
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import has_kv_transfer_group
    from vllm.inputs import TokensPrompt

    rng = random.Random(3)
    prompts = [
        TokensPrompt(prompt_token_ids=[3 + rng.randrange(4000) for _ in range(n)])
        for n in (40, 100, 300)
    ]
    llm = LLM(
        model,
        enforce_eager=True,
        block_size=32,
        num_gpu_blocks_override=32,
        max_model_len=512,
        dtype="bfloat16",
        seed=0,
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "kv_transfer_config": llm.llm_engine.vllm_config.kv_transfer_config is not None,
        "kv_transfer_group": has_kv_transfer_group(),
        "plugin_loaded": "vllm_cpu_offload.flags" in sys.modules,
    }
    print("RESULT " + json.dumps(result))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
