"""The shared store with several KV cache groups: the scheduler half's lookups past the
host hit, its fetch plans and write-throughs, with vLLM's own Request, block hasher and
hybrid KV manager (a full group and a window group of 8 tokens: a hit of n blocks needs
the window group's blocks n-2 and n-1 only)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from vllm_cpu_offload.block_transfer import AsyncLoad  # noqa: E402
from vllm_cpu_offload.metadata import OffloadWorkerReport  # noqa: E402
from vllm_cpu_offload.remote.namespace import shard_key  # noqa: E402
from vllm_cpu_offload.remote.store import RemoteStore  # noqa: E402
from vllm_cpu_offload.scheduler.block_pool import BlockState, HostBlockPool  # noqa: E402
from vllm_cpu_offload.scheduler.kv_groups import kv_groups_of  # noqa: E402
from vllm_cpu_offload.scheduler.policies.registry import make_policy  # noqa: E402
from vllm_cpu_offload.scheduler.remote_lookup import RemoteLookup  # noqa: E402
from vllm_cpu_offload.scheduler.shared_tier import attach_shared_tier  # noqa: E402
from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler  # noqa: E402

BS = 4  # tokens per block
WINDOW = 8
RANK = "r0"
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)
PROMPT = list(range(26))  # 6 full blocks, the 7th partial


class _Store(RemoteStore):
    """Holds the shard keys in `held`; records every question."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.asked: list[list[str]] = []

    def exists(self, keys: Any, timeout_s: float) -> list[bool]:
        self.asked.append(list(keys))
        return [key in self.held for key in keys]

    def put(self, keys: Any, values: Any, timeout_s: float) -> list[bool]:
        raise AssertionError("the scheduler half never writes")

    def get(self, keys: Any, into: Any, timeout_s: float) -> list[bool]:
        raise AssertionError("the scheduler half never reads")

    @property
    def description(self) -> str:
        return "in memory"


class Engine:
    """vLLM's hybrid KV manager plus our scheduler half, over `_Store`."""

    def __init__(self, host_blocks: int = 32) -> None:
        attn: dict[str, Any] = dict(
            block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32
        )
        config = KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["l0"], FullAttentionSpec(**attn)),
                KVCacheGroupSpec(
                    ["l1"], SlidingWindowSpec(sliding_window=WINDOW, **attn)
                ),
            ],
        )
        self.kv = KVCacheManager(
            config, max_model_len=64, scheduler_block_size=BS, hash_block_size=BS
        )
        self.store = _Store()
        self.pool = HostBlockPool(host_blocks, make_policy("lru", host_blocks))
        self.tier = HostTierScheduler(
            self.pool,
            block_size=BS,
            num_workers=1,
            block_bytes=64,
            groups=kv_groups_of(config, BS),
        )
        self.shared = attach_shared_tier(
            self.tier, RemoteLookup(self.store, [RANK], timeout_s=1.0), namespace="ns"
        )
        self.tier.bind_kv_cache_manager(self.kv)

    def remote(self, request: Request, group: int, blocks: range) -> None:
        """The store holds these blocks of the group."""
        for i in blocks:
            key = self.shared.remote_key((group, request.block_hashes[i]))
            self.store.held.add(shard_key(key, RANK))

    def host(self, request: Request, group: int, blocks: range) -> None:
        """The pool holds these blocks of the group, READY."""
        keys = [(group, request.block_hashes[i]) for i in blocks]
        parent = (
            (group, request.block_hashes[blocks.start - 1]) if blocks.start else None
        )
        assert len(self.pool.allocate_for_store(keys, parent)) == len(keys)
        self.pool.complete_store(keys, success=True)

    def admit(self, request: Request) -> tuple[int, AsyncLoad | None]:
        """Lookup, allocation and load plan of a new request; its hit and, where it
        loads across steps, its async load."""
        hit = self.tier.get_num_new_matched_tokens(request, 0)
        is_async = self.tier.load_is_async(request)
        self.kv.allocate_slots(
            request,
            request.num_tokens - hit,
            num_external_computed_tokens=hit,
            delay_cache_blocks=is_async,
        )
        self.tier.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), hit
        )
        meta = self.tier.build_connector_meta(SchedulerOutput.make_empty())
        if not is_async:
            return hit, None
        (async_load,) = meta.async_loads
        return hit, async_load

    def fetched(self, job: int, arrived: list[bool]) -> None:
        """The worker's fetch of `job` ended, then its load."""
        self.tier.update_connector_output(
            OffloadWorkerReport(fetched={job: arrived}, fetch_reports=Counter({job: 1}))
        )
        self.tier.update_connector_output(OffloadWorkerReport(Counter({job: 1})))


def _request(req_id: str) -> Request:
    return Request(
        req_id, PROMPT, SamplingParams(max_tokens=4), None, block_hasher=HASHER
    )


def test_a_hit_counts_where_every_group_finds_what_it_needs_in_the_store() -> None:
    # The store holds every block of the full group and the window group's blocks
    # 4 and 5: a hit of all 6 blocks, across steps. Without window block 4, a hit of
    # 6 or 5 blocks lacks a window block it needs; one of 4 blocks needs window blocks
    # 2 and 3, which the store holds.
    engine = Engine()
    request = _request("a")
    engine.remote(request, 0, range(6))
    engine.remote(request, 1, range(4, 6))
    assert engine.tier.get_num_new_matched_tokens(request, 0) == 6 * BS
    assert engine.tier.load_is_async(request)
    # One question for every group's blocks of the range, none asked again.
    (asked,) = engine.store.asked
    assert len(asked) == 2 * 6
    assert engine.tier.get_num_new_matched_tokens(request, 0) == 6 * BS
    assert len(engine.store.asked) == 1

    other = Engine()
    request = _request("b")
    other.remote(request, 0, range(6))
    other.remote(request, 1, range(1, 4))
    other.remote(request, 1, range(5, 6))
    assert other.tier.get_num_new_matched_tokens(request, 0) == 4 * BS
    assert other.tier.stats.remote_lookup_tokens == 6 * BS  # each block counted once


def test_a_hit_fetches_what_the_pool_lacks_in_every_group_and_pins_the_rest() -> None:
    # The pool holds the full group's 6 blocks but no window block, so no host hit; the
    # store holds window blocks 4 and 5. The hit pins the 6 host blocks, fetches the
    # two window blocks into new host blocks, and loads all 8 once they arrive.
    engine = Engine()
    request = _request("a")
    engine.host(request, 0, range(6))
    engine.remote(request, 1, range(4, 6))
    hit, async_load = engine.admit(request)
    assert hit == 6 * BS and async_load is not None
    full, window = engine.kv.get_block_ids("a")
    hashes = request.block_hashes
    wanted = [(1, hashes[4]), (1, hashes[5])]
    assert list(async_load.fetch.keys) == [
        engine.shared.remote_key(key) for key in wanted
    ]
    assert engine.pool.num_pinned == 6 and async_load.whole
    assert list(async_load.load.device_block_ids) == full[:6] + window[4:6]
    assert async_load.fetched_from == 6 and list(async_load.unloadable) == []
    slots = list(async_load.load.host_block_ids)
    assert slots[6:] == list(async_load.fetch.host_blocks)
    assert all(engine.pool.state_of(key) is BlockState.STORING for key in wanted)
    engine.fetched(async_load.load.job_id, [True, True])
    assert all(engine.pool.state_of(key) is BlockState.READY for key in wanted)
    assert engine.pool.num_pinned == 0 and engine.tier.num_jobs_in_flight == 0
    assert engine.tier.stats.remote_hit_tokens == 6 * BS
    assert engine.tier.stats.loaded_by_group == Counter({0: 6, 1: 2})


def test_a_window_block_that_does_not_arrive_is_a_miss_and_not_asked_again() -> None:
    # Window block 5 does not arrive: it leaves the pool (block 4 stays, it arrived),
    # and the request's next lookup asks the store nothing: no hit, a recompute.
    engine = Engine()
    request = _request("a")
    engine.host(request, 0, range(6))
    engine.remote(request, 1, range(4, 6))
    _, async_load = engine.admit(request)
    assert async_load is not None
    engine.fetched(async_load.load.job_id, [True, False])
    hashes = request.block_hashes
    assert (1, hashes[5]) not in engine.pool
    assert engine.pool.state_of((1, hashes[4])) is BlockState.READY
    assert engine.tier.stats.remote_missed_blocks == 1
    asked = len(engine.store.asked)
    assert engine.tier.get_num_new_matched_tokens(request, 0) == 0
    assert len(engine.store.asked) == asked


def test_a_hit_that_gets_no_host_block_for_a_window_block_fails_whole() -> None:
    # A pool of 7 blocks, 6 of them the pinned full group: one window block gets a host
    # block, the other none. The load is planned whole (the worker fails it, vLLM
    # recomputes the request), and the store is not asked again for the request.
    engine = Engine(host_blocks=7)
    request = _request("a")
    engine.host(request, 0, range(6))
    engine.remote(request, 1, range(4, 6))
    _, async_load = engine.admit(request)
    assert async_load is not None and async_load.whole
    window = engine.kv.get_block_ids("a")[1]
    assert len(async_load.fetch.keys) == 1
    assert list(async_load.unloadable) == [window[5]]
    asked = len(engine.store.asked)
    engine.fetched(async_load.load.job_id, [True])
    assert engine.pool.num_pinned == 0 and engine.tier.num_jobs_in_flight == 0
    assert engine.tier.get_num_new_matched_tokens(request, 0) == 0
    assert len(engine.store.asked) == asked


def test_a_hit_that_fails_whole_at_planning_counts_nothing_loaded() -> None:
    # As above: the full group's 6 blocks are in the pool, one window block gets a host
    # block and the other none. The worker loads nothing and fails the request, so no
    # group's blocks count as loaded (the per-group counters would show a group loaded
    # without the other) and no token as a hit; the window block fetched still counts.
    engine = Engine(host_blocks=7)
    request = _request("a")
    engine.host(request, 0, range(6))
    engine.remote(request, 1, range(4, 6))
    _, async_load = engine.admit(request)
    assert async_load is not None and async_load.whole and async_load.unloadable
    engine.fetched(async_load.load.job_id, [True])
    stats = engine.tier.stats
    assert stats.loaded_by_group == Counter() and stats.loaded_blocks == 0
    assert stats.hit_tokens == stats.remote_hit_tokens == 0
    assert stats.remote_fetched_blocks == 1


def test_every_groups_stored_blocks_are_written_through() -> None:
    # A prefill stores 6 blocks of each group; one write-through names all 12, each
    # under its group's key, from the host blocks the store copies into.
    engine = Engine()
    request = _request("a")
    hit, _ = engine.admit(request)
    assert hit == 0
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {"a": len(PROMPT)}
    meta = engine.tier.build_connector_meta(out)
    (store,) = meta.stores
    (write,) = meta.writes
    keys = [(g, request.block_hashes[i]) for g in (0, 1) for i in range(6)]
    assert list(write.keys) == [engine.shared.remote_key(key) for key in keys]
    assert list(write.host_blocks) == list(store.host_block_ids)
    assert write.job_id == store.job_id
