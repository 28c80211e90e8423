"""`prefix_aware`'s admission served to vLLM's own `CPUOffloadingManager` through
`CachePolicy.admit` (the series' [3/8]), and its decisions the same in every process.

On vLLM without the hook (0.32, unpatched 0.33) the manager never calls `admit`: the
tests of the hook's effect skip there, and the adapter's answer is checked directly.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

from tests.unit.test_native_policies import (
    MODULE,
    TOKENS_PER_CHUNK,
    Request,
    adapter_of,
    store,
)
from vllm_cpu_offload.scheduler.policies.admission_duel import GUARDING
from vllm_cpu_offload.scheduler.policies.base import HostBlock
from vllm_cpu_offload.scheduler.policies.prefix_aware import PrefixAwarePolicy

HAS_ADMIT = hasattr(CachePolicy, "admit")


def prefix_aware_manager(num_chunks: int, **settings: float) -> CPUOffloadingManager:
    kwargs = {"cache_policy_kwargs": settings} if settings else {}
    return CPUOffloadingManager(
        num_chunks=num_chunks,
        cache_policy="PrefixAwareCachePolicy",
        cache_policy_module_path=MODULE,
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_guarding_policy_admits_only_what_fits_the_free_chunks() -> None:
    # A full pool that guards refuses a first-sight key, and with it the rest.
    manager = prefix_aware_manager(4)
    store(manager, Request("S.A1.A2"))
    adapter = adapter_of(manager)
    policy = adapter.eviction_policy
    assert isinstance(policy, PrefixAwarePolicy)
    policy._duel.mode = GUARDING
    newcomer = Request("T.B1.B2")
    assert adapter.admit(newcomer.keys, newcomer.context) == 1  # one chunk free
    store(manager, Request("U"))
    policy._duel.mode = GUARDING
    assert adapter.admit(newcomer.keys, newcomer.context) == 0


def loop_host_hits(manager: CPUOffloadingManager, num_docs: int, chunks: int) -> int:
    """Host hits of a loop of `num_docs` documents read three times, in order, with no
    device cache in front: each read hits the host run of its document's head."""
    docs = [
        Request(".".join(f"d{d}c{c}" for c in range(chunks))) for d in range(num_docs)
    ]
    hits = 0
    for rnd in range(3):
        for doc in docs:
            ctx = ReqContext(req_id=f"{rnd}-{doc.path}")
            for position, k in enumerate(doc.keys, start=1):
                ctx.set_offload_key_position(k, position * TOKENS_PER_CHUNK)
            manager.on_new_request(ctx)
            run = 0
            while run < chunks and manager.lookup(doc.keys[run], ctx) is (
                LookupResult.HIT
            ):
                run += 1
            if run:
                manager.prepare_load(doc.keys[:run], ctx)
                manager.complete_load(doc.keys[:run], ctx)
            out = manager.prepare_store(doc.keys, ctx)
            if out is not None:
                manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
            hits += run
    return hits


@pytest.mark.skipif(not HAS_ADMIT, reason="needs vLLM with CachePolicy.admit ([3/8])")
def test_admission_through_vllms_hook_keeps_part_of_a_loop() -> None:
    # A loop of 3x the tier: LRU (and prefix_aware without admission) churns through
    # it and hits nothing; prefix_aware admitting through vLLM's hook keeps a part.
    lru = CPUOffloadingManager(num_chunks=1024, cache_policy="lru")
    assert loop_host_hits(lru, 96, 32) == 0
    ours = prefix_aware_manager(1024)
    assert loop_host_hits(ours, 96, 32) > 1024


@pytest.mark.skipif(not HAS_ADMIT, reason="needs vLLM with cache_policy_kwargs ([3/8])")
def test_vllm_passes_the_policy_its_settings() -> None:
    manager = prefix_aware_manager(64, protected_fraction=0.25)
    policy = adapter_of(manager).eviction_policy
    assert isinstance(policy, PrefixAwarePolicy)
    assert policy._protected_cap == 16
    manager.reset_cache()  # a reset keeps them
    policy = adapter_of(manager).eviction_policy
    assert isinstance(policy, PrefixAwarePolicy) and policy._protected_cap == 16


@pytest.mark.skipif(HAS_ADMIT, reason="vLLM asks CachePolicy.admit here")
def test_without_the_hook_every_store_is_admitted() -> None:
    manager = prefix_aware_manager(1024)
    assert loop_host_hits(manager, 96, 32) < 32  # less than one document


def duel_sample() -> list[int]:
    """The blocks of 4,096 that prefix_aware's duel samples, keyed as the plugin's
    pool keys them, (group, block hash)."""
    policy = PrefixAwarePolicy(4096)
    sampled = []
    for i in range(4096):
        block = HostBlock(i)
        block.key = (0, f"block {i}".encode())
        policy.on_insert([block])
        if block.in_duel_sample:
            sampled.append(i)
    return sampled


def test_the_sample_is_the_same_in_every_process() -> None:
    # prefix_aware decides by the keys its duel samples; Python salts hash() of bytes
    # per process, so a sample by hash() would differ in every run.
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    code = "from tests.unit.test_native_admission import duel_sample as s; print(s())"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, check=True, timeout=120,
        env={**os.environ, "PYTHONHASHSEED": seed},
    )  # fmt: skip
    here = duel_sample()
    assert 0 < len(here) < 4096
    assert proc.stdout.strip() == str(here)
