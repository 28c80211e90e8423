"""One engine with speculative decoding reads every document twice; prints the
re-reads' tokens, cached tokens, host hit tokens and acceptance rate as a RESULT line.

Run in a fresh process (tests/e2e/test_speculative_decoding.py): vLLM's CPU platform
rebinds its Triton kernels by scanning every imported module, which fails on an object
of llvmlite that an earlier test of the same process may have imported.

    python -m tests.e2e.speculative_run MODEL METHOD on|off BLOCKS [PASSES [PATH]]

PASSES (default 2) reads of every document, the last one measured; PATH is
--swap-space-path (a tier that survives restarts).
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

DOCS = 4
WORDS, REPEATS = 40, 12  # each document: 40 words, 12 times (480 tokens, 15 blocks)


def documents() -> list[str]:
    from vllm_cpu_offload.testing.tiny_model import random_words

    rng = random.Random(0)
    return [" ".join([random_words(rng, WORDS)] * REPEATS) for _ in range(DOCS)]


def _counters(llm: Any) -> dict[str, float]:
    names = ("spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens")
    found = {n: 0.0 for n in names}
    for metric in llm.get_metrics():
        name = metric.name.split(":")[-1]
        if name in names:
            found[name] = metric.value
    return found


def main(
    model: str,
    method: str,
    offload: bool,
    device_blocks: int,
    passes: int = 2,
    path: str | None = None,
) -> None:
    from vllm import SamplingParams

    from tests.e2e.conftest import make_llm, scheduler_connector, shutdown

    speculative: dict[str, Any] = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        speculative |= {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
    else:
        speculative |= {"model": model}
    # Room in host memory for every document, the drafter's layers included.
    host: dict[str, Any] = dict(swap_space=0.05) if offload else {}
    if path:
        host["swap_space_path"] = path
    llm = make_llm(
        model,
        offload=offload,
        num_gpu_blocks_override=device_blocks,
        speculative_config=speculative,
        disable_log_stats=False,
        **host,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    docs = documents()
    for _ in range(passes - 1):
        for doc in docs:
            llm.generate([doc], params, use_tqdm=False)
    before = _counters(llm)
    outs = [llm.generate([doc], params, use_tqdm=False)[0] for doc in docs]
    after = _counters(llm)
    accepted, drafted = (
        after[n] - before[n]
        for n in ("spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens")
    )
    connector = scheduler_connector(llm)
    result = dict(
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        cached=[o.num_cached_tokens for o in outs],
        host_hit_tokens=connector.scheduler.stats.hit_tokens if connector else 0,
        drafted=drafted,
        acceptance=accepted / drafted if drafted else None,
    )
    shutdown(llm)  # a tier on disk is closed as a server's would be
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    model, method, on, blocks, *rest = sys.argv[1:]
    main(
        model,
        method,
        on == "on",
        int(blocks),
        passes=int(rest[0]) if rest else 2,
        path=rest[1] if len(rest) > 1 else None,
    )
