"""End to end on real vLLM (CPU platform): weights reloaded while the engine runs, after
a reset of vLLM's prefix cache alone, read nothing the old weights computed from the
host tier.

A caller resets vLLM's prefix cache (`reset_prefix_cache()`, no `reset_connector`),
writes other weights over the model's files and has the workers reload them
(`collective_rpc("reload_weights")`). vLLM then serves nothing of before; the engine
with the host tier must answer as an engine started on the new weights does. Before
the host tier was told of the reload, it loaded the prompt's blocks of the old
weights, and the first greedy token already differed.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import make_llm, scheduler_connector, shutdown

pytestmark = pytest.mark.e2e

WEIGHTS = "model.safetensors"


def _greedy() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tokens(llm: Any, prompt: str) -> list[int]:
    [output] = llm.generate([prompt], _greedy(), use_tqdm=False)
    return list(output.outputs[0].token_ids)


def test_a_reload_after_a_prefix_cache_reset_answers_as_the_new_weights(
    tmp_path: Path,
) -> None:
    from vllm_cpu_offload.testing.tiny_model import ensure_other_weights, random_words

    old, new = ensure_other_weights()
    model = tmp_path / "model"
    shutil.copytree(old, model)
    prompt = random_words(random.Random(7), 4 * BLOCK_SIZE + 5)

    reference = make_llm(str(new), offload=False)
    try:
        expected = _tokens(reference, prompt)
    finally:
        shutdown(reference)

    llm = make_llm(str(model), offload=True)
    try:
        sched = scheduler_connector(llm).scheduler
        before = _tokens(llm, prompt)
        assert before != expected, "both weights answer alike: the test shows nothing"
        assert sched.pool.num_used >= 4
        assert llm.reset_prefix_cache()
        shutil.copyfile(new / WEIGHTS, model / WEIGHTS)
        llm.collective_rpc("reload_weights")
        failed, stored = sched.stats.failed_loads, sched.stats.stored_blocks
        assert _tokens(llm, prompt) == expected
        # The step planned before the tier heard of the reload: its host load is
        # refused and recomputed, and what the new weights computed is stored...
        assert sched.stats.failed_loads == failed + 1
        assert sched.stats.stored_blocks - stored == 4
        # ... and read back from host.
        loaded = sched.stats.loaded_blocks
        assert llm.reset_prefix_cache()
        assert _tokens(llm, prompt) == expected
        assert sched.stats.loaded_blocks - loaded == 4
        assert sched.stats.failed_loads == failed + 1
    finally:
        shutdown(llm)
