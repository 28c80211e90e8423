"""One engine with speculative decoding runs a scenario; prints what its measured
requests gave (tokens, cached tokens, host hit tokens, acceptance rate) as a RESULT
line.

Run in a fresh process (tests/e2e/test_speculative_decoding.py): vLLM's CPU platform
rebinds its Triton kernels by scanning every imported module, which fails on an object
of llvmlite that an earlier test of the same process may have imported.

Scenarios:
- `rereads`: every document read `--passes` times, the last pass measured;
- `continuations`: a prefix of two blocks and one continuation, then, once the device
  cache lost them, the same prefix with another continuation, measured. An EAGLE-style
  drafter's KV at the prefix's last position was computed from the first
  continuation's first token.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

DOCS = 4
WORDS, REPEATS = 40, 12  # each document: 40 words, 12 times (480 tokens, 15 blocks)
TRIALS = 8  # of the continuations scenario


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


class Measured:
    """The measured requests' outputs and the acceptance counters around them."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.outputs: list[Any] = []
        self.accepted = self.drafted = 0.0

    def generate(self, prompt: str, params: Any) -> None:
        before = _counters(self.llm)
        self.outputs.append(self.llm.generate([prompt], params, use_tqdm=False)[0])
        after = _counters(self.llm)
        self.accepted += after["spec_decode_num_accepted_tokens"]
        self.accepted -= before["spec_decode_num_accepted_tokens"]
        self.drafted += after["spec_decode_num_draft_tokens"]
        self.drafted -= before["spec_decode_num_draft_tokens"]


def _rereads(llm: Any, params: Any, passes: int) -> Measured:
    docs, measured = documents(), Measured(llm)
    for _ in range(passes - 1):
        for doc in docs:
            llm.generate([doc], params, use_tqdm=False)
    for doc in docs:
        measured.generate(doc, params)
    return measured


def _continuations(llm: Any, params: Any) -> Measured:
    from vllm_cpu_offload.testing.tiny_model import random_words

    rng, measured = random.Random(1), Measured(llm)
    for _ in range(TRIALS):
        prefix = random_words(rng, 64)
        first = f"{prefix} {random_words(rng, 40)}"
        other = f"{prefix} {random_words(rng, 40)}"
        llm.generate([first], params, use_tqdm=False)
        llm.generate([random_words(rng, 190)], params, use_tqdm=False)  # evicts it
        measured.generate(other, params)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument(
        "method", choices=["ngram", "draft_model", "eagle", "eagle3", "mtp"]
    )
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--device-blocks", type=int, required=True)
    parser.add_argument("--scenario", default="rereads")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--swap-space-path")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--swap-space-remote")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--hybrid", action="store_true", help="EAGLE's target with a window group"
    )
    args = parser.parse_args()
    from vllm import SamplingParams

    from tests.e2e.conftest import make_llm, scheduler_connector, shutdown

    model = args.model
    speculative: dict[str, Any] = {"method": args.method, "num_speculative_tokens": 3}
    if args.method == "ngram":
        speculative |= {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif args.method == "draft_model":
        speculative |= {"model": model}
    elif args.method == "mtp":
        from vllm_cpu_offload.testing.tiny_mtp import ensure_mtp_model

        model = str(ensure_mtp_model())
        speculative["num_speculative_tokens"] = 1  # MiMo's MTP predicts one
    elif args.method == "eagle3":
        from vllm_cpu_offload.testing.tiny_eagle import ensure_eagle3_pair

        target, head = ensure_eagle3_pair()
        model, speculative["model"] = str(target), str(head)
    else:
        from vllm_cpu_offload.testing.tiny_eagle import ensure_eagle_pair

        target, head = ensure_eagle_pair(hybrid=args.hybrid)
        model, speculative["model"] = str(target), str(head)
    # Room in host memory for every document, the drafter's layers included.
    host: dict[str, Any] = dict(swap_space=0.05) if args.offload else {}
    if args.swap_space_path:
        host["swap_space_path"] = args.swap_space_path
    if args.swap_space_remote:
        host["swap_space_remote"] = args.swap_space_remote
    if args.max_model_len:
        host["max_model_len"] = args.max_model_len
    llm = make_llm(
        model,
        offload=args.offload,
        num_gpu_blocks_override=args.device_blocks,
        speculative_config=speculative,
        disable_log_stats=False,
        dtype=args.dtype,
        **host,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    if args.scenario == "rereads":
        measured = _rereads(llm, params, args.passes)
    else:
        measured = _continuations(llm, params)
    if args.swap_space_remote:
        # One more step plans the write-through of the last document's blocks;
        # shutting down waits for the writes in flight.
        llm.generate(["one more step"], params, use_tqdm=False)
    connector = scheduler_connector(llm)
    stats = connector.scheduler.stats if connector else None
    result = dict(
        tokens=[list(o.outputs[0].token_ids) for o in measured.outputs],
        cached=[o.num_cached_tokens for o in measured.outputs],
        host_hit_tokens=stats.hit_tokens if stats else 0,
        loaded_by_group=dict(stats.loaded_by_group) if stats else {},
        remote_hit_tokens=stats.remote_hit_tokens if stats else 0,
        drafted=measured.drafted,
        acceptance=measured.accepted / measured.drafted if measured.drafted else None,
    )
    shutdown(llm)  # a tier on disk is closed as a server's would be
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
