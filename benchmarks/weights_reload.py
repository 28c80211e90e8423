"""Whether a host tier serves KV of weights that were reloaded: one arm per process.

The sequence (`tests/e2e/test_weights_reload.py`'s, for any arm): an engine on a copy
of the tiny model reads a prompt (its blocks reach the arm's host tier), vLLM's prefix
cache is reset alone (`reset_prefix_cache()`, no `reset_connector`), other weights are
written over the model's files and the workers reload them
(`collective_rpc("reload_weights")`), and the prompt is read again. An engine started
on the new weights gives the reference greedy tokens. Prints one RESULT line: whether
the reread equals the reference, the first token that differs, and the arm's host hits
on the reread.

Arms: `none` (no tier), `vllm` (vLLM's own `OffloadingConnector`, `kv_offloading_size`),
`plugin` (`--enable-cpu-offload`). For `vllm` on the CPU platform, run with the patched
vLLM 0.33.0 overlay first on PYTHONPATH (scripts/patched_vllm033.sh) and
VLLM_TARGET_DEVICE=cpu (and a device KV cache of 1 GiB):

    OVERLAY="$(bash scripts/patched_vllm033.sh upstream .cache/patched-vllm033)"
    for arm in none vllm plugin; do
      VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH="$OVERLAY:$PWD" VLLM_TARGET_DEVICE=cpu \\
        .venv-vllm033/bin/python -m benchmarks.weights_reload --arm $arm
    done
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.engine_runs import print_result

BLOCK_SIZE = 32
WEIGHTS = "model.safetensors"
HOST_GIB = 0.01


def arm_kwargs(arm: str) -> dict[str, Any]:
    if arm == "none":
        return {}
    if arm == "vllm":
        return {
            "kv_offloading_size": HOST_GIB,
            "kv_transfer_config": {"kv_load_failure_policy": "recompute"},
        }
    if arm == "plugin":
        return {"enable_cpu_offload": True, "swap_space": HOST_GIB}
    raise ValueError(f"unknown arm {arm!r}; choose none, vllm or plugin")


def make_llm(model: Path, arm: str) -> Any:
    from vllm import LLM

    return LLM(
        str(model),
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=24,
        max_model_len=512,
        dtype="float32",
        seed=0,
        disable_log_stats=False,
        **arm_kwargs(arm),
    )


def greedy_tokens(llm: Any, prompt: str) -> tuple[list[int], int]:
    """The greedy tokens and vLLM's count of cached prompt tokens (device and
    connector hits)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


def shut(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run(arm: str, blocks: int) -> dict[str, Any]:
    from vllm_cpu_offload.testing.tiny_model import ensure_other_weights, random_words

    old, new = ensure_other_weights()
    prompt = random_words(random.Random(7), blocks * BLOCK_SIZE + 5)
    reference_llm = make_llm(new, "none")
    reference, _ = greedy_tokens(reference_llm, prompt)
    shut(reference_llm)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        shutil.copytree(old, model)
        llm = make_llm(model, arm)
        before, _ = greedy_tokens(llm, prompt)
        assert llm.reset_prefix_cache(), "vLLM's prefix cache did not reset"
        shutil.copyfile(new / WEIGHTS, model / WEIGHTS)
        llm.collective_rpc("reload_weights")
        after, cached = greedy_tokens(llm, prompt)
        shut(llm)
    pairs = enumerate(zip(after, reference, strict=True))
    differs = [i for i, (a, b) in pairs if a != b]
    return {
        "arm": arm,
        "prompt_tokens": blocks * BLOCK_SIZE + 5,
        "weights_change_the_answer": before != reference,
        "reread_cached_tokens": cached,
        "reread_equals_new_weights": after == reference,
        "first_differing_token": differs[0] if differs else None,
        "differing_tokens": len(differs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arm", choices=("none", "vllm", "plugin"), required=True)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    print_result(run(args.arm, args.blocks))


if __name__ == "__main__":
    main()
