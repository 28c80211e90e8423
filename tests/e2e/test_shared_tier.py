"""`--swap-space-remote`: engines share their KV through a real store on loopback.

Real `vllm serve` processes (the API server module), fp32, one request at a time. Server
A reads documents and writes every block it stores through to the store. Server B, a
fresh engine with an empty host tier, then reads the same documents: their blocks come
from the store (loads that span steps), with the answers server A gives from its own
cache, and a tenant's `cache_salt` reaches nothing of another's. An engine whose store
is down answers the same documents exactly, recomputing them.

One server A per store reads the documents of every test that needs them written (its
answers are kept, it is gone before any B starts): a server start is most of what a
test here costs. fp32: the store moves bytes and nothing of the shared tier depends on
the dtype; bf16 runs in test_bf16_exact, and is two orders of magnitude slower on CPUs
without AMX or AVX512-BF16.

What a test expects to hit must be in the store whatever the machine's load: a store
call past its bound is given up, a write given up is a miss (correct, and not what
these tests are about), so the servers whose hits a test counts bound their calls
far beyond the test (`UNBOUNDED_CALL_S`), A waits until every block it stored is
written (not until some count of writes, nor for some time), and a write lost anyway
fails the test where it was lost. The tests of faults keep the default bound: it is
what they test.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.servers import HANG_S, RunningServer, metrics, running_server
from tests.e2e.test_serving_load import OFFLOAD, complete, idle, settled_metrics
from vllm_cpu_offload.testing.store_servers import (
    UNBOUNDED_CALL_S,
    MooncakeServers,
    free_port,
)
from vllm_cpu_offload.testing.tiny_model import random_words

pytestmark = pytest.mark.e2e

DOCS, BLOCKS = 4, 6
# At least this much of each of B's first reads comes from the store.
HITS = (BLOCKS - 1) * BLOCK_SIZE


# Mooncake's client advertises this address, not the machine's first one.
MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
# Counters of writes that never reached the store (dropped, refused, failed).
LOST_WRITES = (
    OFFLOAD + "remote_write_dropped_blocks_total",
    OFFLOAD + "remote_write_refused_blocks_total",
    OFFLOAD + "remote_write_failures_total",
)

# A prompt and its cache salt (None: no salt).
Doc = tuple[str, str | None]


def documents(seed: int, count: int) -> tuple[list[str], random.Random]:
    """`count` prompts of BLOCKS blocks and three tokens, and the generator they came
    from, to draw more from."""
    rng = random.Random(seed)
    return [random_words(rng, BLOCKS * BLOCK_SIZE + 3) for _ in range(count)], rng


def second_engine_documents() -> tuple[list[str], str]:
    """The documents of test_a_second_engine_reads_what_the_first_computed, and the
    prompt that tenant A sends with its salt."""
    docs, rng = documents(31, DOCS)
    return docs, random_words(rng, BLOCKS * BLOCK_SIZE + 3)


def second_engine_reads() -> list[Doc]:
    docs, salted = second_engine_documents()
    return [*((d, None) for d in docs), (salted, "tenant-a")]


def store_calls_bounded_by(seconds: float) -> list[str]:
    """The flag that bounds each call to the shared store by `seconds`."""
    config = {
        "kv_connector": "CPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"remote_timeout_s": seconds},
    }
    return ["--kv-transfer-config", json.dumps(config)]


def server_flags(
    url: str, store_timeout_s: float | None = UNBOUNDED_CALL_S
) -> list[str]:
    """A server's flags with the store at `url`, its calls bounded by
    `store_timeout_s` (None: the default bound)."""
    bound = [] if store_timeout_s is None else store_calls_bounded_by(store_timeout_s)
    return [
        "--dtype", "float32",
        "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", "24",
        "--max-model-len", "640",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--enable-cpu-offload", "--swap-space", "0.05",
        "--swap-space-remote", url,
        *bound,
    ]  # fmt: skip


def cached_tokens(reply: dict) -> int:
    return int(
        (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    )


def text(reply: dict) -> str:
    return str(reply["choices"][0]["text"])


def read(server: RunningServer, doc: Doc) -> dict:
    prompt, salt = doc
    return (
        complete(server, prompt)
        if salt is None
        else complete(server, prompt, cache_salt=salt)
    )


def stepped_until(
    server: RunningServer, until: Callable[[dict[str, float]], bool]
) -> dict[str, float]:
    """/metrics once `until` holds. Writes go on after the request that stored them
    finished, and an idle engine runs no step to report them: one-token requests make
    it step until they are reported. `until` names what must come, not when: the
    deadline is a hang's (HANG_S)."""
    deadline = time.monotonic() + HANG_S
    while True:
        complete(server, "ping", max_tokens=1)
        m = metrics(server.url)
        if until(m):
            return m
        assert time.monotonic() < deadline, f"metrics never got there: {m}"
        time.sleep(0.2)


def all_written(ranks: int, at_least: int) -> Callable[[dict[str, float]], bool]:
    """Each of the engine's `ranks` wrote its shard of every block stored in host
    memory, `at_least` shards in all, and neither count moved over the last step
    (`all_accounted`, with no shard lost). The engine's calls must be unbounded
    (`server_flags`): a write lost anyway fails here, naming its counter."""
    accounted = all_accounted(ranks, at_least)

    def holds(m: dict[str, float]) -> bool:
        lost = {name: m.get(name, 0) for name in LOST_WRITES}
        assert not any(lost.values()), f"writes that never reached the store: {lost}"
        return accounted(m)

    return holds


def all_accounted(ranks: int, at_least: int) -> Callable[[dict[str, float]], bool]:
    """Each of the engine's `ranks` wrote, or counted lost, its shard of every block
    stored in host memory, `at_least` shards in all, and neither count moved over the
    last step. For tests whose point is what is read back, where a write lost costs a
    miss (a Mooncake segment near full refuses puts until its eviction, which a loaded
    machine runs late, has made room).

    The stored and written counters move a step apart (a store is counted by the
    scheduler, its write by the worker once the write's call returned), so equal
    counts alone can hold before the last document's stores are counted: the lower
    bound and the step without change rule that out.
    """
    previous: list[tuple[float, float]] = []

    def holds(m: dict[str, float]) -> bool:
        stored = m.get(OFFLOAD + "stored_blocks_total", 0)
        done = m.get(OFFLOAD + "remote_written_blocks_total", 0) + lost_writes(m)
        steady = previous == [(stored, done)]
        previous[:] = [(stored, done)]
        return steady and done == ranks * stored and done >= at_least

    return holds


def lost_writes(m: dict[str, float]) -> float:
    """Shards the store never took: dropped, refused or failed."""
    return sum(m.get(name, 0) for name in LOST_WRITES)


@dataclass(frozen=True)
class Written:
    """Server A's answers to documents it read twice, cold and then from its own
    cache, once their blocks were all in the store; A is gone."""

    cold: dict[Doc, dict]
    cached: dict[Doc, dict]


def read_twice_and_write_through(model: str, url: str, docs: list[Doc]) -> Written:
    """Server A: every document read cold, then again from its own cache (the
    reference for B's reads from the store: the same prefix comes from a cache and the
    same suffix is computed; a cold answer is not one, since on some CPUs (AMX) vLLM's
    prefill of a prompt whose prefix is cached differs in the last bits from a whole
    prefill); returns once every block is written through."""
    with running_server(model, server_flags(url), env=MOONCAKE_ENV) as first_server:
        cold = {d: read(first_server, d) for d in docs}
        cached = {d: read(first_server, d) for d in docs}
        assert all(cached_tokens(r) >= HITS for r in cached.values())
        stepped_until(first_server, all_written(1, len(docs) * (BLOCKS - 1)))
    return Written(cold, cached)


@pytest.fixture(scope="module")
def redis_written(tiny_model: str, redis_url: str) -> Written:
    """What A wrote to Redis: the documents of the second-engine test and the
    document of the held-fetch test."""
    doc = (fetch_documents()[0], None)
    return read_twice_and_write_through(
        tiny_model, redis_url, [*second_engine_reads(), doc]
    )


@pytest.fixture(scope="module")
def mooncake_written(tiny_model: str, mooncake: MooncakeServers) -> Written:
    """What A wrote to Mooncake: the documents of the second-engine test and those of
    the storage-node test."""
    node_docs = [(d, None) for d in documents(41, 2)[0]]
    return read_twice_and_write_through(
        tiny_model, mooncake.url, [*second_engine_reads(), *node_docs]
    )


@pytest.mark.parametrize("store", ["redis", "mooncake"])
def test_a_second_engine_reads_what_the_first_computed(
    tiny_model: str, store: str, request: pytest.FixtureRequest
) -> None:
    written: Written = request.getfixturevalue(f"{store}_written")
    if store == "redis":
        url = request.getfixturevalue("redis_url")
    else:
        url = request.getfixturevalue("mooncake").url
    server = running_server(tiny_model, server_flags(url), env=MOONCAKE_ENV)
    docs, salted = second_engine_documents()
    first = [written.cached[(d, None)] for d in docs]
    cold_salted = written.cold[(salted, "tenant-a")]
    first_salted = written.cached[(salted, "tenant-a")]

    with server as second:
        before = settled_metrics(second.url, until=idle)
        again = [complete(second, d) for d in docs]
        usages = [(r["usage"], f["usage"]) for r, f in zip(again, first, strict=True)]
        assert [cached_tokens(r) for r in again] == [cached_tokens(r) for r in first], (
            usages
        )
        assert [text(r) for r in again] == [text(r) for r in first]
        # Another tenant's salt reaches none of tenant A's blocks in the store.
        as_b = complete(second, salted, cache_salt="tenant-b")
        assert cached_tokens(as_b) < BLOCK_SIZE and text(as_b) == text(cold_salted)
        as_a = complete(second, salted, cache_salt="tenant-a")
        assert cached_tokens(as_a) == cached_tokens(first_salted)
        assert text(as_a) == text(first_salted)
        after = settled_metrics(second.url, until=idle)

        def grew(name: str) -> float:
            return after[OFFLOAD + name] - before[OFFLOAD + name]

        assert grew("remote_hit_tokens_total") >= (DOCS + 1) * HITS
        assert grew("remote_rejected_blocks_total") == 0
        assert grew("failed_transfers_total") == 0


def test_a_storage_node_that_dies_costs_no_wrong_token_and_no_hang(
    tiny_model: str, mooncake: MooncakeServers, mooncake_written: Written
) -> None:
    # B has never read these documents; A wrote them to the store. B's calls keep
    # the default bound: that they end, the node gone, is what this test is about.
    docs, rng = documents(41, 2)
    first = [mooncake_written.cold[(d, None)] for d in docs]
    flags = server_flags(mooncake.url, store_timeout_s=None)
    with running_server(tiny_model, flags, env=MOONCAKE_ENV) as second:
        _recomputes_then_writes_again(mooncake, second, docs, first, rng)


def _recomputes_then_writes_again(
    mooncake: MooncakeServers,
    second: RunningServer,
    docs: list[str],
    first: list[dict],
    rng: random.Random,
) -> None:
    before = settled_metrics(second.url, until=idle)
    # The node that holds every value dies: B's reads recompute, exactly, each
    # within the store's timeouts (complete() bounds a request's time).
    mooncake.kill_storage_node()
    again = [complete(second, d) for d in docs]
    assert [text(r) for r in again] == [text(r) for r in first]
    # A new node comes up: the tier writes through again. The store client may
    # still be in its back-off when the first new documents are stored, so new
    # ones come until a write lands (bounded by count, not by time).
    mooncake.restart_storage_node()
    written = before[OFFLOAD + "remote_written_blocks_total"]
    for _ in range(60):
        complete(second, random_words(rng, BLOCKS * BLOCK_SIZE + 3))
        # One more step reports what the last document's writes did.
        after = stepped_until(second, lambda m: True)
        if after[OFFLOAD + "remote_written_blocks_total"] > written:
            break
    assert after[OFFLOAD + "remote_written_blocks_total"] > written
    assert after[OFFLOAD + "failed_transfers_total"] == before.get(
        OFFLOAD + "failed_transfers_total", 0
    )


def test_a_store_that_is_down_costs_recomputes_not_answers(tiny_model: str) -> None:
    """Each read, cold and then from the engine's cache, answers as an engine with no
    store does: a cold answer is compared with a cold one and a cached one with one
    of the same hit length (on some CPUs the two kinds differ in the last bits)."""
    # Nothing listens on this port: every store call fails at once.
    dead = f"redis://127.0.0.1:{free_port()}"
    docs, _ = documents(37, 2)
    remote = ("--swap-space-remote", dead)
    # The default bound: a store that is down must cost no more than it.
    flags = server_flags(dead, store_timeout_s=None)
    host_only = [f for f in flags if f not in remote]

    def reads(server: RunningServer) -> list[dict]:
        return [complete(server, d) for d in docs] + [complete(server, d) for d in docs]

    with running_server(tiny_model, host_only) as reference:
        expected = reads(reference)
    with running_server(tiny_model, flags) as server:
        got = reads(server)
        m = settled_metrics(server.url, until=idle)
    assert [cached_tokens(r) for r in got] == [cached_tokens(r) for r in expected]
    assert [text(r) for r in got] == [text(r) for r in expected]
    assert m.get(OFFLOAD + "remote_hit_tokens_total", 0) == 0


def fetch_documents() -> tuple[str, str]:
    """The document whose fetch is held, and the one decoded meanwhile."""
    (doc, other), _ = documents(43, 2)
    return doc, other


def test_a_fetch_that_waits_holds_back_no_other_request(
    tiny_model: str, redis_url: str, redis_written: Written, tmp_path: Path
) -> None:
    """B's read of A's document waits on a fetch held at a gate (a store call that
    takes as long as the test wants); meanwhile another request decodes to its end.
    Only then does the gate open, and the held read answers as A did, from the
    store."""
    doc, other = fetch_documents()
    # The reference: A's answer with the prefix from its own cache, as B's will
    # come with it from the store (see read_twice_and_write_through).
    first = redis_written.cached[(doc, None)]

    gate = tmp_path / "gate"
    gated = "py://vllm_cpu_offload.testing.gated_store:GatedStore?" + urlencode(
        {"store": redis_url, "gate": str(gate)}
    )
    # Store calls unbounded (server_flags): the held fetch ends only at the gate.
    flags = server_flags(gated)
    with (
        running_server(tiny_model, flags) as second,
        ThreadPoolExecutor(1) as pool,
    ):
        before = settled_metrics(second.url, until=idle)
        held = pool.submit(complete, second, doc)
        # The held read has looked up its blocks in the store and waits for them.
        deadline = time.monotonic() + HANG_S
        while metrics(second.url).get(OFFLOAD + "remote_hit_tokens_total", 0) <= (
            before.get(OFFLOAD + "remote_hit_tokens_total", 0)
        ):
            assert time.monotonic() < deadline and not held.done()
            time.sleep(0.1)
        decoded = complete(second, other, max_tokens=32)
        assert decoded["usage"]["completion_tokens"] == 32
        assert not held.done()
        gate.touch()
        reply = held.result(timeout=HANG_S)
    assert text(reply) == text(first)
    assert cached_tokens(reply) == cached_tokens(first) >= HITS


def test_tensor_parallel_engines_share_every_ranks_shard(
    tiny_model: str, redis_url: str
) -> None:
    """TP=2: each rank writes its shard under its own key; B's hit needs both."""
    # Store calls unbounded (server_flags): on two busy cores a call past the
    # default 2 s would make a miss of timing alone.
    flags = [*server_flags(redis_url), "--tensor-parallel-size", "2"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    docs, _ = documents(47, 2)
    with running_server(tiny_model, flags, env=env) as first_server:
        for d in docs:
            complete(first_server, d)
        first = [complete(first_server, d) for d in docs]  # from A's cache
        # Both ranks write a shard of every block (a hit needs both).
        stepped_until(first_server, all_written(2, 2 * len(docs) * (BLOCKS - 1)))
    with running_server(tiny_model, flags, env=env) as second:
        again = [complete(second, d) for d in docs]
        after = settled_metrics(second.url, until=idle)
    assert [text(r) for r in again] == [text(r) for r in first]
    assert [cached_tokens(r) for r in again] == [cached_tokens(r) for r in first]
    assert all(cached_tokens(r) >= HITS for r in again), [r["usage"] for r in again]
    assert after[OFFLOAD + "remote_fetched_blocks_total"] >= 2 * (BLOCKS - 1)
