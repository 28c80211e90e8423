"""Long-document re-reads with speculative decoding: the host tier's speed-up and the
acceptance rate, with and without the tier, for each kind of drafter.

N documents of L tokens are read once, then re-read in the same order with a few
output tokens each; the device KV cache holds about a quarter of them, so without the
tier every re-read is recomputed. Each arm is a fresh process (the engine in-process,
the same cores and settings in every arm); arms run in pairs, tier off and on, their
order alternating (off on, on off, ...), `--pairs` times. The table gives, per drafter,
the median re-read time of each arm with its range, the speed-up, and the re-reads'
acceptance rate with and without the tier.

Drafters: none and ngram (drafts from the prompt; random documents give it little to
draft), the target as its own draft model, on the generated 4-layer model; none and
EAGLE on the 1-layer target whose EAGLE head proposes its next token
(`testing/tiny_eagle.py`); none and MTP on the 1-layer MiMo-style model whose MTP layer
does (`testing/tiny_mtp.py`; one speculative token, all MiMo's MTP predicts). The
speed-up with a drafter is compared with the speed-up
without one on the same target.

    python benchmarks/speculative_decoding.py                # N = 16, 2 pairs
    python benchmarks/speculative_decoding.py --docs 8 --pairs 1
    python benchmarks/speculative_decoding.py --cases mtp/none mtp/mtp
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK_SIZE = 32
# (target, drafter): "tiny" is the 4-layer generated model, "eagle" the 1-layer target
# of testing/tiny_eagle.py, "mtp" the model of testing/tiny_mtp.py.
CASES = [
    ("tiny", "none"),
    ("tiny", "ngram"),
    ("tiny", "draft_model"),
    ("eagle", "none"),
    ("eagle", "eagle"),
    ("mtp", "none"),
    ("mtp", "mtp"),
]


def _models(target: str) -> tuple[str, str | None]:
    from vllm_cpu_offload.testing.tiny_eagle import ensure_eagle_pair
    from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama
    from vllm_cpu_offload.testing.tiny_mtp import ensure_mtp_model

    if target == "mtp":
        return str(ensure_mtp_model()), None  # its MTP layer is in its checkpoint
    if target == "eagle":
        model, head = ensure_eagle_pair()
        return str(model), str(head)
    return str(ensure_tiny_llama()), None


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    """One engine: every document read, then re-read; the re-reads measured."""
    from vllm import LLM, SamplingParams

    from vllm_cpu_offload.testing.tiny_model import random_words

    model, head = _models(args.target)
    kwargs: dict[str, Any] = dict(
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=args.docs * args.doc_tokens // BLOCK_SIZE // 4 + 8,
        max_model_len=args.doc_tokens + 64,
        max_num_seqs=4,
        dtype="float32",
        seed=0,
        disable_log_stats=False,
    )
    if args.drafter != "none":
        speculative: dict[str, Any] = {
            "method": args.drafter,
            "num_speculative_tokens": 3,
        }
        if args.drafter == "ngram":
            speculative |= {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
        elif args.drafter == "mtp":
            speculative["num_speculative_tokens"] = 1
        else:
            speculative["model"] = head or model
        kwargs["speculative_config"] = speculative
    if args.tier == "on":
        kwargs |= dict(enable_cpu_offload=True, swap_space=1)
    llm = LLM(model, **kwargs)
    rng = random.Random(0)
    docs = [random_words(rng, args.doc_tokens) for _ in range(args.docs)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def counters() -> dict[str, float]:
        return {
            m.name: m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")
        }

    for doc in docs:
        llm.generate([doc], params, use_tqdm=False)
    before, start = counters(), time.perf_counter()
    outs = [llm.generate([doc], params, use_tqdm=False)[0] for doc in docs]
    seconds = time.perf_counter() - start
    after = counters()

    def delta(name: str) -> float:
        key = f"vllm:spec_decode_num_{name}_tokens"
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafted = delta("draft")
    return dict(
        seconds=seconds,
        cached=sum(o.num_cached_tokens for o in outs),
        acceptance=delta("accepted") / drafted if drafted else None,
        tokens=[list(o.outputs[0].token_ids) for o in outs],
    )


def _arm(args: argparse.Namespace, target: str, drafter: str, tier: str) -> Any:
    cmd = [
        sys.executable,
        __file__,
        "--run-arm",
        "--target",
        target,
        "--drafter",
        drafter,
        "--tier",
        tier,
        "--docs",
        str(args.docs),
        "--doc-tokens",
        str(args.doc_tokens),
        "--max-tokens",
        str(args.max_tokens),
    ]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line:
        raise SystemExit(f"arm {target}/{drafter}/{tier} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[0].removeprefix("RESULT "))


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument(
        "--cases",
        nargs="+",
        default=[f"{t}/{d}" for t, d in CASES],
        help="target/drafter pairs to run (default: all)",
    )
    parser.add_argument("--out", default="benchmarks/results/speculative_decoding.json")
    parser.add_argument("--run-arm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--drafter", help=argparse.SUPPRESS)
    parser.add_argument("--tier", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_arm:
        print("RESULT " + json.dumps(run_arm(args)))
        return
    results: dict[str, dict[str, list[Any]]] = {}
    for case in args.cases:
        target, drafter = case.split("/")
        runs: dict[str, list[Any]] = {"off": [], "on": []}
        for pair in range(args.pairs):
            for tier in ("off", "on") if pair % 2 == 0 else ("on", "off"):
                runs[tier].append(_arm(args, target, drafter, tier))
        results[f"{target}/{drafter}"] = runs
    print(
        f"{args.docs} documents of {args.doc_tokens} tokens re-read, "
        f"{args.max_tokens} output tokens each; median (range) of {args.pairs} pairs"
    )
    print(
        f"{'target/drafter':<18} {'off s':>20} {'on s':>20} {'speed-up':>9} "
        f"{'accept off':>10} {'accept on':>10} {'same tokens':>11}"
    )
    summary = {}
    for case, runs in results.items():
        off = [r["seconds"] for r in runs["off"]]
        on = [r["seconds"] for r in runs["on"]]
        speedup = statistics.median(off) / statistics.median(on)
        accept = {
            tier: statistics.median([r["acceptance"] for r in runs[tier]])
            if runs[tier][0]["acceptance"] is not None
            else None
            for tier in ("off", "on")
        }
        same = all(r["tokens"] == runs["off"][0]["tokens"] for r in runs["on"])
        summary[case] = dict(speedup=speedup, acceptance=accept, same_tokens=same)

        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        print(
            f"{case:<18} {_median_range(off):>20} {_median_range(on):>20} "
            f"{speedup:>8.2f}x {fmt(accept['off']):>10} {fmt(accept['on']):>10} "
            f"{str(same):>11}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(summary=summary, runs=results)))


if __name__ == "__main__":
    main()
