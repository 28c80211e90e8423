"""Soak: thousands of requests against a real `--enable-cpu-offload` server; does memory
stay put?

Starts `python -m vllm.entrypoints.openai.api_server` with the locally generated model,
a small device cache and a small host tier (so that both evict all the time), then sends
`--requests` completions from `--concurrency` simulated users through the `openai`
client. Each user holds multi-turn conversations over a set of shared documents (popular
documents come back more often), and now and then sends a prompt nobody shares, a stream
it closes after two chunks, or a request it abandons on a timeout. Every
`--report-every` seconds it prints a row: elapsed seconds, requests done, the resident
memory (RSS, MiB) of the API server, the engine core (scheduler half of the host tier)
and each worker (host buffer and copies), the host tier's usage and its hit, stored and
evicted counters from /metrics.

At the end it says whether RSS stayed bounded, per process, from "warm" (the first
quarter of requests done and the host tier full, so its pages are all touched) to the
end. vLLM's CPU worker grows by itself, without the plugin too (allocator and per-shape
caches; the growth slows over thousands of requests), so by default the same workload
then runs on vLLM alone, and the verdict is that no process grew over the last quarter
of the requests more than `--margin-mib` beyond vLLM's own growth over the same
requests, nor ended more than `--margin-mib` above vLLM alone (a leak grows with the
requests served; a cache that fills later, at a lower level, does not). `--no-reference`
skips that run and judges the growth against `--max-growth-pct` instead. Exit status 1
when RSS was not bounded, a request failed, a transfer failed or requests were left
running.

    .venv/bin/python benchmarks/soak.py # 3000 requests + reference, ~6 min
    .venv/bin/python benchmarks/soak.py --requests 1500 # ~3 min on 2 cores
    .venv/bin/python benchmarks/soak.py --no-reference # the offload server only

Writes benchmarks/results/soak.json (rows and summaries of both runs) and the server
logs beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil

from vllm_cpu_offload.testing.openai_clients import client_per_request_connection
from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama, random_words

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 32
OFFLOAD = "vllm:cpu_offload_"


# --- a minimal server launcher (the tests have their own; benchmarks import
# nothing from them)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m vllm.entrypoints.openai.api_server` on a free loopback port."""

    def __init__(
        self, model: str, flags: list[str], log_path: Path, env: dict[str, str]
    ):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
        ]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *flags]
        full_env = dict(os.environ)
        full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # run as users run it
        full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        full_env.setdefault("TOKENIZERS_PARALLELISM", "false")
        full_env |= env
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )

    def wait_healthy(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.tail()}"
                )
            with suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        raise RuntimeError(
            f"server not healthy after {timeout_s:.0f} s:\n{self.tail()}"
        )

    def tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(
            self.log_path.read_text(errors="replace").splitlines()[-lines:]
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        with suppress(ProcessLookupError):  # engine core and workers go with it
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


# --- what runs inside the server, by process


def process_rss_mib(pid: int) -> dict[str, float]:
    """RSS of the server and its descendants, keyed by role.

    vLLM titles its processes `VLLM::EngineCore`, `VLLM::Worker` (`VLLM::Worker_TP0`,
    ...); the API server is the process we started. Helpers (resource tracker) are left
    out.
    """
    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        out["api_server"] = root.memory_info().rss / 2**20
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for child in children:
        try:
            title = " ".join(child.cmdline())
            rss = child.memory_info().rss / 2**20
        except psutil.Error:
            continue
        if title.startswith("VLLM::"):
            role = title.split("::", 1)[1].split()[0]
            out["engine_core" if role == "EngineCore" else role.lower()] = rss
    return out


async def read_metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await http.get(f"{url}/metrics", timeout=10)).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            name = sample.split("{")[0]
            if not name.endswith("_created"):
                values[name] = values.get(name, 0.0) + float(value)
    return values


# --- the workload


@dataclass
class Mix:
    documents: int = 24
    doc_words: tuple[int, int] = (200, 300)
    question_words: tuple[int, int] = (8, 24)
    answer_tokens: tuple[int, int] = (4, 16)
    max_turns: int = 5
    unique_share: float = 0.08  # prompts nobody shares
    closed_stream_share: float = 0.02  # streams closed after two chunks
    abandoned_share: float = 0.02  # requests abandoned on a client timeout
    abandon_after_s: float = 0.5
    long_tokens: int = 200  # what closed streams and abandoned requests ask for


@dataclass
class Counts:
    done: int = 0
    completed: int = 0
    closed_streams: int = 0
    abandoned: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0


class User:
    """One simulated user: multi-turn conversations over popular documents."""

    def __init__(self, seed: int, docs: list[str], mix: Mix, max_model_len: int):
        self.rng = random.Random(seed)
        self.docs = docs
        self.mix = mix
        self.max_model_len = max_model_len
        self.prompt = ""
        self.turns_left = 0

    def _new_conversation(self) -> None:
        # Popular documents come back more often (about Zipf's law).
        weights = [1.0 / (rank + 1) for rank in range(len(self.docs))]
        self.prompt = self.rng.choices(self.docs, weights)[0]
        self.turns_left = self.rng.randint(1, self.mix.max_turns)

    def next_kind(self) -> str:
        r = self.rng.random()
        m = self.mix
        if r < m.closed_stream_share:
            return "closed_stream"
        if r < m.closed_stream_share + m.abandoned_share:
            return "abandoned"
        if r < m.closed_stream_share + m.abandoned_share + m.unique_share:
            return "unique"
        return "turn"

    def next_turn(self, answer_tokens: int) -> str:
        question = random_words(self.rng, self.rng.randint(*self.mix.question_words))
        if self.turns_left <= 0 or (
            len(self.prompt.split()) + len(question.split()) + answer_tokens + 8
            > self.max_model_len
        ):
            self._new_conversation()
        self.turns_left -= 1
        self.prompt = f"{self.prompt} {question}"
        return self.prompt

    def side_prompt(self) -> str:
        doc = self.rng.choice(self.docs)
        words = self.rng.randint(*self.mix.question_words)
        return f"{doc} {random_words(self.rng, words)}"


async def run_user(
    index: int,
    user: User,
    client: openai.AsyncOpenAI,
    impatient: openai.AsyncOpenAI,
    model: str,
    total: int,
    counts: Counts,
    ticket: list[int],
) -> None:
    mix = user.mix
    greedy: dict[str, Any] = dict(
        model=model, temperature=0.0, extra_body={"ignore_eos": True}
    )
    while ticket[0] < total:
        ticket[0] += 1
        kind = user.next_kind()
        answer_tokens = user.rng.randint(*mix.answer_tokens)
        try:
            if kind == "closed_stream":
                stream = await client.completions.create(
                    prompt=user.side_prompt(),
                    max_tokens=mix.long_tokens,
                    stream=True,
                    **greedy,
                )
                chunks = 0
                async for _ in stream:
                    chunks += 1
                    if chunks == 2:
                        break
                await stream.close()
                counts.closed_streams += 1
            elif kind == "abandoned":
                try:
                    await impatient.completions.create(
                        prompt=user.side_prompt(), max_tokens=mix.long_tokens, **greedy
                    )
                    counts.completed += 1
                except openai.APITimeoutError:
                    counts.abandoned += 1
            else:
                if kind == "unique":
                    words = user.rng.randint(*mix.doc_words)
                    prompt = random_words(user.rng, words)
                else:
                    prompt = user.next_turn(answer_tokens)
                reply = await client.completions.create(
                    prompt=prompt, max_tokens=answer_tokens, **greedy
                )
                if kind == "turn":
                    user.prompt += reply.choices[0].text
                counts.completed += 1
                if reply.usage is not None:
                    counts.prompt_tokens += reply.usage.prompt_tokens
                    details = reply.usage.prompt_tokens_details
                    counts.cached_tokens += (
                        (details.cached_tokens or 0) if details else 0
                    )
        except openai.OpenAIError as e:
            counts.errors += 1
            if len(counts.error_samples) < 5:
                counts.error_samples.append(
                    f"user {index} {kind}: {type(e).__name__}: {e}"
                )
        counts.done += 1


# --- reporting

COLUMNS = (
    "elapsed_s", "done", "api_server_mib", "engine_core_mib", "workers_mib",
    "host_usage_pct", "hit_tokens", "stored_blocks", "evicted_blocks",
    "failed_transfers",
)  # fmt: skip


def make_row(
    start: float, counts: Counts, rss: dict[str, float], m: dict[str, float]
) -> dict:
    workers = {k: round(v, 1) for k, v in rss.items() if k.startswith("worker")}
    return {
        "elapsed_s": round(time.monotonic() - start, 1),
        "done": counts.done,
        "api_server_mib": round(rss.get("api_server", 0.0), 1),
        "engine_core_mib": round(rss.get("engine_core", 0.0), 1),
        "workers_mib": workers,
        "host_usage_pct": round(100 * m.get(OFFLOAD + "host_usage_perc", 0.0), 1),
        "hit_tokens": int(m.get(OFFLOAD + "hit_tokens_total", 0)),
        "stored_blocks": int(m.get(OFFLOAD + "stored_blocks_total", 0)),
        "evicted_blocks": int(m.get(OFFLOAD + "evicted_blocks_total", 0)),
        "failed_transfers": int(m.get(OFFLOAD + "failed_transfers_total", 0)),
        "running": int(m.get("vllm:num_requests_running", 0)),
    }


def print_row(row: dict) -> None:
    workers = " ".join(f"{k}={v:.0f}" for k, v in row["workers_mib"].items())
    print(
        f"{row['elapsed_s']:>8.1f} {row['done']:>6d} {row['api_server_mib']:>8.0f} "
        f"{row['engine_core_mib']:>8.0f}  {workers:<20s} {row['host_usage_pct']:>6.1f} "
        f"{row['hit_tokens']:>10d} {row['stored_blocks']:>8d} "
        f"{row['evicted_blocks']:>8d} {row['failed_transfers']:>6d}",
        flush=True,
    )


def print_header() -> None:
    print(
        f"{'elapsed':>8s} {'done':>6s} {'api MiB':>8s} {'core MiB':>8s}  "
        f"{'worker MiB':<20s} {'host%':>6s} {'hit tok':>10s} {'stored':>8s} "
        f"{'evicted':>8s} {'failed':>6s}",
        flush=True,
    )


def rss_series(rows: list[dict]) -> dict[str, list[float]]:
    series: dict[str, list[float]] = {"api_server": [], "engine_core": []}
    for row in rows:
        series["api_server"].append(row["api_server_mib"])
        series["engine_core"].append(row["engine_core_mib"])
        for name, value in row["workers_mib"].items():
            series.setdefault(name, []).append(value)
    return series


def _at(done: list[int], values: list[float], when: float) -> float:
    """`values` linearly interpolated at `when` requests done."""
    for i in range(1, len(done)):
        if done[i] >= when:
            span = done[i] - done[i - 1]
            frac = (when - done[i - 1]) / span if span else 1.0
            return values[i - 1] + frac * (values[i] - values[i - 1])
    return values[-1]


def summarize(
    rows: list[dict], total: int, max_growth_pct: float, warm_done: int | None = None
) -> dict[str, Any]:
    """RSS once warm vs at the end, per process.

    Warm: the first quarter of requests is done and the host tier has filled up (its
    pages are touched as blocks arrive, so a filling tier grows the workers' RSS by
    design). `warm_done` instead sets warm at that many requests done, RSS interpolated
    between rows (to line a reference run up with the offload run).
    """
    if warm_done is None:
        quarter = next((i for i, r in enumerate(rows) if r["done"] >= total / 4), 0)
        full = next(
            (i for i, r in enumerate(rows) if r["host_usage_pct"] >= 95.0), quarter
        )
        warm_done = rows[max(quarter, full)]["done"]
    done = [r["done"] for r in rows]
    out: dict[str, Any] = {"warm_done": warm_done, "processes": {}}
    bounded = True
    for name, values in rss_series(rows).items():
        if len(values) != len(rows) or not values:
            continue
        base, end = _at(done, values, warm_done), values[-1]
        growth = 100.0 * (end - base) / base if base else 0.0
        out["processes"][name] = {
            "start_mib": values[0],
            "warm_mib": round(base, 1),
            "end_mib": end,
            "max_mib": max(values),
            "growth_mib": round(end - base, 1),
            "growth_pct": round(growth, 2),
            # A leak grows with the requests served: it shows in the last quarter too.
            "last_quarter_growth_mib": round(end - _at(done, values, 0.75 * total), 1),
        }
        bounded &= growth < max_growth_pct
    out["bounded"] = bounded
    return out


async def soak(
    args: argparse.Namespace, server: Server, model: str, warm_done: int | None
) -> dict[str, Any]:
    mix = Mix(documents=args.documents)
    rng = random.Random(args.seed)
    docs = [
        random_words(rng, rng.randint(*mix.doc_words)) for _ in range(mix.documents)
    ]
    counts = Counts()
    ticket = [0]
    client = client_per_request_connection(server.url, 300.0)
    impatient = client_per_request_connection(server.url, mix.abandon_after_s)
    rows: list[dict] = []
    start = time.monotonic()
    async with httpx.AsyncClient() as http:

        async def sample() -> None:
            rss = process_rss_mib(server.proc.pid)
            row = make_row(start, counts, rss, await read_metrics(http, server.url))
            rows.append(row)
            print_row(row)

        users = [
            asyncio.create_task(
                run_user(
                    i,
                    User(args.seed * 1000 + i, docs, mix, args.max_model_len),
                    client,
                    impatient,
                    model,
                    args.requests,
                    counts,
                    ticket,
                )
            )
            for i in range(args.concurrency)
        ]
        print_header()
        await sample()
        while not all(u.done() for u in users):
            await asyncio.wait(users, timeout=args.report_every)
            if server.proc.poll() is not None:
                raise RuntimeError(f"server died:\n{server.tail()}")
            await sample()
        for u in users:
            u.result()
        # Idle: aborted requests must be gone and the device cache free.
        await asyncio.sleep(3)
        await sample()
        final = await read_metrics(http, server.url)
    await client.close()
    await impatient.close()
    elapsed = time.monotonic() - start
    summary = summarize(rows, args.requests, args.max_growth_pct, warm_done)
    summary |= {
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(counts.done / elapsed, 1),
        "counts": asdict(counts),
        "idle_after": {
            "running": final.get("vllm:num_requests_running"),
            "waiting": final.get("vllm:num_requests_waiting"),
            "kv_cache_usage_perc": final.get("vllm:kv_cache_usage_perc"),
        },
        "final_offload_metrics": {
            k: v for k, v in final.items() if k.startswith(OFFLOAD)
        },
    }
    return {"rows": rows, "summary": summary}


def server_flags(args: argparse.Namespace, offload: bool) -> list[str]:
    flags = [
        "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(args.device_blocks),
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.concurrency),
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--enforce-eager",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if offload:
        flags += ["--enable-cpu-offload", "--swap-space", str(args.swap_space)]
    return flags


def run_once(
    args: argparse.Namespace, model: str, offload: bool, warm_done: int | None = None
) -> dict[str, Any]:
    """Starts a server, soaks it, stops it; prints the rows and a summary."""
    flags = server_flags(args, offload)
    name = args.out.stem + ("" if offload else "_reference")
    log_path = args.out.with_name(name + "_server.log")
    print(
        f"\n{'with' if offload else 'WITHOUT'} --enable-cpu-offload; server log: "
        f"{log_path}"
    )
    server = Server(model, flags, log_path, env={})
    try:
        server.wait_healthy()
        result = asyncio.run(soak(args, server, model, warm_done))
    finally:
        server.stop()
    result["server_flags"] = flags
    s = result["summary"]
    print(
        f"{s['counts']['done']} requests in {s['elapsed_s']} s ({s['requests_per_s']} "
        f"/s): {s['counts']['completed']} completed, {s['counts']['closed_streams']} "
        f"streams closed, {s['counts']['abandoned']} abandoned, "
        f"{s['counts']['errors']} errors"
    )
    for sample in s["counts"]["error_samples"]:
        print(f"  error: {sample}")
    print(
        f"RSS (MiB) at start / warm (after {s['warm_done']} requests) / at the end / "
        "max, growth:"
    )
    for proc, p in s["processes"].items():
        print(
            f"  {proc:<12s} {p['start_mib']:8.0f} {p['warm_mib']:8.0f} "
            f"{p['end_mib']:8.0f} {p['max_mib']:8.0f}  {p['growth_mib']:+7.1f} MiB "
            f"{p['growth_pct']:+6.1f}%"
        )
    print(f"idle after: {s['idle_after']}", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--report-every", type=float, default=5.0, help="seconds between rows"
    )
    p.add_argument(
        "--swap-space", type=float, default=0.02, help="host tier GiB (small: evicts)"
    )
    p.add_argument("--device-blocks", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--documents", type=int, default=24)
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    p.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip the second run on vLLM alone; judge RSS by --max-growth-pct instead",
    )
    p.add_argument(
        "--margin-mib",
        type=float,
        default=32.0,
        help="with --reference: growth allowed beyond vLLM's own, per process",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    model = str(ensure_tiny_llama())
    result: dict[str, Any] = {
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
        }
    }
    offload = run_once(args, model, offload=True)
    result["offload"] = offload
    s = offload["summary"]
    failed = s["final_offload_metrics"].get(OFFLOAD + "failed_transfers_total", 0)
    idle = (
        s["idle_after"]["running"] == 0 and s["idle_after"]["kv_cache_usage_perc"] == 0
    )
    ok = s["counts"]["errors"] == 0 and failed == 0 and idle
    print(
        f"\nRSS bounded (growth < {args.max_growth_pct}% once warm, every process): "
        f"{'yes' if s['bounded'] else 'NO'}; failed transfers: {failed:.0f}; "
        f"idle afterwards: {'yes' if idle else 'NO'}"
    )
    if args.reference:
        reference = run_once(args, model, offload=False, warm_done=s["warm_done"])
        result["reference"] = reference
        ref = reference["summary"]["processes"]
        procs = [proc for proc in s["processes"] if proc in ref]

        def beyond(field: str) -> dict[str, float]:
            return {
                p: round(s["processes"][p][field] - ref[p][field], 1) for p in procs
            }

        extra, above = beyond("growth_mib"), beyond("end_mib")
        tail = beyond("last_quarter_growth_mib")
        result["growth_beyond_vllm_mib"] = extra
        result["last_quarter_growth_beyond_vllm_mib"] = tail
        result["end_rss_above_vllm_mib"] = above
        # Bounded: no growth with the requests served beyond vLLM's own (the last
        # quarter), and no more resident memory than vLLM alone at the end. Growth since
        # "warm" is shown too; it also counts how late each run reaches its plateau.
        within = all(
            tail[p] < args.margin_mib and above[p] < args.margin_mib for p in procs
        )
        print(
            f"\nRSS growth since warm beyond vLLM's own (MiB): {extra}"
            f"\nRSS growth over the last quarter beyond vLLM's own (MiB): {tail}"
            f"\nRSS at the end above vLLM alone (MiB): {above}"
            f"\nbounded (last-quarter growth and end RSS within {args.margin_mib:g} "
            "MiB of "
            f"vLLM alone, every process): {'yes' if within else 'NO'}"
        )
        ok &= within and reference["summary"]["counts"]["errors"] == 0
    else:
        ok &= s["bounded"]
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
