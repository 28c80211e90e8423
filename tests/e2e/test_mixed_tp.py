"""Engines of TP=1 and TP=2 share their documents through one Mooncake Store.

Sharded attention is stored one value per KV head under a namespace without the TP
size (`kv_shards.py`): a TP=2 engine writes each block as its ranks' heads, and a
TP=1 engine reads them, joined in host memory; a TP=1 engine's blocks are read by
each rank of a TP=2 engine, its own heads cut out. Real `vllm serve` processes, fp32,
greedy, one request at a time:

1. server A, TP=2, reads documents D1 (written through);
2. server B, TP=1, reads D1 (from the store: A's blocks) and D2 (written through);
3. server C, TP=2, reads D2 (from the store: B's blocks).

Each reader's answer is compared with what that engine computes itself: the same
tokens under another `cache_salt` (other block hashes, so nothing is shared), read
twice and answered the second time from its own cache. That is a server without the
flags' answer (test_flags_off and test_bf16_exact: the flags change no computed token),
and, as in test_shared_tier, the reference for a prefix that comes from a cache.
KV computed at another TP size differs in its last bits (the ranks' partial sums are
added in another order). In fp32 that leaves every greedy token as the reader computes
it, so a head cut or joined wrong (other bytes, not other rounding) is what would fail
here. In bf16 the rounding alone flips tokens of this random-weight model as often as
engines of the two sizes disagree without the flags at all:
benchmarks/mixed_tp_agreement.py measures both.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import pytest

from tests.e2e.servers import RunningServer, running_server
from tests.e2e.test_serving_load import OFFLOAD, complete, idle, settled_metrics
from tests.e2e.test_shared_tier import (
    BLOCKS,
    HITS,
    MOONCAKE_ENV,
    all_accounted,
    cached_tokens,
    documents,
    lost_writes,
    server_flags,
    stepped_until,
    text,
)
from vllm_cpu_offload.testing.store_servers import MooncakeServers

pytestmark = pytest.mark.e2e

DOCS = 2
# What a read from the store that did not arrive is counted as: a miss, recomputed.
FAULTS = (
    "remote_missed_blocks_total",
    "remote_fetch_failures_total",
    "remote_lookup_failures_total",
)


def _server(model: str, url: str, tp: int) -> AbstractContextManager[RunningServer]:
    # Store calls unbounded (server_flags): a TP=2 server beside the store's
    # processes on two busy cores may take seconds for a call, and a write or fetch
    # given up is a miss (correct, but not what this test is about).
    flags = server_flags(url)
    env = dict(MOONCAKE_ENV)
    if tp > 1:
        flags += ["--tensor-parallel-size", str(tp)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    return running_server(model, flags, env=env)


def _own_answers(server: RunningServer, docs: list[str]) -> list[dict]:
    """The server's answers to `docs` from its own cache, under a salt no other read
    uses."""
    for d in docs:
        complete(server, d, cache_salt="own")
    return [complete(server, d, cache_salt="own") for d in docs]


def _write(server: RunningServer, docs: list[str], ranks: int, blocks: int) -> bool:
    """Reads `docs`, and returns once each of the server's `ranks` wrote its heads of
    every block the server stored, `blocks` (or more) of them: its earlier reads'
    and these (each rank counts the blocks it wrote its heads of), or counted one
    lost. Whether every shard reached the store."""
    for d in docs:
        complete(server, d)
    return not lost_writes(stepped_until(server, all_accounted(ranks, ranks * blocks)))


def _read(server: RunningServer, docs: list[str], all_stored: bool) -> list[dict]:
    """The answers to `docs` read from the store; every block asked for arrived, or
    its miss was counted (a fetch the store's own client gave up on a busy machine,
    or a write the store refused: `all_stored` false), and the store gave some."""
    before = settled_metrics(server.url, until=idle)
    again = [complete(server, d) for d in docs]
    after = settled_metrics(server.url, until=idle)

    def grew(name: str) -> float:
        return after.get(OFFLOAD + name, 0) - before.get(OFFLOAD + name, 0)

    assert grew("remote_rejected_blocks_total") == 0
    hits, faults = grew("remote_hit_tokens_total"), {n: grew(n) for n in FAULTS}
    if all_stored and not any(faults.values()):
        assert hits >= DOCS * HITS, (hits, faults)
        assert all(cached_tokens(r) >= HITS for r in again), faults
    assert hits > 0, faults
    return again


def test_tp1_and_tp2_engines_read_each_others_documents(
    tiny_model: str, mooncake: MooncakeServers
) -> None:
    d1 = documents(53, DOCS)[0]
    d2 = documents(59, DOCS)[0]
    with _server(tiny_model, mooncake.url, tp=2) as a:
        d1_stored = _write(a, d1, ranks=2, blocks=DOCS * (BLOCKS - 1))  # a head a rank
    with _server(tiny_model, mooncake.url, tp=1) as b:
        own_d1 = _own_answers(b, d1)
        from_tp2 = _read(b, d1, d1_stored)
        # One rank writes both heads of D2's blocks and of its salted reads of D1.
        d2_stored = _write(b, d2, ranks=1, blocks=2 * DOCS * (BLOCKS - 1))
    assert [text(r) for r in from_tp2] == [text(r) for r in own_d1]
    with _server(tiny_model, mooncake.url, tp=2) as c:
        own_d2 = _own_answers(c, d2)
        from_tp1 = _read(c, d2, d2_stored)
    assert [text(r) for r in from_tp1] == [text(r) for r in own_d2]
