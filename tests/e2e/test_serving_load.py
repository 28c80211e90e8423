"""A real server under concurrent load, with and without `--enable-cpu-offload`.

Twelve four-turn conversations over three shared documents run at once through the
`openai` client, with streams that the client closes after two chunks and requests that
the client abandons after a delay mixed in. The device KV cache holds 24 blocks, far
less than the documents and conversations need, so re-reads come back from the host tier
(or are recomputed, without the flag). The same workload runs against a server with the
flag and one without; every answer must be the same text. Both servers use float32: with
bfloat16, concurrent batching alone changes greedy outputs, with or without the plugin.

A third arrangement (tp1-async) sets `async_load_tokens` to one block, so that host hits
load across steps while other requests run, aborted requests among them.

Tensor parallelism 2 runs on the two cores of CI: one OpenMP thread bound to each core
(VLLM_CPU_OMP_THREADS_BIND="0|1"; with an explicit binding vLLM reserves no core, so
VLLM_CPU_NUM_OF_RESERVED_CPU is not needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests

from tests.conftest import BLOCK_SIZE
from tests.e2e.servers import RunningServer, metric_samples, metrics, running_server
from vllm_cpu_offload.testing.openai_clients import client_per_request_connection
from vllm_cpu_offload.testing.tiny_model import random_words

pytestmark = pytest.mark.e2e

DEVICE_BLOCKS = 24  # 768 tokens of device KV: a fraction of what the workload touches
MAX_MODEL_LEN = 640  # vLLM needs max_model_len to fit the device cache, less some slack
MAX_NUM_SEQS = 8

DOCS = 3
DOC_WORDS = 250  # about 8 blocks per document
CONVERSATIONS = 12
TURNS = 4
QUESTION_WORDS = 12
ANSWER_TOKENS = 12
CLOSED_STREAMS = 3  # streams the client closes after two chunks
ABANDONED = 3  # requests the client gives up on ABANDON_AFTER_S after sending them
# The client gives up long before LONG_TOKENS can be generated, on any machine: each
# decode step of a served request takes a millisecond or more, so LONG_TOKENS steps take
# over 0.3 s.
ABANDON_AFTER_S = 0.1
# what closed streams and abandoned requests ask for; fits MAX_MODEL_LEN
LONG_TOKENS = 360
REQUEST_TIMEOUT_S = 300.0

OFFLOAD = "vllm:cpu_offload_"


@dataclass(frozen=True)
class Variant:
    """A server arrangement: its tensor parallel size, and the host tier's
    `async_load_tokens` (None: the default)."""

    tp: int
    async_load_tokens: int | None = None


# tp1-async: every host hit of a block or more, while another request runs, loads
# across steps.
VARIANTS = {
    "tp1": Variant(1),
    "tp2": Variant(2),
    "tp1-async": Variant(1, async_load_tokens=BLOCK_SIZE),
}


def server_flags(
    tp: int, offload: bool, async_load_tokens: int | None = None
) -> list[str]:
    flags = [
        "--dtype", "float32",
        "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(DEVICE_BLOCKS),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--tensor-parallel-size", str(tp),
    ]  # fmt: skip
    if offload:
        flags += ["--enable-cpu-offload", "--swap-space", "1"]
    if offload and async_load_tokens is not None:
        extra = {"async_load_tokens": async_load_tokens}
        flags += [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "CPUOffloadConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": extra,
                }
            ),
        ]
    return flags


def server_env(tp: int) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {}


@dataclass(frozen=True)
class Workload:
    docs: list[str]
    questions: list[list[str]]  # [conversation][turn]
    side_prompts: list[str]  # for the closed streams, then the abandoned requests


def make_workload(seed: int = 0) -> Workload:
    rng = random.Random(seed)
    docs = [random_words(rng, DOC_WORDS) for _ in range(DOCS)]
    questions = [
        [random_words(rng, QUESTION_WORDS) for _ in range(TURNS)]
        for _ in range(CONVERSATIONS)
    ]
    side = [
        f"{docs[k % DOCS]} {random_words(rng, QUESTION_WORDS)}"
        for k in range(CLOSED_STREAMS + ABANDONED)
    ]
    return Workload(docs, questions, side)


@dataclass
class WorkloadResult:
    prompts: dict[tuple[int, int], str] = field(default_factory=dict)
    answers: dict[tuple[int, int], str] = field(default_factory=dict)
    usages: dict[tuple[int, int], Any] = field(default_factory=dict)  # CompletionUsage
    chunks_before_close: list[int] = field(default_factory=list)
    abandoned: list[bool] = field(default_factory=list)  # True: the client gave up
    not_abandoned: list[Any] = field(default_factory=list)  # usage of those that ended
    seconds: float = 0.0


async def _run_workload(url: str, model: str, work: Workload) -> WorkloadResult:
    result = WorkloadResult()
    client = client_per_request_connection(url, REQUEST_TIMEOUT_S)
    greedy: dict[str, Any] = dict(
        model=model, temperature=0.0, extra_body={"ignore_eos": True}
    )

    async def conversation(i: int) -> None:
        prompt = work.docs[i % DOCS]
        for turn in range(TURNS):
            prompt = f"{prompt} {work.questions[i][turn]}"
            reply = await client.completions.create(
                prompt=prompt, max_tokens=ANSWER_TOKENS, **greedy
            )
            result.prompts[(i, turn)] = prompt
            result.answers[(i, turn)] = reply.choices[0].text
            result.usages[(i, turn)] = reply.usage
            prompt += reply.choices[0].text

    async def closed_stream(k: int) -> None:
        await asyncio.sleep(0.2 + 0.6 * k)
        stream = await client.completions.create(
            prompt=work.side_prompts[k], max_tokens=LONG_TOKENS, stream=True, **greedy
        )
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 2:
                break
        await stream.close()
        result.chunks_before_close.append(chunks)

    async def abandoned(k: int) -> None:
        # The client gives up by cancelling the request's task, which closes its
        # connection: an HTTP read timeout would depend on when the client's loop reads.
        await asyncio.sleep(0.5 + 0.6 * k)
        request = asyncio.ensure_future(
            client.completions.create(
                prompt=work.side_prompts[CLOSED_STREAMS + k],
                max_tokens=LONG_TOKENS,
                **greedy,
            )
        )
        done, _ = await asyncio.wait({request}, timeout=ABANDON_AFTER_S)
        if done:
            result.abandoned.append(False)
            result.not_abandoned.append(request.result().usage)
            return
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        result.abandoned.append(True)

    start = time.monotonic()
    try:
        await asyncio.gather(
            *(conversation(i) for i in range(CONVERSATIONS)),
            *(closed_stream(k) for k in range(CLOSED_STREAMS)),
            *(abandoned(k) for k in range(ABANDONED)),
        )
    finally:
        await client.close()
    result.seconds = time.monotonic() - start
    return result


def run_workload(server: RunningServer, work: Workload) -> WorkloadResult:
    return asyncio.run(_run_workload(server.url, server.model, work))


def settled_metrics(
    url: str,
    until: Callable[[dict[str, float]], bool] = lambda m: True,
    prefix: str = "vllm:",
    timeout_s: float = 60.0,
) -> dict[str, float]:
    """/metrics once `until` holds and two reads a second apart agree (metrics lag
    steps)."""
    deadline = time.monotonic() + timeout_s
    previous: dict[str, float] | None = None
    while True:
        now = metrics(url, prefix)
        now = {k: v for k, v in now.items() if not k.endswith("_created")}
        if now == previous and until(now):
            return now
        assert time.monotonic() < deadline, f"/metrics did not settle: {now}"
        previous = now
        time.sleep(1.0)


def idle(m: dict[str, float]) -> bool:
    return (
        m.get("vllm:num_requests_running", -1) == 0
        and m.get("vllm:num_requests_waiting", -1) == 0
        and m.get("vllm:kv_cache_usage_perc", -1) == 0
    )


def finished_by_reason(url: str) -> dict[str, float]:
    """The server's count of finished requests per reason (stop, length, abort, ...)."""
    counts: dict[str, float] = {}
    for sample, value in metric_samples(url, "vllm:request_success_total").items():
        reason = sample.split('finished_reason="', 1)[1].split('"', 1)[0]
        counts[reason] = counts.get(reason, 0.0) + value
    return counts


def finished_with(url: str, reason: str) -> float:
    """The count of requests that finished for `reason` (stop, length, error,
    ...)."""
    return finished_by_reason(url).get(reason, 0.0)


def complete(
    server: RunningServer, prompt: str, max_tokens: int = ANSWER_TOKENS, **extra: Any
) -> dict:
    body: dict[str, Any] = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }
    response = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@dataclass
class BaselineRun:
    result: WorkloadResult
    offload_metrics: dict[str, float]


@pytest.fixture(scope="module")
def variant(request: pytest.FixtureRequest) -> Variant:
    return VARIANTS[request.param]


@pytest.fixture(scope="module")
def tp(variant: Variant) -> int:
    return variant.tp


@pytest.fixture(scope="module")
def workload() -> Workload:
    return make_workload()


@pytest.fixture(scope="module")
def baselines() -> dict[int, BaselineRun]:
    """The baseline runs of this module, by tensor parallel size."""
    return {}


@pytest.fixture(scope="module")
def baseline(
    tp: int, tiny_model: str, workload: Workload, baselines: dict[int, BaselineRun]
) -> BaselineRun:
    """The workload against a server without the flags; the server is gone
    afterwards. Run once per tensor parallel size: without the flag tp1 and tp1-async
    are the same server."""
    if tp not in baselines:
        with running_server(
            tiny_model, server_flags(tp, offload=False), server_env(tp)
        ) as server:
            result = run_workload(server, workload)
            baselines[tp] = BaselineRun(result, metrics(server.url, OFFLOAD))
    return baselines[tp]


@pytest.fixture(scope="module")
def offload_server(variant: Variant, tiny_model: str) -> Iterator[RunningServer]:
    flags = server_flags(variant.tp, True, variant.async_load_tokens)
    with running_server(tiny_model, flags, server_env(variant.tp)) as server:
        yield server


@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
def test_concurrent_conversations_answer_as_without_offload(
    variant: Variant,
    tp: int,
    baseline: BaselineRun,
    offload_server: RunningServer,
    workload: Workload,
) -> None:
    # Scenario: 12 concurrent 4-turn conversations over 3 shared documents, a device
    # cache of 24 blocks, streams closed after two chunks and requests abandoned by the
    # client after a delay. With the host tier every completed answer equals the one
    # without it, the re-reads came from host memory, no transfer failed, and the server
    # is idle and answers afterwards. With tp1-async, host hits load across steps.
    assert baseline.offload_metrics == {}, "the plugin must be inert without the flag"
    expected = baseline.result
    assert len(expected.answers) == CONVERSATIONS * TURNS

    before = settled_metrics(offload_server.url)
    finished_before = finished_by_reason(offload_server.url)
    got = run_workload(offload_server, workload)
    print(
        f"\ntp={tp}: workload {expected.seconds:.1f} s without offload, "
        f"{got.seconds:.1f} s with it"
    )

    assert got.chunks_before_close == [2] * CLOSED_STREAMS
    assert len(got.abandoned) == ABANDONED
    assert any(got.abandoned), (
        f"every request ended before the client gave up: {got.not_abandoned}"
    )
    assert got.prompts.keys() == expected.answers.keys()
    mismatches = [
        f"conversation {i} turn {turn} ({len(got.prompts[(i, turn)].split())} prompt "
        f"tokens, usage {got.usages[(i, turn)]}): {got.answers[(i, turn)]!r} != "
        f"{expected.answers[(i, turn)]!r}"
        for (i, turn) in sorted(expected.answers)
        if got.answers[(i, turn)] != expected.answers[(i, turn)]
    ]
    assert not mismatches, "\n".join(mismatches) + "\n" + offload_server.log_tail(30)

    # Aborted requests are gone from the scheduler and left no device block allocated.
    after = settled_metrics(offload_server.url, until=idle)
    hits = after[OFFLOAD + "hit_tokens_total"]
    assert hits > 0, after
    assert hits <= after[OFFLOAD + "lookup_tokens_total"], after
    assert after[OFFLOAD + "failed_transfers_total"] == 0, after
    assert after[OFFLOAD + "loaded_blocks_total"] > 0, after
    assert after[OFFLOAD + "stored_blocks_total"] > 0, after
    assert 0 < after[OFFLOAD + "host_usage_perc"] <= 1, after
    # The default threshold is above any hit of this workload (a document is 8 blocks).
    across_steps = after[OFFLOAD + "async_hit_tokens_total"]
    assert (across_steps > 0) == (variant.async_load_tokens is not None), after
    assert finished_with(offload_server.url, "error") == 0  # e.g. a KV load that failed
    assert finished_with(offload_server.url, "length") >= CONVERSATIONS * TURNS

    # Every request the client gave up on was either aborted before it reached
    # LONG_TOKENS or never reached the engine, or ran to its end: on two busy cores
    # vLLM's API server can see a closed connection only after the engine core has
    # finished the request, and can read an abandoned request only after the client has
    # gone. Which of these happens is vLLM's own timing, with or without the plugin
    # (tests/e2e/test_offload_lifecycle.py aborts requests in the engine
    # deterministically). vLLM's per-request token histogram counts requests that
    # finished, so what it lacks was generated for aborted ones.
    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    # vLLM's success counter has a finished_reason="abort" series too: count the others.
    finished = {
        reason: count - finished_before.get(reason, 0.0)
        for reason, count in finished_by_reason(offload_server.url).items()
    }
    sent = CONVERSATIONS * TURNS + CLOSED_STREAMS + ABANDONED
    ran_to_end = sum(count for reason, count in finished.items() if reason != "abort")
    aborted = sent - ran_to_end
    aborted_tokens = delta("vllm:generation_tokens_total") - delta(
        "vllm:request_generation_tokens_sum"
    )
    assert 0 <= aborted <= CLOSED_STREAMS + ABANDONED, (finished, after)
    if aborted:
        assert aborted_tokens < aborted * LONG_TOKENS, (finished, after)
    else:
        assert aborted_tokens == 0, (finished, after)
    # vLLM counted the host hits as its own external prefix-cache hits, and reported
    # them in the usage of the requests.
    external = "vllm:external_prefix_cache_hits_total"
    assert after[external] - before.get(external, 0) > 0, after
    reused = sum(
        (usage.prompt_tokens_details.cached_tokens or 0)
        if usage.prompt_tokens_details
        else 0
        for usage in got.usages.values()
    )
    assert reused > 0

    # Still serving: the first turn of a conversation again, answered as before.
    again = complete(offload_server, got.prompts[(0, 0)])
    assert again["choices"][0]["text"] == expected.answers[(0, 0)]
    assert again["usage"]["completion_tokens"] == ANSWER_TOKENS
    assert "Traceback" not in offload_server.log_text()


@pytest.mark.parametrize("variant", ["tp1"], indirect=True)
def test_cache_salt_keeps_tenants_apart_in_host_tier(
    variant: Variant, offload_server: RunningServer
) -> None:
    # Scenario: tenant A sends a prompt of six blocks, other traffic flushes it from the
    # device cache, tenant B sends the same prompt with its own cache_salt: nothing is
    # reused, from the device or from host memory. Tenant A sending it again (after
    # another flush) gets its blocks back from host memory.
    url = offload_server.url
    rng = random.Random(11)
    blocks = 6
    prompt = random_words(rng, blocks * BLOCK_SIZE + 3)

    def flush() -> None:  # 5 x 7 blocks through a device cache of 24
        for _ in range(5):
            complete(offload_server, random_words(rng, blocks * BLOCK_SIZE + 3))

    def cached_tokens(reply: dict) -> int:
        return int(
            (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        )

    first = complete(offload_server, prompt, cache_salt="tenant-a")
    assert cached_tokens(first) == 0
    flush()

    before_b = settled_metrics(url, until=idle)
    as_b = complete(offload_server, prompt, cache_salt="tenant-b")
    assert cached_tokens(as_b) < BLOCK_SIZE, as_b["usage"]
    after_b = settled_metrics(
        url,
        until=lambda m: (
            m[OFFLOAD + "lookup_tokens_total"]
            > before_b[OFFLOAD + "lookup_tokens_total"]
        ),
    )
    assert (
        after_b[OFFLOAD + "hit_tokens_total"] == before_b[OFFLOAD + "hit_tokens_total"]
    )
    assert as_b["choices"][0]["text"] == first["choices"][0]["text"]

    flush()
    before_a = settled_metrics(url, until=idle)
    as_a = complete(offload_server, prompt, cache_salt="tenant-a")
    assert cached_tokens(as_a) >= (blocks - 1) * BLOCK_SIZE, as_a["usage"]
    after_a = settled_metrics(
        url,
        until=lambda m: (
            m[OFFLOAD + "hit_tokens_total"]
            >= before_a[OFFLOAD + "hit_tokens_total"] + (blocks - 1) * BLOCK_SIZE
        ),
    )
    assert after_a[OFFLOAD + "failed_transfers_total"] == 0
    assert as_a["choices"][0]["text"] == first["choices"][0]["text"]
