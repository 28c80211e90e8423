"""End to end on real vLLM (CPU platform): weights an RL framework's worker extension
loads into the model (its own method reloading through the model runner, which ends in
the model's `load_weights`, no worker method of vLLM's around it), after a reset of
vLLM's prefix cache alone, read nothing the old weights computed from the host tier.

The extension (`--worker-extension-cls`) is the shape of an RL trainer's weight sync:
`self.model_runner.reload_weights(weights_iterator=...)`, then
`LLM.reset_prefix_cache()`, which does not reset the connector. The engine must then
answer as one started on the new weights does.
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


class WeightSync:
    """A worker extension: mixed into vLLM's worker class by vLLM."""

    model_runner: Any

    def sync_weights_from(self, path: str) -> None:
        from safetensors.torch import load_file

        # Through the model runner's in-place reload (no worker method of vLLM's),
        # which ends in the model's `load_weights` (model_loader/reload/inplace.py:95)
        # and, unlike a bare `load_weights`, restores the CPU kernels' layouts.
        weights = iter(load_file(path).items())
        self.model_runner.reload_weights(weights_iterator=weights)


def _tokens(llm: Any, prompt: str) -> list[int]:
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [output] = llm.generate([prompt], greedy, use_tqdm=False)
    return list(output.outputs[0].token_ids)


def test_weights_a_worker_extension_loads_answer_as_the_new_weights(
    tmp_path: Path,
) -> None:
    from vllm_cpu_offload.testing.tiny_model import ensure_other_weights, random_words

    old, new = ensure_other_weights()
    model = tmp_path / "model"
    shutil.copytree(old, model)
    prompt = random_words(random.Random(11), 4 * BLOCK_SIZE + 5)

    reference = make_llm(str(new), offload=False)
    try:
        expected = _tokens(reference, prompt)
    finally:
        shutdown(reference)

    llm = make_llm(
        str(model),
        offload=True,
        worker_extension_cls=f"{__name__}.{WeightSync.__qualname__}",
    )
    try:
        sched = scheduler_connector(llm).scheduler
        assert _tokens(llm, prompt) != expected, "both weights answer alike"
        assert sched.pool.num_used >= 4
        assert llm.reset_prefix_cache()
        llm.collective_rpc("sync_weights_from", args=(str(new / WEIGHTS),))
        assert _tokens(llm, prompt) == expected
        # What the new weights computed is stored and read back from host.
        loaded = sched.stats.loaded_blocks
        assert llm.reset_prefix_cache()
        assert _tokens(llm, prompt) == expected
        assert sched.stats.loaded_blocks - loaded == 4
    finally:
        shutdown(llm)
