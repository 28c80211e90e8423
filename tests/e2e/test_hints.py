"""Per-request hints reach the host tier through the OpenAI API (the real `openai`
client's `extra_body`, completions and chat) and through `LLM` (`SamplingParams`'s
`extra_args`).

A real `vllm serve`, fp32, a device cache of 24 blocks and a host tier of 24 blocks (a
block of the tiny model is 128 KiB in fp32): a flood of one-off documents passes through
both. A prefix sent with `retain` is still in host memory after the flood and the next
turn reads it from there; the same sequence without the hint recomputes it. A one-off
sent with `max_offload_tokens: 0` stores nothing, one with 64 stores its first two
blocks; a bad hint is answered, with one warning in the log. LRU eviction.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import script_result
from tests.e2e.servers import RunningServer, running_server
from tests.e2e.test_serving_load import OFFLOAD, idle, settled_metrics
from tests.e2e.test_shared_tier import stepped_until
from vllm_cpu_offload.testing.openai_clients import client_per_request_connection
from vllm_cpu_offload.testing.tiny_model import random_words

pytestmark = pytest.mark.e2e

DOC_BLOCKS = 6
FLOOD = 6  # one-off documents: 42 blocks through 24 device and 24 host blocks

FLAGS = [
    "--dtype", "float32",
    "--block-size", str(BLOCK_SIZE),
    "--num-gpu-blocks-override", "24",
    "--max-model-len", "640",
    "--enforce-eager",
    "--enable-prompt-tokens-details",
    "--enable-cpu-offload",
    "--swap-space", str(24 * (128 << 10) / (1 << 30)),
    # LRU stores every block of a full tier (the default policy's doorkeeper may turn
    # one-offs away): what the hints change is all that changes.
    "--kv-transfer-config", json.dumps({
        "kv_connector": "CPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"eviction_policy": "lru"},
    }),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model: str) -> Iterator[RunningServer]:
    with running_server(tiny_model, FLAGS) as running:
        yield running


def _doc(rng: random.Random) -> str:
    return random_words(rng, DOC_BLOCKS * BLOCK_SIZE + 3)


def _complete(server: RunningServer, prompt: str, **hints: Any) -> Any:
    """The `openai` client's completion, the hints in `extra_body`."""

    async def call() -> Any:
        client = client_per_request_connection(server.url, timeout_s=120)
        extra = {"kv_transfer_params": hints} if hints else None
        return await client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=2,
            temperature=0.0,
            extra_body=extra,
        )

    return asyncio.run(call())


def _cached(reply: Any) -> int:
    details = reply.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def _metric(server: RunningServer, name: str) -> float:
    return settled_metrics(server.url, until=idle)[OFFLOAD + name]


def _next_turn_after_a_flood(server: RunningServer, seed: int, **hints: Any) -> int:
    """Turn one (with `hints`), a flood of one-offs, turn two: the tokens turn two
    read from a cache."""
    rng = random.Random(seed)
    turn = _doc(rng)
    _complete(server, turn, **hints)
    for _ in range(FLOOD):
        _complete(server, _doc(rng))
    return _cached(_complete(server, turn + " and then some more"))


def test_a_retained_prefix_outlives_a_flood_and_the_next_turn_reads_it(
    server: RunningServer,
) -> None:
    hits_before = _metric(server, "retained_hit_blocks_total")
    assert _next_turn_after_a_flood(server, 1, retain=300) >= DOC_BLOCKS * BLOCK_SIZE
    assert _metric(server, "retained_hit_blocks_total") - hits_before >= DOC_BLOCKS
    assert _metric(server, "retained_blocks") == 0  # read: the retain ended
    # The same sequence without the hint: the flood took the prefix.
    assert _next_turn_after_a_flood(server, 2) < BLOCK_SIZE


def test_max_offload_tokens_caps_the_stores(server: RunningServer) -> None:
    rng = random.Random(3)
    name = OFFLOAD + "stored_blocks_total"
    stored = _metric(server, "stored_blocks_total")
    _complete(server, _doc(rng), max_offload_tokens=0)
    _complete(server, _doc(rng), max_offload_tokens=2 * BLOCK_SIZE)
    # Metrics trail the steps: one-token requests step the engine until the second
    # document's stores are counted; the first one's would be counted by then too.
    after = stepped_until(server, lambda m: m.get(name, 0) >= stored + 2)
    assert after[name] == stored + 2


def test_chat_requests_carry_hints_too(server: RunningServer) -> None:
    async def call() -> Any:
        client = client_per_request_connection(server.url, timeout_s=120)
        return await client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": _doc(random.Random(4))}],
            max_tokens=2,
            temperature=0.0,
            extra_body={"kv_transfer_params": {"retain": 300}},
        )

    asyncio.run(call())
    name = OFFLOAD + "retained_blocks"
    assert stepped_until(server, lambda m: m.get(name, 0) >= DOC_BLOCKS - 1)


def test_a_bad_hint_is_answered_with_one_warning(server: RunningServer) -> None:
    reply = _complete(server, _doc(random.Random(5)), retain="later")
    assert reply.choices[0].text
    warnings = [
        line
        for line in server.log_text().splitlines()
        if "ignoring CPU offload hint retain='later'" in line
    ]
    assert len(warnings) == 1, server.log_tail()


def test_llm_requests_carry_hints(tiny_model: str) -> None:
    # Documents read twice through `LLM`, every request with the hint.
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    base = ("--offload", "--docs", "4", "--metrics", "--dtype", "float32")

    def run(hints: dict[str, Any]) -> dict[str, Any]:
        args = (*base, "--kv-transfer-params", json.dumps(hints))
        return dict(
            script_result(
                "tests.e2e.long_document_run", tiny_model, *args, env=env, timeout=500
            )
        )

    none = run({"max_offload_tokens": 0})
    assert none["metrics"]["vllm:cpu_offload_stored_blocks"] == 0
    assert all(r["cached"] == 0 for r in none["requests"])
    kept = run({"retain": 300})
    assert kept["metrics"]["vllm:cpu_offload_retained_hit_blocks"] > 0
    assert all(r["cached"] > 0 for r in kept["requests"][4:])
