"""The plugin's policies inside vLLM's own CPU offloading (`native_policies.py`).

Everything goes through vLLM's real `CPUOffloadingManager`, built as vLLM's tests build
it (by policy name and module path) or by vLLM's `CPUOffloadingSpec` from the extra
config a user writes; requests are vLLM `ReqContext`s carrying their keys' positions, as
vLLM's scheduler sets them. vLLM's `OffloadingConnector` refuses a CPU platform when it
builds its worker, so the scheduler-side manager is as far as a CPU machine goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from vllm_cpu_offload import native_policies, native_policy_adapter
from vllm_cpu_offload.native_policies import EvictionPolicyAdapter
from vllm_cpu_offload.scheduler.policies.base import HostBlock

MODULE = "vllm_cpu_offload.native_policies"
OURS = [
    "PrefixAwareCachePolicy",
    "LRUCachePolicy",
    "ARCCachePolicy",
    "LIRSCachePolicy",
    "S3FIFOCachePolicy",
]
TOKENS_PER_CHUNK = 16


def make_manager(num_chunks: int, policy: str, module: str | None = MODULE):
    return CPUOffloadingManager(
        num_chunks=num_chunks,
        cache_policy=policy,
        cache_policy_module_path=module,
        enable_events=False,
        store_threshold=0,
        max_tracker_size=64_000,
    )


def adapter_of(manager: CPUOffloadingManager) -> EvictionPolicyAdapter:
    policy = manager._policy
    assert isinstance(policy, EvictionPolicyAdapter)
    return policy


def key(path: str) -> OffloadKey:
    """The key of the chunk that ends the prefix `path` ("S.A1": chunk A1 after S)."""
    return make_offload_key(path.encode(), 0)


@dataclass
class Request:
    """A request whose prompt is the chunks of `path`, with the positions vLLM's
    scheduler records for them."""

    path: str
    context: ReqContext = field(init=False)
    keys: list[OffloadKey] = field(init=False)

    def __post_init__(self) -> None:
        self.context = ReqContext(req_id=self.path)
        names = self.path.split(".")
        self.keys = [key(".".join(names[: i + 1])) for i in range(len(names))]
        for i, k in enumerate(self.keys):
            self.context.set_offload_key_position(k, (i + 1) * TOKENS_PER_CHUNK)


def store(manager: CPUOffloadingManager, req: Request, first: int = 0) -> list:
    """Stores the request's chunks from `first` on, to completion; the evicted keys."""
    out = manager.prepare_store(req.keys[first:], req.context)
    assert out is not None
    manager.complete_store(out.keys_to_store, req.context)
    return out.evicted_keys


def load(manager: CPUOffloadingManager, req: Request, first: int, end: int) -> None:
    """The request finds its chunks before `first` in the GPU cache and loads those
    from `first` to `end` from the host."""
    keys = req.keys[first:end]
    assert all(manager.lookup(k, req.context) is LookupResult.HIT for k in keys)
    manager.prepare_load(keys, req.context)
    manager.complete_load(keys, req.context)


# ----- the configuration a user writes -----


@pytest.mark.parametrize("name", OURS)
def test_vllms_spec_builds_the_policy_the_extra_config_names(name: str) -> None:
    # kv_connector_extra_config as in the docs: vLLM's CPU spec and its manager.
    extra = {
        "cpu_bytes_to_use": 64 << 20,
        "eviction_policy": name,
        "cache_policy_module_path": MODULE,
    }
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0",), 0),),
        worker_kv_bytes_per_block=1 << 16,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="engine",
        model=OffloadingModelConfig(name="tiny", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    policy = adapter_of(manager)
    assert type(policy) is getattr(native_policies, name)
    assert policy.cache_capacity == 1024  # 64 MiB of 64 KiB chunks
    assert policy.eviction_policy.name == policy.policy_name


# ----- scenarios -----


@pytest.mark.parametrize(
    ("baseline", "module"), [("lru", None), ("LRUCachePolicy", MODULE)]
)
def test_prefix_aware_keeps_a_parent_that_lru_evicts(
    baseline: str, module: str | None
) -> None:
    # S's GPU copy serves every request, so only S.A1 is read from the host: LRU lets
    # the host's S age and evicts it, leaving S.A1 that no hit can reach; prefix_aware
    # evicts the leaf S.A1 and keeps S.
    evicted = {}
    for policy, path in ((baseline, module), ("PrefixAwareCachePolicy", MODULE)):
        manager = make_manager(3, policy, path)
        a = Request("S.A1")
        store(manager, a)
        manager.on_request_finished(a.context)
        b = Request("S.A1")
        load(manager, b, first=1, end=2)
        manager.on_request_finished(b.context)
        evicted[policy] = store(manager, Request("C0.C1"))
    assert evicted[baseline] == [key("S")]
    assert evicted["PrefixAwareCachePolicy"] == [key("S.A1")]


def test_an_orphan_goes_before_older_blocks() -> None:
    # S's store fails after S.A1's began: S.A1 can hit only while S is in the GPU, so
    # prefix_aware evicts it first though it is the newest block; LRU evicts D0.
    evicted = {}
    for policy in ("PrefixAwareCachePolicy", "LRUCachePolicy"):
        manager = make_manager(3, policy)
        a = Request("S.A1")
        out = manager.prepare_store(a.keys, a.context)
        assert out is not None and out.keys_to_store == a.keys
        store(manager, Request("D0"))
        manager.complete_store([key("S")], a.context, success=False)
        manager.complete_store([key("S.A1")], a.context)
        adapter_of(manager).check_invariants()
        evicted[policy] = store(manager, Request("E0.E1"))
    assert evicted["PrefixAwareCachePolicy"] == [key("S.A1")]
    assert evicted["LRUCachePolicy"] == [key("D0")]


def test_a_parent_the_request_loaded_is_linked_by_its_end() -> None:
    # B loads S from the host and stores S.B1: vLLM 0.33 shows the load at once
    # (`on_request_access`), vLLM 0.32 only when B finishes.
    manager = make_manager(4, "PrefixAwareCachePolicy")
    store(manager, Request("S"))
    b = Request("S.B1")
    load(manager, b, first=0, end=1)
    store(manager, b, first=1)
    held = adapter_of(manager)._held
    linked_at_once = held[key("S.B1")].parent is held[key("S")]
    assert linked_at_once == native_policy_adapter._SEES_ACCESSES
    manager.on_request_finished(b.context)
    assert held[key("S.B1")].parent is held[key("S")]
    assert held[key("S")].num_children == 1
    adapter_of(manager).check_invariants()


@pytest.mark.parametrize("policy", OURS)
def test_a_store_can_evict_a_whole_chain(policy: str) -> None:
    # The host holds one chain; the next store needs both its blocks: leaf first,
    # then the parent the leaf leaves childless, in one call.
    manager = make_manager(2, policy)
    store(manager, Request("P0.P1"))
    evicted = store(manager, Request("Q0.Q1"))
    assert sorted(evicted) == sorted([key("P0"), key("P0.P1")])
    if policy == "PrefixAwareCachePolicy":
        assert evicted == [key("P0.P1"), key("P0")]
    adapter_of(manager).check_invariants()


@pytest.mark.parametrize("policy", OURS)
def test_blocks_being_loaded_are_never_evicted(policy: str) -> None:
    # X0 is the least recent and being loaded: the store evicts Z0 instead; with
    # every block being loaded or just stored, the next store fails and changes
    # nothing.
    manager = make_manager(2, policy)
    x, z = Request("X0"), Request("Z0")
    store(manager, x)
    store(manager, z)
    manager.prepare_load(x.keys, x.context)
    assert store(manager, Request("Y0")) == [key("Z0")]
    w = Request("W0")
    manager.prepare_load(Request("Y0").keys, w.context)
    assert manager.prepare_store(w.keys, w.context) is None
    assert manager.lookup(key("X0"), x.context) is LookupResult.HIT
    assert manager.lookup(key("Y0"), w.context) is LookupResult.HIT
    assert manager._num_evictable_cache_chunks == 0
    adapter_of(manager).check_invariants()
    manager.complete_load(x.keys, x.context)
    assert store(manager, w) == [key("X0")]
    adapter_of(manager).check_invariants()


@pytest.mark.parametrize("policy", OURS)
def test_a_store_never_evicts_the_keys_it_offers(policy: str) -> None:
    # P0 is the least recent, but the request offers it again with its new chunk.
    manager = make_manager(2, policy)
    store(manager, Request("P0"))
    store(manager, Request("Q0"))
    req = Request("P0.P1")
    assert store(manager, req) == [key("Q0")]
    assert manager.lookup(key("P0"), req.context) is LookupResult.HIT
    adapter_of(manager).check_invariants()


def test_a_failed_evict_puts_its_choices_back() -> None:
    # L0.L1 is being loaded, so prefix_aware keeps L0 (its parent) and has one block
    # to give (M0), where vLLM counts two: the store fails and changes nothing.
    manager = make_manager(3, "PrefixAwareCachePolicy")
    chain = Request("L0.L1")
    store(manager, chain)
    store(manager, Request("M0"))
    manager.prepare_load(chain.keys[1:], chain.context)
    big = Request("N0.N1")
    assert manager._num_evictable_cache_chunks == 2
    assert manager.prepare_store(big.keys, big.context) is None
    assert manager._num_evictable_cache_chunks == 2
    held = adapter_of(manager)._held
    assert sorted(held) == sorted([key("L0"), key("L0.L1"), key("M0")])
    assert held[key("L0.L1")].parent is held[key("L0")]
    adapter_of(manager).check_invariants()
    manager.complete_load(chain.keys[1:], chain.context)
    # All three are the policy's to give again.
    before = sorted(held)
    assert sorted(store(manager, Request("N0.N1.N2"))) == before
    adapter_of(manager).check_invariants()


def test_blocks_are_reused() -> None:
    # A block that left is the next insert's: no garbage for the cycle collector
    # (an unlisted block links to itself), however many chunks come and go.
    manager = make_manager(4, "PrefixAwareCachePolicy")
    seen: dict[int, object] = {}
    for i in range(20):
        store(manager, Request(f"T{i}.U{i}"))
        for block in adapter_of(manager)._held.values():
            seen[id(block)] = block
    assert len(seen) <= 4


def test_reset_forgets_every_block_and_request() -> None:
    manager = make_manager(2, "PrefixAwareCachePolicy")
    req = Request("R0.R1")
    store(manager, req)
    manager.reset_cache()
    assert manager.lookup(key("R0"), req.context) is LookupResult.MISS
    assert store(manager, Request("R0.R1")) == []
    adapter_of(manager).check_invariants()


# ----- a random life of the manager -----

# Chunks are paths over a small alphabet, so that requests share prefixes.
CHUNKS = 4
PATHS = st.lists(st.sampled_from("abcd"), min_size=1, max_size=5).map(".".join)


class ManagerMachine(RuleBasedStateMachine):
    """Random stores, completions (some failed), loads, touches, request ends and
    resets through vLLM's manager. Checked after every step: the adapter's invariants,
    vLLM's counters against the chunks, every chunk id held once; at every eviction:
    no victim was being loaded or stored, a store's own keys stay, and (prefix_aware)
    an orphan goes before any other block and no block goes while it has children.
    """

    policy = "PrefixAwareCachePolicy"
    chain_aware = True

    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(CHUNKS, self.policy)
        self.adapter = adapter_of(self.manager)
        self.requests: list[Request] = []
        self.stores: list[tuple[Request, list[OffloadKey]]] = []
        self.loads: list[tuple[Request, list[OffloadKey]]] = []
        self._watch_victims()

    def _watch_victims(self) -> None:
        policy = self.adapter.eviction_policy
        choose = policy.pop_victim

        def checked_pop_victim() -> HostBlock | None:
            victim = choose()
            if victim is not None and self.chain_aware:
                held = self.adapter._held.values()
                if any(b.orphan and b.evictable and b.owner is not None for b in held):
                    assert victim.orphan, f"{victim} went before an orphan"
                assert victim.orphan or victim.num_children == 0, (
                    f"{victim} went while it has children"
                )
            return victim

        policy.pop_victim = checked_pop_victim  # type: ignore[method-assign]

    @rule(path=PATHS)
    def new_request(self, path: str) -> None:
        self.requests.append(Request(path))

    @rule(path=PATHS, done=st.booleans())
    def serve(self, path: str, done: bool) -> None:
        # What vLLM's scheduler does for a new request: load the hit, store the rest;
        # `done`: the transfers finish and so does the request.
        req = Request(path)
        self.requests.append(req)
        hits = self._load_hits(req, 0)
        self._prepare_store(req, len(hits))
        if done:
            for jobs, complete in (
                (self.loads, self.manager.complete_load),
                (self.stores, self.manager.complete_store),
            ):
                if jobs and jobs[-1][0] is req:
                    complete(jobs.pop()[1], req.context)
            self.requests.remove(req)
            self.manager.on_request_finished(req.context)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def prepare_store(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.requests))
        self._prepare_store(req, data.draw(st.integers(0, len(req.keys) - 1)))

    def _prepare_store(self, req: Request, first: int) -> None:
        offered = req.keys[first:]
        if not offered:
            return
        loading = {k for _, keys in self.loads for k in keys}
        before = {k: self.manager.lookup(k, req.context) for k in self.adapter._held}
        out = self.manager.prepare_store(offered, req.context)
        if out is None:
            return
        for k in out.evicted_keys:
            assert k not in loading, f"{k!r} was evicted while being loaded"
            assert before[k] is LookupResult.HIT, f"{k!r} was evicted while storing"
            assert k not in offered
        if out.keys_to_store:
            self.stores.append((req, out.keys_to_store))

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        index = data.draw(st.integers(0, len(self.stores) - 1))
        req, keys = self.stores.pop(index)
        self.manager.complete_store(keys, req.context, success=success)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.requests))
        self._load_hits(req, data.draw(st.integers(0, len(req.keys) - 1)))

    def _load_hits(self, req: Request, first: int) -> list[OffloadKey]:
        hits = []
        for k in req.keys[first:]:
            if self.manager.lookup(k, req.context) is not LookupResult.HIT:
                break
            hits.append(k)
        if hits:
            self.manager.prepare_load(hits, req.context)
            self.loads.append((req, hits))
        return hits

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        req, keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.manager.complete_load(keys, req.context)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.requests))
        self.manager.touch(req.keys, req.context)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.requests))
        self.requests.remove(req)
        self.manager.on_request_finished(req.context)

    @rule(now=st.integers(0, 9))
    def reset(self, now: int) -> None:
        if now:
            return  # one draw in ten: a reset leaves little to evict
        # vLLM's scheduler drops the jobs in flight at a reset: none completes.
        self.manager.reset_cache()
        self.stores.clear()
        self.loads.clear()

    @invariant()
    def agrees_with_vllm(self) -> None:
        self.adapter.check_invariants()
        held = self.adapter._held
        chunks = [b.chunk for b in held.values()]
        ids = [c.chunk_id for c in chunks]
        assert len(set(ids)) == len(ids), "a chunk id is held twice"
        assert self.manager._get_num_free_chunks() + len(held) == CHUNKS
        evictable = sum(c.ref_cnt == 0 for c in chunks)
        assert self.manager._num_evictable_cache_chunks == evictable
        loading = {k for _, keys in self.loads for k in keys}
        assert all(k in held and held[k].chunk.ref_cnt > 0 for k in loading)


class LRUMachine(ManagerMachine):
    policy = "LRUCachePolicy"
    chain_aware = False


class ARCMachine(ManagerMachine):
    policy = "ARCCachePolicy"
    chain_aware = False


class LIRSMachine(ManagerMachine):
    policy = "LIRSCachePolicy"
    chain_aware = False


class S3FIFOMachine(ManagerMachine):
    policy = "S3FIFOCachePolicy"
    chain_aware = False


_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPrefixAwareManager = ManagerMachine.TestCase
TestPrefixAwareManager.settings = _SETTINGS
TestLRUManager = LRUMachine.TestCase
TestLRUManager.settings = _SETTINGS
TestARCManager = ARCMachine.TestCase
TestARCManager.settings = _SETTINGS
TestLIRSManager = LIRSMachine.TestCase
TestLIRSManager.settings = _SETTINGS
TestS3FIFOManager = S3FIFOMachine.TestCase
TestS3FIFOManager.settings = _SETTINGS
