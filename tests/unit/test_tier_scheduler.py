"""The scheduler half, method by method, with vLLM's own Request, block hasher and KV
manager."""

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

from vllm_cpu_offload.metadata import OffloadStepMetadata, OffloadWorkerReport  # noqa: E402
from vllm_cpu_offload.scheduler.block_pool import BlockState, HostBlockPool  # noqa: E402
from vllm_cpu_offload.scheduler.kv_groups import kv_groups_of  # noqa: E402
from vllm_cpu_offload.scheduler.policies.registry import (  # noqa: E402
    POLICY_NAMES,
    make_policy,
)
from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler  # noqa: E402
from vllm_cpu_offload.worker.tier_worker import HostTierWorker  # noqa: E402

BS = 4  # tokens per block
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


class Engine:
    """vLLM's KV manager plus our scheduler half, stepped the way vLLM's scheduler
    does."""

    def __init__(
        self,
        host_blocks: int = 8,
        workers: int = 1,
        policy: str = "lru",
        sliding_window: int | None = None,
        k: int = 1,
        async_load_tokens: int = 0,
    ) -> None:
        attn: dict[str, Any] = dict(
            block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32
        )
        groups = [KVCacheGroupSpec(["l0"], FullAttentionSpec(**attn))]
        # vLLM's hybrid manager: a full and a window group.
        if sliding_window is not None:
            swa = SlidingWindowSpec(sliding_window=sliding_window, **attn)
            groups.append(KVCacheGroupSpec(["l1"], swa))
        config = KVCacheConfig(
            num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups
        )
        self.kv = KVCacheManager(
            config, max_model_len=64, scheduler_block_size=BS, hash_block_size=BS
        )
        self.pool = HostBlockPool(host_blocks, make_policy(policy, host_blocks))
        self.tier = HostTierScheduler(
            self.pool,
            block_size=BS,
            num_workers=workers,
            block_bytes=64,
            groups=kv_groups_of(config, BS),
            blocks_per_host_block=k,
            async_load_tokens=async_load_tokens,
        )
        self.tier.bind_kv_cache_manager(self.kv)

    def admit(self, request: Request) -> int:
        """Lookup, allocation and load plan of a new request (no device hit); returns
        the hit."""
        hit = self.tier.get_num_new_matched_tokens(request, 0)
        self.kv.allocate_slots(
            request, request.num_tokens - hit, num_external_computed_tokens=hit
        )
        self.tier.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), hit
        )
        request.num_computed_tokens = hit
        return hit

    def step(
        self, scheduled: dict[str, int], preempted: set[str] | None = None
    ) -> OffloadStepMetadata:
        out = SchedulerOutput.make_empty()
        out.num_scheduled_tokens = scheduled
        out.preempted_req_ids = preempted
        meta = self.tier.build_connector_meta(out)
        assert isinstance(meta, OffloadStepMetadata)
        return meta

    def report(self, *job_ids: int, failed: tuple[int, ...] = ()) -> None:
        self.tier.update_connector_output(
            OffloadWorkerReport(Counter(job_ids), Counter(failed))
        )


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(
        req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=HASHER
    )


def _prefill(engine: Engine, request: Request) -> OffloadStepMetadata:
    hit = engine.admit(request)
    meta = engine.step({request.request_id: request.num_tokens - hit})
    request.num_computed_tokens = request.num_tokens
    return meta


def hold(engine: Engine, request: Request, group: int, blocks: range) -> None:
    """Puts `request`'s `blocks` of KV cache group `group` in the pool, READY."""
    pool, hashes = engine.tier.pool, request.block_hashes
    keys = [(group, hashes[i]) for i in blocks]
    parent = (group, hashes[blocks.start - 1]) if blocks.start else None
    assert len(pool.allocate_for_store(keys, parent)) == len(keys)
    pool.complete_store(keys, success=True)


def _key(request: Request, i: int) -> Any:
    return (0, request.block_hashes[i])


def test_store_plan_covers_the_full_blocks_of_the_step() -> None:
    # 10 tokens of 4-token blocks: two full blocks are stored, from their device blocks.
    engine = Engine()
    request = _request("a", list(range(10)))
    meta = _prefill(engine, request)
    (store,) = meta.stores
    assert store.device_block_ids == engine.kv.get_block_ids("a")[0][:2]
    assert len(set(store.host_block_ids)) == 2
    assert engine.tier.pool.state_of(_key(request, 0)) is BlockState.STORING


def test_stored_blocks_are_visible_only_after_the_report() -> None:
    # Before the worker reports the store, a twin request misses; after, it hits.
    engine = Engine()
    meta = _prefill(engine, _request("a", list(range(10))))
    twin = _request("b", list(range(10)))
    assert engine.tier.get_num_new_matched_tokens(twin, 0) == 0
    engine.report(meta.stores[0].job_id)
    assert engine.tier.get_num_new_matched_tokens(twin, 0) == 2 * BS


def test_lookup_starts_after_the_device_hit_and_leaves_one_token() -> None:
    # The hit is contiguous from the device hit on, and never the whole prompt: a
    # prompt that ends on a block boundary hits its last block but one token.
    engine = Engine()
    meta = _prefill(engine, _request("a", list(range(8))))
    engine.report(meta.stores[0].job_id)
    twin = _request("b", list(range(8)))
    assert engine.tier.get_num_new_matched_tokens(twin, 0) == 2 * BS - 1
    assert engine.tier.get_num_new_matched_tokens(twin, BS) == BS - 1
    longer = _request("c", list(range(8)) + [99])
    assert engine.tier.get_num_new_matched_tokens(longer, BS) == BS


def test_device_hits_reach_the_policy_as_device_hits() -> None:
    # The host copies of the blocks the device cache hit are touched, and the policy
    # hears that the device served them, not the host.
    engine = Engine()
    engine.report(_prefill(engine, _request("a", list(range(10)))).stores[0].job_id)
    policy = engine.pool.policy
    heard: list[tuple[str, list[Any]]] = []
    policy.on_device_hit = lambda blocks: heard.append(  # type: ignore[method-assign]
        ("device", [block.key for block in blocks])
    )
    policy.on_access = lambda blocks: heard.append(  # type: ignore[method-assign]
        ("host", [block.key for block in blocks])
    )
    twin = _request("b", list(range(10)))
    assert engine.tier.get_num_new_matched_tokens(twin, BS) == BS
    assert heard == [("host", [_key(twin, 1)])]
    engine.tier.update_state_after_alloc(twin, [[]], 0)
    assert heard[1:] == [("device", [_key(twin, 0)])]


def test_a_hit_one_token_short_of_the_prompt_loads_its_last_block() -> None:
    # vLLM computes the prompt's last token again (writing the same KV over the
    # loaded one); the block holding it is loaded whole and never stored again.
    engine = Engine()
    meta = _prefill(engine, _request("a", list(range(8))))
    engine.report(meta.stores[0].job_id)
    twin = _request("b", list(range(8)))
    assert engine.admit(twin) == 2 * BS - 1
    meta = engine.step({"b": 1})
    (load,) = meta.loads
    assert load.device_block_ids == engine.kv.get_block_ids("b")[0][:2]
    assert not meta.stores
    engine.report(load.job_id)
    assert engine.tier.stats.hit_tokens == 2 * BS - 1
    assert engine.tier.stats.loaded_blocks == 2


def test_load_plan_pins_host_blocks_until_the_load_is_reported() -> None:
    # A hit becomes a load into the new device blocks; its host blocks stay
    # pinned till done.
    engine = Engine()
    meta = _prefill(engine, _request("a", list(range(10))))
    engine.report(meta.stores[0].job_id)
    twin = _request("b", list(range(10)))
    assert engine.admit(twin) == 2 * BS
    meta = engine.step({"b": 2})
    (load,) = meta.loads
    assert load.device_block_ids == engine.kv.get_block_ids("b")[0][:2]
    assert engine.tier.pool.num_pinned == 2
    assert not meta.stores, "loaded blocks are not stored again"
    engine.report(load.job_id)
    assert engine.tier.pool.num_pinned == 0
    assert (
        engine.tier.stats.hit_tokens == 2 * BS and engine.tier.stats.loaded_blocks == 2
    )


@pytest.mark.parametrize("k", [1, 2])
def test_a_host_hit_of_async_load_tokens_or_more_loads_across_steps(k: int) -> None:
    # With another request computing in the last step, the hit waits as a shared
    # store's does (vLLM's waiting-for-remote-KV state): one job with nothing to fetch
    # loads every block of it, and its host blocks stay pinned until every worker
    # reported it.
    engine = Engine(async_load_tokens=2 * BS, k=k, workers=2)
    meta = _prefill(engine, _request("a", list(range(10))))
    for _ in range(2):
        engine.report(meta.stores[0].job_id)
    twin = _request("b", list(range(10)))
    assert engine.admit(twin) == 2 * BS and engine.tier.load_is_async(twin)
    meta = engine.step({})
    assert not meta.loads and not meta.stores
    (async_load,) = meta.async_loads
    job = async_load.load.job_id
    assert async_load.fetch.keys == [] and not async_load.unloadable
    assert async_load.load.device_block_ids == engine.kv.get_block_ids("b")[0][:2]
    assert async_load.fetched_from == 2
    assert engine.tier.pool.num_pinned == 2 // k
    done = OffloadWorkerReport(
        Counter({job: 1}), Counter(), {job: []}, Counter({job: 1})
    )
    engine.tier.update_connector_output(done)
    assert engine.tier.pool.num_pinned == 2 // k  # one worker of two
    engine.tier.update_connector_output(done)
    assert engine.tier.pool.num_pinned == 0
    assert engine.tier.stats.hit_tokens == 2 * BS
    assert engine.tier.stats.async_hit_tokens == 2 * BS
    assert engine.tier.stats.remote_hit_tokens == 0


def test_a_host_hit_with_no_other_request_running_loads_inside_its_step() -> None:
    # Nothing ran in the last step: no decode to hold back, so the hit loads in its
    # step (a step sooner) however large it is.
    engine = Engine(async_load_tokens=2 * BS)
    meta = _prefill(engine, _request("a", list(range(10))))
    engine.report(meta.stores[0].job_id)
    engine.step({})
    twin = _request("b", list(range(10)))
    assert engine.admit(twin) == 2 * BS and not engine.tier.load_is_async(twin)
    meta = engine.step({"b": 2})
    assert len(meta.loads) == 1 and not meta.async_loads


def test_a_host_hit_below_async_load_tokens_loads_inside_its_step() -> None:
    # One block is below the threshold of two: loaded in the step, as without one;
    # the prompt's last block but one token counts its tokens, not its blocks.
    engine = Engine(async_load_tokens=2 * BS)
    meta = _prefill(engine, _request("a", list(range(10))))
    engine.report(meta.stores[0].job_id)
    short = _request("b", [*range(BS), 50, 51])
    assert engine.admit(short) == BS and not engine.tier.load_is_async(short)
    meta = engine.step({"b": 2})
    assert len(meta.loads) == 1 and not meta.async_loads
    engine.report(meta.loads[0].job_id)
    whole = _request("c", list(range(2 * BS)))  # 2 * BS - 1 tokens: below it too
    assert engine.admit(whole) == 2 * BS - 1
    assert not engine.tier.load_is_async(whole)


def test_a_job_completes_once_every_worker_reported_it() -> None:
    # With two workers, one report is not enough for the store to become visible.
    engine = Engine(workers=2)
    request = _request("a", list(range(10)))
    job = _prefill(engine, request).stores[0].job_id
    engine.report(job)
    assert engine.tier.pool.state_of(_key(request, 0)) is BlockState.STORING
    engine.report(job)
    assert engine.tier.pool.state_of(_key(request, 0)) is BlockState.READY


def test_finished_request_with_store_in_flight_is_freed_late() -> None:
    # request_finished keeps the device blocks while a store reads them, and says
    # so to workers.
    engine = Engine()
    busy, idle = _request("a", list(range(10))), _request("b", list(range(20, 30)))
    _prefill(engine, busy)
    job = _prefill(engine, idle).stores[0].job_id
    engine.report(job)
    assert engine.tier.request_finished(busy) is True
    assert engine.tier.request_finished(idle) is False
    assert engine.step({}).delayed_free_req_ids == ["a"]


def test_store_reported_in_the_finishing_step_frees_the_blocks_in_that_step() -> None:
    # vLLM finishes a request before it reads the step's report; a store in that report
    # releases the blocks at once, so an engine that goes idle holds none of them.
    engine = Engine()
    request = _request("a", list(range(10)))
    job = _prefill(engine, request).stores[0].job_id
    assert engine.tier.request_finished(request) is True
    assert engine.tier.update_connector_output(OffloadWorkerReport(Counter([job]))) == {
        "a"
    }
    assert engine.step({}).delayed_free_req_ids == []


def test_store_still_in_flight_is_handed_to_the_workers_once() -> None:
    # A store not in the finishing step's report: the workers hold the blocks
    # and report them.
    engine = Engine(workers=2)
    request = _request("a", list(range(10)))
    job = _prefill(engine, request).stores[0].job_id
    engine.tier.request_finished(request)
    assert (
        engine.tier.update_connector_output(OffloadWorkerReport(Counter([job])))
        == set()
    )
    assert engine.step({}).delayed_free_req_ids == ["a"]
    # The second worker's report comes after the hand-over: the workers free it, not us.
    assert (
        engine.tier.update_connector_output(OffloadWorkerReport(Counter([job])))
        == set()
    )
    assert engine.step({}).delayed_free_req_ids == []


def test_failed_store_frees_its_blocks_and_failed_load_unpins() -> None:
    # Faults cost a miss: nothing failed becomes visible, nothing stays pinned.
    engine = Engine()
    request = _request("a", list(range(10)))
    job = _prefill(engine, request).stores[0].job_id
    engine.report(failed=(job,))
    assert _key(request, 0) not in engine.tier.pool
    assert engine.tier.stats.failed_stores == 1

    meta = _prefill(engine, _request("c", list(range(10))))
    engine.report(meta.stores[0].job_id)
    twin = _request("d", list(range(10)))
    engine.admit(twin)
    load = engine.step({"d": 2}).loads[0]
    engine.report(failed=(load.job_id,))
    assert engine.tier.pool.num_pinned == 0 and engine.tier.stats.failed_loads == 1


def test_preemption_restarts_the_store_plan() -> None:
    # A preempted request lost its device blocks; the next plan starts from block 0
    # again, and skips what the host tier holds already.
    engine = Engine()
    request = _request("a", list(range(10)))
    engine.report(_prefill(engine, request).stores[0].job_id)
    engine.kv.free(request)
    meta = engine.step({}, preempted={"a"})
    assert meta.preempted_req_ids == ["a"]
    assert engine.tier.stats.preempted_requests == 1
    request.num_computed_tokens = 0
    engine.admit(request)
    meta = engine.step({"a": request.num_tokens - request.num_computed_tokens})
    assert not meta.stores  # both full blocks are held already


def test_decode_blocks_are_stored_as_they_fill() -> None:
    # Tokens appended by decoding complete a block: that block is stored too.
    engine = Engine()
    request = _request("a", list(range(7)))
    meta = _prefill(engine, request)
    assert [len(s.host_block_ids) for s in meta.stores] == [1]
    request.append_output_token_ids(100)
    engine.kv.allocate_slots(request, 1)
    meta = engine.step({"a": 1})
    assert [len(s.host_block_ids) for s in meta.stores] == [1]


def test_reset_cache_drops_every_ready_block() -> None:
    # reset_cache empties the host tier; lookups miss afterwards.
    engine = Engine()
    engine.report(_prefill(engine, _request("a", list(range(10)))).stores[0].job_id)
    assert engine.tier.reset_cache() is True
    assert engine.tier.pool.num_used == 0
    assert (
        engine.tier.get_num_new_matched_tokens(_request("b", list(range(10))), 0) == 0
    )


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_stores_beyond_capacity_are_skipped_not_errors(policy: str) -> None:
    # A host tier of 2 blocks and a 5-block prompt: the pool never exceeds its size.
    engine = Engine(host_blocks=2, policy=policy)
    meta = _prefill(engine, _request("a", list(range(21))))
    assert sum(len(s.host_block_ids) for s in meta.stores) <= 2
    assert engine.tier.pool.num_used <= 2


def test_hybrid_groups_store_every_group_and_load_only_the_window() -> None:
    # A full group and an 8-token window group on vLLM's hybrid KV manager. A 26-token
    # prompt stores its 6 full blocks in both groups; its twin loads all 6 blocks of the
    # full group but only blocks 4 and 5 of the window group: vLLM gave the window group
    # its null block for blocks 0-3, which the next token does not attend to.
    engine = Engine(host_blocks=16, sliding_window=8)
    first = _request("a", list(range(26)))
    meta = _prefill(engine, first)
    (store,) = meta.stores
    ids = engine.kv.get_block_ids("a")
    assert sorted(store.device_block_ids) == sorted(ids[0][:6] + ids[1][:6])
    engine.report(store.job_id)

    twin = _request("b", list(range(26)))
    assert engine.admit(twin) == 6 * BS
    full, window = engine.kv.get_block_ids("b")
    null = engine.kv.block_pool.null_block.block_id
    assert window[:4] == [null] * 4 and null not in window[4:6]
    meta = engine.tier.build_connector_meta(SchedulerOutput.make_empty())
    # Several groups: the hit loads across steps, whole or not at all, so that a
    # failed copy fails the request (vLLM takes no load error of single blocks).
    (async_load,) = meta.async_loads
    assert not meta.loads and async_load.whole and not async_load.fetch.keys
    load = async_load.load
    assert load.device_block_ids == full[:6] + window[4:6]
    pool = engine.pool
    expected = [(0, twin.block_hashes[i]) for i in range(6)]
    expected += [(1, twin.block_hashes[i]) for i in (4, 5)]
    assert load.host_block_ids == [pool._by_key[key].block_id for key in expected]
    assert engine.tier.stats.loaded_blocks == 8


def test_hybrid_hit_stops_where_the_window_group_lacks_a_block() -> None:
    # The host tier holds blocks 0-5 of the full group but only 0-4 of the window
    # group. A 6-block hit would need window block 5; a 5-block hit needs window
    # blocks 3 and 4, so the hit is 5 blocks. Without window block 4 either, only 4
    # blocks can be served.
    engine = Engine(host_blocks=16, sliding_window=8)
    request = _request("b", list(range(26)))
    hold(engine, request, 0, range(6))
    hold(engine, request, 1, range(5))
    assert engine.tier.get_num_new_matched_tokens(request, 0) == 5 * BS
    other = _request("c", list(range(26)))
    engine.tier.pool.reset()
    hold(engine, request, 0, range(6))
    hold(engine, request, 1, range(4))
    assert engine.tier.get_num_new_matched_tokens(other, 0) == 4 * BS


def test_host_blocks_of_two_device_blocks() -> None:
    # k = 2: a 26-token prompt (6 full blocks) is stored as 3 host blocks, each keyed by
    # its last device block's hash and copied into two consecutive host slots. A
    # 22-token prompt (5 full blocks) stores only the 2 host blocks it fills.
    engine = Engine(host_blocks=8, k=2)
    first = _request("a", list(range(26)))
    (store,) = _prefill(engine, first).stores
    assert store.device_block_ids == engine.kv.get_block_ids("a")[0][:6]
    slots = store.host_block_ids
    assert [s // 2 for s in slots[::2]] == [s // 2 for s in slots[1::2]]
    assert [s % 2 for s in slots] == [0, 1] * 3
    assert engine.tier.pool.state_of((0, first.block_hashes[1])) is BlockState.STORING
    assert (0, first.block_hashes[0]) not in engine.tier.pool
    engine.report(store.job_id)
    assert engine.tier.stats.stored_blocks == 6

    other = _request("b", list(range(100, 122)))
    (short,) = _prefill(engine, other).stores
    assert len(short.device_block_ids) == 4

    # A twin loads all 6 blocks into the slots they were stored in; after a device hit
    # of one block, the hit still ends at a host block's end (5 more blocks).
    twin = _request("c", list(range(26)))
    assert engine.tier.get_num_new_matched_tokens(twin, BS) == 5 * BS
    assert engine.admit(twin) == 6 * BS
    (load,) = engine.tier.build_connector_meta(SchedulerOutput.make_empty()).loads
    assert load.device_block_ids == engine.kv.get_block_ids("c")[0][:6]
    assert load.host_block_ids == slots
    # 24 tokens end on a host block's end: the hit is all of them but the last.
    assert (
        engine.tier.get_num_new_matched_tokens(_request("d", list(range(24))), 0)
        == 6 * BS - 1
    )
    # 23 tokens: the third host block is not full, and a hit ends where a host block
    # ends.
    assert (
        engine.tier.get_num_new_matched_tokens(_request("e", list(range(23))), 0)
        == 4 * BS
    )


def test_resumed_hybrid_request_stores_around_the_window_groups_null_blocks() -> None:
    # A twin resumed from the host tier holds vLLM's null block for window blocks 0-3.
    # The host tier then loses everything (a reset stands in for evictions), and the
    # twin is preempted: its store plan restarts at block 0 and stores every block it
    # holds, all 7 of the full group and window blocks 4-6, never the null block.
    engine = Engine(host_blocks=16, sliding_window=8)
    engine.report(_prefill(engine, _request("a", list(range(26)))).stores[0].job_id)
    twin = _request("b", list(range(26)))
    assert engine.admit(twin) == 6 * BS
    meta = engine.tier.build_connector_meta(SchedulerOutput.make_empty())
    engine.report(meta.async_loads[0].load.job_id)  # several groups: across steps
    engine.tier.pool.reset()
    engine.step({}, preempted={"b"})
    twin.append_output_token_ids([1, 2])  # 28 tokens: block 6 is full after this step
    engine.kv.allocate_slots(twin, 4)
    (store,) = engine.step({"b": 4}).stores
    full, window = engine.kv.get_block_ids("b")
    null = engine.kv.block_pool.null_block.block_id
    assert window[:4] == [null] * 4
    assert store.device_block_ids == full[:7] + window[4:7]


def test_a_request_whose_hashes_no_longer_hold_neither_loads_nor_stores() -> None:
    # Its adapter changed since it was hashed (`lora_identity.hashes_hold`): the
    # host tier holds its prefix, but it loads none of it and stores nothing.
    engine = Engine()
    engine.report(_prefill(engine, _request("a", list(range(10)))).stores[0].job_id)
    stale = _request("b", list(range(10)))
    engine.tier.hashes_hold = lambda request: request.request_id != "b"
    assert engine.tier.get_num_new_matched_tokens(stale, 0) == 0
    assert _prefill(engine, _request("c", list(range(100, 110)))).stores
    assert not _prefill(engine, _request("b", list(range(200, 210)))).stores


def test_reset_cache_tells_the_layers_the_identity_may_change() -> None:
    # vLLM resets connectors' caches around weight updates; so does a worker's
    # report of a weight change, before the report's stores are settled.
    engine = Engine()
    told: list[str] = []
    engine.tier.on_identity_change.append(told.append)
    engine.tier.reset_cache()
    assert len(told) == 1 and "reset" in told[0]
    a = _request("a", list(range(10)))
    store = _prefill(engine, a).stores[0]

    def settled() -> bool:
        return not engine.tier.num_jobs_in_flight

    engine.tier.on_identity_change.append(lambda why: told.append(str(settled())))
    engine.tier.update_connector_output(
        OffloadWorkerReport(
            Counter([store.job_id]),
            weights_changed="reload_weights",
            epochs={"w0": 1},
        )
    )
    assert told[1:] == ["reload_weights", "False"]
    assert settled()
    # The report's store held KV of the weights before: no lookup finds it.
    assert engine.tier.pool.count_hits([(0, h) for h in a.block_hashes]) == 0
    # Each step's metadata says which epoch of each worker the scheduler heard of.
    meta = _prefill(engine, _request("b", list(range(20, 30))))
    assert meta.epochs_heard == {"w0": 1}


def _reports(*workers: HostTierWorker) -> OffloadWorkerReport:
    """The workers' reports of a step, joined as vLLM's aggregator joins them."""
    joined = OffloadWorkerReport()
    for worker in workers:
        report = worker.take_report()
        if report is not None:
            joined = joined.aggregate(report)
    return joined


def test_each_workers_weight_change_is_heard_whichever_step_it_comes_at() -> None:
    # TP 2: rank 0's weights change, then (a step later) rank 1's, and rank 1's
    # worker, restarted, counts its changes from 0 again. The scheduler half hears
    # every one: KV rank 1 stored in between, of its weights before, is dropped,
    # and each step's metadata carries each worker's own epoch, which its loads
    # are checked against.
    engine = Engine(workers=2)
    told: list[str] = []
    engine.tier.on_identity_change.append(told.append)
    ranks = [HostTierWorker(4, 4), HostTierWorker(4, 4)]
    ranks[0].weights_changed("reload_weights")
    engine.tier.update_connector_output(_reports(*ranks))
    a = _request("a", list(range(10)))
    store = _prefill(engine, a).stores[0]
    engine.report(store.job_id, store.job_id)  # rank 1 stored its old weights' KV
    ranks[1].weights_changed("reload_weights")
    engine.tier.update_connector_output(_reports(*ranks))
    assert len(told) == 2
    assert engine.tier.pool.count_hits([(0, h) for h in a.block_hashes]) == 0
    meta = _prefill(engine, _request("b", list(range(20, 30))))
    assert meta.epochs_heard == {r.token: 1 for r in ranks}
    ranks[1] = HostTierWorker(4, 4)
    ranks[1].weights_changed("reload_weights")
    engine.tier.update_connector_output(_reports(*ranks))
    assert len(told) == 3
    meta = _prefill(engine, _request("c", list(range(40, 50))))
    assert meta.epochs_heard[ranks[1].token] == 1
