"""The shared store with vLLM's hybrid KV cache manager: vLLM's own Scheduler with our
connector (see test_vllm_scheduler_with_our_connector.py), a full-attention group and a
sliding-window group of two blocks, two engines on one redis-server.

The forward checks every slot a step reads (the window group: the window before the
first token it computes), so a block loaded wrong, or a window block missing, shows as a
wrong value.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

pytest.importorskip("vllm")

from tests.vllm_helpers.test_vllm_scheduler_with_our_connector import (  # noqa: E402
    BLOCK_SIZE,
    Engine,
    _written_through,
    vllm_utils,  # noqa: F401 (a fixture)
)

WINDOW = 2 * BLOCK_SIZE
PROMPT_TOKENS = 6 * BLOCK_SIZE + 3  # 6 full blocks
# A hit of 6 blocks needs the window group's blocks 4 and 5 only.
WINDOW_BLOCKS = 2


@pytest.fixture
def engines(
    vllm_utils: ModuleType,  # noqa: F811
    tiny_model: str,
    redis_url: str,
) -> Iterator[tuple[Engine, Engine]]:
    # Two hybrid engines on one store, each with its own (empty) device cache and
    # host tier.
    pair = (
        Engine(vllm_utils, tiny_model, redis_url, sliding_window=WINDOW),
        Engine(vllm_utils, tiny_model, redis_url, sliding_window=WINDOW),
    )
    yield pair
    for engine in pair:
        engine.worker.shutdown()


def _assert_drained(engine: Engine) -> None:
    """Nothing left in vLLM's scheduler nor in the tier. (vLLM's own
    `assert_scheduler_empty` reads one group only and wants every block's reference
    count 0, which the hybrid manager's null block is not.)"""
    scheduler = engine.scheduler
    assert not scheduler.requests and not scheduler.running
    assert not scheduler.finished_recving_kv_req_ids
    pool = scheduler.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
    assert engine.tier.num_jobs_in_flight == 0
    assert engine.tier.pool.num_pinned == 0 and engine.tier.pool.num_storing == 0


def _tear(engine: Engine, redis_url: str, group: int, block_hash: object) -> None:
    """Overwrites the store's value of one block of `engine`'s: a fetch refuses it."""
    import redis

    from vllm_cpu_offload.remote.namespace import shard_key

    assert engine.worker.worker is not None
    io = engine.worker.worker.shared.remote_io
    assert io is not None
    key = shard_key(
        engine.tier.shared.remote_key((group, block_hash)), io.values.names[0]
    )
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.exists(key) and client.set(key, b"torn")
    finally:
        client.close()


def test_a_hybrid_prefix_another_engine_computed_comes_from_the_shared_store(
    engines: tuple[Engine, Engine],
) -> None:
    # A computes and writes both groups' blocks through; B fetches every block of the
    # full group and the window group's last window, and every slot it reads, in
    # both groups, holds its token.
    a, b = engines
    a.run(a.request(1, PROMPT_TOKENS))
    assert a.tier.stats.stored_by_group[0] == a.tier.stats.stored_by_group[1] == 6
    _written_through(a)
    request = b.request(1, PROMPT_TOKENS)
    b.run(request)
    assert b.tier.stats.remote_hit_tokens == 6 * BLOCK_SIZE
    assert b.tier.stats.remote_fetched_blocks == 6 + WINDOW_BLOCKS
    assert b.tier.stats.loaded_by_group == {0: 6, 1: WINDOW_BLOCKS}
    assert b.checked_slots >= 6 * BLOCK_SIZE + WINDOW
    assert b.invalid_blocks == 0 and b.failed_loads == 0
    assert len(request.output_token_ids) == 8
    for engine in engines:
        _written_through(engine)
        _assert_drained(engine)


def test_a_window_block_the_store_cannot_serve_costs_a_recompute(
    engines: tuple[Engine, Engine], redis_url: str
) -> None:
    # The store lists window block 5 but serves a torn value: B's fetch misses it, the
    # load is failed whole (vLLM takes no load error of single blocks with several
    # groups) and B recomputes the request, every slot right.
    a, b = engines
    a.run(a.request(2, PROMPT_TOKENS))
    _written_through(a)
    request = b.request(2, PROMPT_TOKENS)
    _tear(a, redis_url, 1, request.block_hashes[5])
    b.run(request)
    assert b.tier.stats.remote_missed_blocks == 1
    assert b.failed_loads == 1 and b.invalid_blocks == 0
    assert b.checked_slots >= 6 * BLOCK_SIZE  # the recompute's own slots, read back
    assert len(request.output_token_ids) == 8
    for engine in engines:
        _written_through(engine)
        _assert_drained(engine)


def test_a_hybrid_host_load_whose_copy_fails_costs_a_recompute_not_a_crash(
    vllm_utils: ModuleType,  # noqa: F811
    tiny_model: str,
) -> None:
    # No store: a re-read hits the host tier. Its copy fails; with several groups vLLM
    # takes no load error of single blocks (it raises), so the hit loads across steps
    # and its failure fails the request, which vLLM recomputes, every slot right.
    from tests.fault_injection import FaultInjector

    engine = Engine(vllm_utils, tiny_model, sliding_window=WINDOW)
    try:
        engine.run(engine.request(3, PROMPT_TOKENS))
        assert engine.scheduler.reset_prefix_cache()  # the device forgets, not the tier
        assert engine.worker.worker is not None
        engine.worker.worker.faults = FaultInjector(1.0)  # every copy from now on
        request = engine.request(3, PROMPT_TOKENS)
        engine.run(request)
        assert engine.tier.stats.failed_loads == 1
        assert engine.failed_loads == 1 and engine.invalid_blocks == 0
        assert engine.checked_slots >= 2 * 6 * BLOCK_SIZE  # both reads computed it
        assert len(request.output_token_ids) == 8
        _assert_drained(engine)
    finally:
        engine.worker.shutdown()
