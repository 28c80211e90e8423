"""vLLM's own Scheduler with our connector, driven by vLLM's connector test helpers.

The helpers come from vLLM 0.32.0's tests (`tests/v1/kv_connector/unit/utils.py` of its
source distribution, fetched by `scripts/fetch_vllm_sdist.sh`): `create_vllm_config`,
`create_scheduler`, `create_request`, `create_model_runner_output`,
`assert_scheduler_empty`. A scheduler-role connector (inside vLLM's Scheduler) and a
worker-role connector on CPU tensors are paired; each step the worker's report goes back
into the Scheduler.

The "forward pass" writes each computed token's id into its KV slot, and checks first
that every slot the step reads as already computed (device hit, host load, or earlier
step) holds its token's id. So a wrong load, a block freed too early or a stale host
block shows as a wrong value, whichever path brought it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

BLOCK_SIZE = 32
DEVICE_BLOCKS = 24
HOST_BLOCKS = 64
# The tiny model's KV heads: the shared tier stores one value per head, and cuts
# them from the layer's [blocks, heads, block size, 2 * head size] cache.
KV_HEADS = 2
PAGE_BYTES = BLOCK_SIZE * 2 * 4 * KV_HEADS  # one layer, head size 1, K and V, fp32


@pytest.fixture(scope="module")
def vllm_utils(vllm_sdist: Path) -> ModuleType:
    """The module tests/v1/kv_connector/unit/utils.py of vLLM, under another name (our
    tests package is also called `tests`)."""
    from tests.vllm_helpers.connector_test_utils import load_connector_test_utils

    return load_connector_test_utils(vllm_sdist)


class _KeptEvents:
    """A KV event publisher that keeps what it is given."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


class Engine:
    """vLLM's Scheduler (with our scheduler-role connector) and our worker-role
    connector."""

    def __init__(
        self,
        utils: ModuleType,
        model: str,
        remote_url: str | None = None,
        offload_block_size: int | None = None,
        kv_events: bool = False,
        async_load_tokens: int | None = None,
        swap_space_path: str | None = None,
        sliding_window: int | None = None,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )

        from vllm_cpu_offload.connector import CPUOffloadConnector

        self.utils = utils
        self.config = config = utils.create_vllm_config(
            model=model,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=256,
            max_model_len=1024,
            kv_connector="CPUOffloadConnector",
            kv_connector_module_path="vllm_cpu_offload.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                # HOST_BLOCKS host blocks: a block id's page in every group's layer
                "swap_space_gib": HOST_BLOCKS
                * PAGE_BYTES
                * (1 if sliding_window is None else 2)
                / (1 << 30),
                **({"remote_url": remote_url} if remote_url else {}),
                **(
                    {"offload_block_size": offload_block_size}
                    if offload_block_size
                    else {}
                ),
                **(
                    {"async_load_tokens": async_load_tokens}
                    if async_load_tokens is not None
                    else {}
                ),
                **({"swap_space_path": swap_space_path} if swap_space_path else {}),
            },
            kv_load_failure_policy="recompute",
        )
        if kv_events:
            from vllm.config import KVEventsConfig

            config.kv_events_config = KVEventsConfig(
                enable_kv_cache_events=True, publisher="null"
            )
        assert config.model_config.get_total_num_kv_heads() == KV_HEADS
        attn: dict[str, Any] = dict(
            block_size=BLOCK_SIZE,
            num_kv_heads=KV_HEADS,
            head_size=1,
            dtype=torch.float32,
        )
        groups = [KVCacheGroupSpec(["layer"], FullAttentionSpec(**attn))]
        # With a window: vLLM's hybrid manager, a full and a sliding-window group, whose
        # layers share one tensor (a block id belongs to one group at a time).
        self.window = sliding_window
        if sliding_window is not None:
            swa = SlidingWindowSpec(sliding_window=sliding_window, **attn)
            groups.append(KVCacheGroupSpec(["window_layer"], swa))
        kv_config = KVCacheConfig(
            num_blocks=DEVICE_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
        )
        # The worker first, as vLLM's engine core starts them: a persistent tier's
        # index then names the worker's data file.
        # vLLM's CPU layout of one layer: [blocks, kv heads, block size, 2 * head size].
        self.kv = torch.full((DEVICE_BLOCKS, KV_HEADS, BLOCK_SIZE, 2), -1.0)
        self.worker = CPUOffloadConnector(config, KVConnectorRole.WORKER, kv_config)
        self.worker.register_kv_caches({g.layer_names[0]: self.kv for g in groups})
        self.scheduler = utils.create_scheduler(
            config, num_blocks=DEVICE_BLOCKS, kv_cache_config=kv_config
        )
        self.tier = self.scheduler.connector.scheduler
        # The KV events vLLM's Scheduler publishes, kept here instead.
        self.events: list[Any] = []
        if kv_events:
            self.scheduler.kv_event_publisher = _KeptEvents(self.events)
        self.checked_slots = 0
        self.invalid_blocks = 0
        # Added to every value the forward writes: other weights, other KV.
        self.weights = 0.0
        self.failed_loads = 0  # requests whose load vLLM was told failed whole

    def _forward(self, num_scheduled: dict[str, int]) -> set[int]:
        """Checks the slots read as computed, writes the computed ones; returns the
        device blocks whose slots were wrong. A window group reads only the window
        before the first token it computes (a null block there is wrong too)."""
        manager = self.scheduler.kv_cache_manager
        wrong: set[int] = set()
        for req_id, count in num_scheduled.items():
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens - count  # schedule() already advanced it
            tokens = request.all_token_ids
            for group, block_ids in enumerate(manager.get_block_ids(req_id)):
                start = 0
                if group > 0 and self.window is not None:
                    start = max(0, done - self.window + 1)
                for pos in range(start, done + count):
                    block = block_ids[pos // BLOCK_SIZE]
                    slot = self.kv[block, :, pos % BLOCK_SIZE]  # every head
                    value = float(tokens[pos]) + self.weights
                    if pos >= done:
                        slot.fill_(value)
                    elif bool((slot != value).any()):
                        wrong.add(block)
                    else:
                        self.checked_slots += 1
        return wrong

    def shutdown(self) -> None:
        """Both halves, as vLLM shuts an engine down (a persistent tier closes its
        index)."""
        self.worker.shutdown()
        self.scheduler.connector.shutdown()

    def step(self) -> Any:
        out = self.scheduler.schedule()
        self.last_scheduled_tokens = out.total_num_scheduled_tokens
        self.last_scheduled = dict(out.num_scheduled_tokens)
        meta = out.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        self.worker.wait_for_layer_load("layer")
        wrong = self._forward(out.num_scheduled_tokens)
        self.worker.save_kv_layer("layer", self.kv, None)  # type: ignore[arg-type]
        self.worker.wait_for_save()
        # As vLLM's model runner asks: finished transfers and failed loads, then
        # blocks that failed to load.
        results = self.worker.get_transfer_results(set(out.finished_req_ids))
        invalid = self.worker.get_block_ids_with_load_errors()
        # Only blocks whose load failed may be wrong; vLLM discards this step's output
        # for their requests and recomputes them.
        assert wrong <= invalid, f"wrong KV in device blocks {sorted(wrong - invalid)}"
        self.invalid_blocks += len(invalid)
        report = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        requests = [self.scheduler.requests[r] for r in out.num_scheduled_tokens]
        output = self.utils.create_model_runner_output(
            requests,
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            invalid_block_ids=invalid or None,
            kv_connector_worker_meta=report,
        )
        if results.failed_recving:
            output.kv_connector_output.failed_recving = results.failed_recving
            self.failed_loads += len(results.failed_recving)
        return self.scheduler.update_from_output(out, output)

    def step_until_one_computes(self) -> None:
        """Steps until a step schedules tokens (none do while a request waits for the
        store's fetch)."""
        deadline = time.monotonic() + 120
        self.step()
        while not self.last_scheduled_tokens:
            assert time.monotonic() < deadline, "nothing was scheduled"
            time.sleep(0.001)
            self.step()

    def run(self, *requests: Any, max_steps: int = 400) -> None:
        for request in requests:
            self.scheduler.add_request(request)
        steps = 0
        deadline = time.monotonic() + 120
        while self.scheduler.has_requests():
            self.step()
            # Steps that schedule nothing (a request waits for the shared store's
            # fetch, on the worker's store thread) do not count, and yield the core.
            if self.last_scheduled_tokens:
                steps += 1
            else:
                time.sleep(0.001)
            assert steps < max_steps and time.monotonic() < deadline, (
                "requests did not finish"
            )

    def request(self, seed: int, num_tokens: int, max_tokens: int = 8) -> Any:
        request = self.utils.create_request(
            request_id=seed,
            num_tokens=num_tokens,
            max_tokens=max_tokens,
            block_size=BLOCK_SIZE,
        )
        return request


@pytest.fixture
def engine(vllm_utils: ModuleType, tiny_model: str) -> Iterator[Engine]:
    engine = Engine(vllm_utils, tiny_model)
    yield engine
    engine.worker.shutdown()


def _assert_drained(engine: Engine) -> None:
    engine.utils.assert_scheduler_empty(engine.scheduler)
    assert engine.tier.num_jobs_in_flight == 0
    assert engine.tier.pool.num_pinned == 0 and engine.tier.pool.num_storing == 0


def test_lifecycle_drains_the_scheduler_empty(engine: Engine) -> None:
    # Requests prefill, decode past block boundaries (stores) and finish: nothing leaks.
    engine.run(
        *(engine.request(i, 3 * BLOCK_SIZE + 5, max_tokens=40) for i in range(1, 4))
    )
    _assert_drained(engine)
    assert engine.tier.stats.stored_blocks >= 3 * 4


def test_evicted_prefix_comes_back_from_the_host_tier(engine: Engine) -> None:
    # A's blocks are flushed from the 24-block device cache by B..F; A again loads them
    # from host, and every loaded slot holds the right token.
    engine.run(engine.request(1, 5 * BLOCK_SIZE + 3))
    for seed in (2, 3, 4, 5, 6):
        engine.run(engine.request(seed, 6 * BLOCK_SIZE))
    loaded, checked = engine.tier.stats.loaded_blocks, engine.checked_slots
    again = engine.request(1, 5 * BLOCK_SIZE + 3)
    engine.run(again)
    assert engine.tier.stats.loaded_blocks - loaded == 5
    assert engine.checked_slots - checked >= 5 * BLOCK_SIZE
    _assert_drained(engine)


def test_a_prompt_ending_on_a_block_boundary_computes_only_its_last_token(
    engine: Engine,
) -> None:
    # The host hit covers the prompt's last block but one token: vLLM schedules one
    # token, and every slot it reads, those of the last block included, is right.
    engine.run(engine.request(1, 6 * BLOCK_SIZE))
    for seed in (2, 3, 4, 5, 6):
        engine.run(engine.request(seed, 6 * BLOCK_SIZE))
    hits, checked = engine.tier.stats.hit_tokens, engine.checked_slots
    again = engine.request(1, 6 * BLOCK_SIZE)
    engine.scheduler.add_request(again)
    engine.step()
    assert engine.last_scheduled_tokens == 1
    engine.run()
    assert engine.tier.stats.hit_tokens - hits == 6 * BLOCK_SIZE - 1
    assert engine.checked_slots - checked >= 6 * BLOCK_SIZE - 1
    assert engine.invalid_blocks == 0 and len(again.output_token_ids) == 8
    _assert_drained(engine)


def test_a_large_host_hit_loads_across_steps_while_another_request_decodes(
    vllm_utils: ModuleType, tiny_model: str
) -> None:
    # A host hit of async_load_tokens or more waits in vLLM's waiting-for-remote-KV
    # state: the step that loads it schedules the other request's decode and not it;
    # it computes from the next step on, and every slot it reads holds its token.
    from vllm.v1.request import RequestStatus

    engine = Engine(vllm_utils, tiny_model, async_load_tokens=4 * BLOCK_SIZE)
    try:
        engine.run(engine.request(1, 5 * BLOCK_SIZE + 3))
        for seed in (2, 3, 4, 5, 6):
            engine.run(engine.request(seed, 6 * BLOCK_SIZE))
        decoding = engine.request(9, BLOCK_SIZE + 3, max_tokens=30)
        engine.scheduler.add_request(decoding)
        engine.step()
        hits, checked = engine.tier.stats.hit_tokens, engine.checked_slots
        again = engine.request(1, 5 * BLOCK_SIZE + 3)
        engine.scheduler.add_request(again)
        engine.step()
        assert engine.last_scheduled == {decoding.request_id: 1}
        assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        engine.step()
        assert engine.last_scheduled == {decoding.request_id: 1, again.request_id: 3}
        engine.run()
        assert engine.tier.stats.hit_tokens - hits == 5 * BLOCK_SIZE
        assert engine.checked_slots - checked >= 5 * BLOCK_SIZE
        assert engine.invalid_blocks == 0 and len(again.output_token_ids) == 8
        assert len(decoding.output_token_ids) == 30
        _assert_drained(engine)
    finally:
        engine.worker.shutdown()


def test_failed_loads_are_recomputed_through_vllms_invalid_blocks(
    engine: Engine,
) -> None:
    # Stores succeed, then every load fails on the worker (a test's fault
    # injector): vLLM's invalid-block path recomputes the blocks and the request
    # finishes with right KV.
    from tests.fault_injection import FaultInjector

    engine.run(engine.request(1, 5 * BLOCK_SIZE + 3))
    for seed in (2, 3, 4, 5, 6):
        engine.run(engine.request(seed, 6 * BLOCK_SIZE))
    assert engine.worker.worker is not None
    engine.worker.worker.faults = FaultInjector(1.0)
    again = engine.request(1, 5 * BLOCK_SIZE + 3)
    engine.run(again)
    assert engine.tier.stats.failed_loads == 1 and engine.invalid_blocks == 5
    assert len(again.output_token_ids) == 8
    _assert_drained(engine)


def test_blocks_a_failed_load_left_unfilled_are_no_device_hit_later(
    engine: Engine,
) -> None:
    # A load fails and its request is aborted before it recomputes the blocks (as a
    # preemption would): vLLM's recompute policy keeps them in its prefix cache, so
    # the connector drops them there. The same prompt again must not read them as a
    # device hit (the forward checks every slot it reads).
    from vllm.v1.request import RequestStatus

    from tests.fault_injection import FaultInjector

    engine.run(engine.request(1, 5 * BLOCK_SIZE + 3))
    for seed in (2, 3, 4, 5, 6):
        engine.run(engine.request(seed, 6 * BLOCK_SIZE))
    assert engine.worker.worker is not None
    engine.worker.worker.faults = FaultInjector(1.0)
    failed = engine.request(1, 5 * BLOCK_SIZE + 3)
    engine.scheduler.add_request(failed)
    engine.step()
    assert engine.invalid_blocks == 5
    engine.scheduler.finish_requests(failed.request_id, RequestStatus.FINISHED_ABORTED)
    engine.worker.worker.faults = None
    again = engine.request(1, 5 * BLOCK_SIZE + 3)
    engine.run(again)  # raises on a wrong slot
    assert len(again.output_token_ids) == 8
    _assert_drained(engine)


def test_preemption_under_pressure_keeps_every_slot_right(engine: Engine) -> None:
    # Five requests whose decodes outgrow the device cache: vLLM preempts and resumes
    # them (resumed ones may load their stored blocks back); every request finishes.
    requests = [
        engine.request(10 + i, 3 * BLOCK_SIZE + 5, max_tokens=120) for i in range(5)
    ]
    engine.run(*requests, max_steps=2000)
    assert engine.tier.stats.preempted_requests > 0, "the scenario did not preempt"
    assert all(len(r.output_token_ids) == 120 for r in requests)
    _assert_drained(engine)


def test_sleep_sequence_empties_the_tier_and_keeps_every_slot_right(
    engine: Engine,
) -> None:
    # vLLM 0.33's sleep (levels 1-2): pause and reset the prefix cache with the
    # connector's (scheduler side), unregister_kv_caches (worker), the KV memory is
    # released (its contents are gone), then restore_kv_caches on wake-up. The host tier
    # must be empty afterwards (its blocks may belong to replaced weights), and a
    # re-read recomputes rather than loads.
    engine.run(engine.request(1, 5 * BLOCK_SIZE + 3))
    for seed in (2, 3, 4, 5, 6):
        engine.run(engine.request(seed, 6 * BLOCK_SIZE))
    assert len(engine.tier.pool) > 0
    assert engine.scheduler.reset_prefix_cache(
        reset_running_requests=True, reset_connector=True
    )
    engine.worker.unregister_kv_caches()
    engine.kv.fill_(-1.0)  # what the device memory holds after wake-up is undefined
    engine.worker.restore_kv_caches()
    assert len(engine.tier.pool) == 0
    loaded, stored = engine.tier.stats.loaded_blocks, engine.tier.stats.stored_blocks
    engine.run(engine.request(1, 5 * BLOCK_SIZE + 3))
    assert engine.tier.stats.loaded_blocks == loaded  # recomputed, checked slot by slot
    assert engine.tier.stats.stored_blocks > stored  # and the tier fills again
    _assert_drained(engine)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    # The test servers ship with the plugin's testing package (beside the tests in
    # tree); where redis-server or redis-py is missing, the shared-tier scenarios skip.
    servers = pytest.importorskip("vllm_cpu_offload.testing.store_servers")
    try:
        server = servers.RedisServer().start()
    except servers.ServerUnavailable as e:
        pytest.skip(str(e))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(params=[None, 2 * BLOCK_SIZE], ids=["k1", "k2"])
def engines(
    vllm_utils: ModuleType,
    tiny_model: str,
    redis_url: str,
    request: pytest.FixtureRequest,
) -> Iterator[tuple[Engine, Engine]]:
    # Two engines on one store, each with its own (empty) device cache and host tier;
    # host blocks of one device block, and of two.
    pair = (
        Engine(vllm_utils, tiny_model, redis_url, request.param),
        Engine(vllm_utils, tiny_model, redis_url, request.param),
    )
    yield pair
    for engine in pair:
        engine.worker.shutdown()


def _written_through(engine: Engine) -> None:
    """Waits until the worker's writes are done, then runs one step, which carries
    their reports to the scheduler (an idle engine runs none): the written blocks are
    evictable again."""
    assert engine.worker.worker is not None
    io = engine.worker.worker.shared.remote_io
    assert io is not None and io.wait_idle(60)
    engine.step()


def test_a_prefix_another_engine_computed_comes_from_the_shared_store(
    engines: tuple[Engine, Engine],
) -> None:
    # A computes and writes through; B loads the prefix from the store across steps
    # (vLLM's waiting-for-remote-KV state), and every loaded slot holds its token.
    a, b = engines
    a.run(a.request(1, 6 * BLOCK_SIZE + 3))
    _written_through(a)
    checked = b.checked_slots
    request = b.request(1, 6 * BLOCK_SIZE + 3)
    b.run(request)
    assert b.tier.stats.remote_hit_tokens == 6 * BLOCK_SIZE
    assert b.checked_slots - checked >= 6 * BLOCK_SIZE
    assert b.invalid_blocks == 0 and len(request.output_token_ids) == 8
    # The fetched blocks are B's host blocks now.
    assert b.tier.stats.remote_fetched_blocks == 6 // b.tier.blocks_per_host_block
    for engine in engines:
        _written_through(engine)
        _assert_drained(engine)


def test_a_prompt_ending_on_a_block_boundary_is_fetched_whole(
    engines: tuple[Engine, Engine],
) -> None:
    # From the store too, the hit covers the last block but one token: the fetch
    # brings every block, and the first step that computes schedules one token.
    a, b = engines
    a.run(a.request(1, 6 * BLOCK_SIZE))
    _written_through(a)
    checked = b.checked_slots
    request = b.request(1, 6 * BLOCK_SIZE)
    b.scheduler.add_request(request)
    b.step_until_one_computes()
    assert b.last_scheduled_tokens == 1
    b.run()
    assert b.tier.stats.remote_hit_tokens == 6 * BLOCK_SIZE - 1
    assert b.checked_slots - checked >= 6 * BLOCK_SIZE - 1
    assert b.invalid_blocks == 0 and len(request.output_token_ids) == 8
    for engine in engines:
        _written_through(engine)
        _assert_drained(engine)


def test_a_request_aborted_while_it_waits_for_the_store_frees_everything(
    engines: tuple[Engine, Engine],
) -> None:
    from vllm.v1.request import RequestStatus

    a, b = engines
    a.run(a.request(2, 5 * BLOCK_SIZE + 3))
    _written_through(a)
    request = b.request(2, 5 * BLOCK_SIZE + 3)
    b.scheduler.add_request(request)
    b.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    b.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    deadline = time.monotonic() + 60
    # The fetch may end in the first step or a later one; the step after the one that
    # frees the request clears the scheduler's finished ids.
    while (
        b.scheduler.requests
        or b.tier.num_jobs_in_flight
        or b.scheduler.finished_req_ids
    ):
        b.step()
        time.sleep(0.001)
        assert time.monotonic() < deadline, "the aborted request was never freed"
    _assert_drained(b)


def test_kv_events_say_what_the_shared_store_holds_and_what_it_lacks(
    vllm_utils: ModuleType, tiny_model: str, redis_url: str
) -> None:
    # A's blocks, once written through, are announced with medium STORAGE and locality
    # REMOTE, with what the host tier's events for them say. Torn in the store, B's
    # fetch refuses them: B announces them removed from the store.
    import redis
    from vllm.distributed.kv_events import (
        MEDIUM_CPU,
        MEDIUM_STORAGE,
        BlockRemoved,
        BlockStored,
    )

    from vllm_cpu_offload.remote.namespace import shard_key

    def per_block(events: list[Any], medium: str) -> dict[Any, tuple]:
        blocks = {}
        for e in events:
            if not isinstance(e, BlockStored) or e.medium != medium:
                continue
            parent = e.parent_block_hash
            for i, block_hash in enumerate(e.block_hashes):
                tokens = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
                blocks[block_hash] = (parent, tuple(tokens), e.locality, e.group_idx)
                parent = block_hash
        return blocks

    a, b = (Engine(vllm_utils, tiny_model, redis_url, kv_events=True) for _ in range(2))
    prompt_tokens = 6 * BLOCK_SIZE + 3
    a.run(a.request(7, prompt_tokens))
    _written_through(a)
    host = per_block(a.events, MEDIUM_CPU)
    remote = per_block(a.events, MEDIUM_STORAGE)
    assert len(host) == 6 and remote.keys() == host.keys()
    assert all(
        remote[h] == (*host[h][:2], "REMOTE", host[h][3]) and host[h][2] is None
        for h in host
    ), (host, remote)

    assert a.worker.worker is not None
    io = a.worker.worker.shared.remote_io
    assert io is not None
    rank = io.values.names[0]  # a value of the block: a miss needs one torn
    request = b.request(7, prompt_tokens)
    torn = redis.Redis.from_url(redis_url)
    for block_hash in request.block_hashes[:6]:
        key = shard_key(a.tier.shared.remote_key((0, block_hash)), rank)
        assert torn.set(key, b"torn")
    torn.close()
    b.run(request)
    assert b.tier.stats.remote_missed_blocks == 6
    removed = [
        h
        for e in b.events
        if isinstance(e, BlockRemoved) and e.medium == MEDIUM_STORAGE
        for h in e.block_hashes
    ]
    assert sorted(removed) == sorted(host) and len(request.output_token_ids) == 8
    assert all(
        e.locality == "REMOTE"
        for e in b.events
        if isinstance(e, BlockRemoved) and e.medium == MEDIUM_STORAGE
    )
    for engine in (a, b):
        _written_through(engine)
        _assert_drained(engine)
        engine.worker.shutdown()


def test_a_persistent_host_tier_in_front_of_the_shared_store_survives_a_restart(
    vllm_utils: ModuleType, tiny_model: str, redis_url: str, tmp_path: Path
) -> None:
    # --swap-space-path with --swap-space-remote: A computes one prefix and fetches
    # another that B computed; after A's restart on its tier directory, both are host
    # hits (none is fetched again), and every slot they fill is right.
    tiers = {name: tmp_path / name for name in ("a", "b")}
    for tier in tiers.values():
        tier.mkdir(mode=0o700)

    def start(name: str) -> Engine:
        return Engine(
            vllm_utils, tiny_model, redis_url, swap_space_path=str(tiers[name])
        )

    a, b = start("a"), start("b")
    a.run(a.request(11, 6 * BLOCK_SIZE + 3))
    b.run(b.request(12, 5 * BLOCK_SIZE + 3))
    _written_through(b)
    a.run(a.request(12, 5 * BLOCK_SIZE + 3))
    assert a.tier.stats.remote_hit_tokens == 5 * BLOCK_SIZE
    for engine in (a, b):
        _written_through(engine)
        _assert_drained(engine)
        engine.shutdown()

    again = start("a")
    try:
        assert len(again.tier.pool) == 11
        for seed, blocks in ((11, 6), (12, 5)):
            again.run(again.request(seed, blocks * BLOCK_SIZE + 3))
        assert again.tier.stats.hit_tokens == 11 * BLOCK_SIZE
        assert again.tier.stats.remote_hit_tokens == 0
        assert again.checked_slots >= 11 * BLOCK_SIZE and again.invalid_blocks == 0
        _written_through(again)
        _assert_drained(again)
    finally:
        again.shutdown()


def _reload_weights(engine: Engine) -> None:
    """vLLM's `Worker.reload_weights` on the engine's worker process (the model
    runner's reload itself left out), as `collective_rpc("reload_weights")` runs it."""
    from vllm.v1.worker.gpu_worker import Worker

    runner = SimpleNamespace(reload_weights=lambda *args, **kwargs: None)
    worker = SimpleNamespace(vllm_config=engine.config, model_runner=runner)
    Worker.reload_weights(worker)  # type: ignore[arg-type]


@pytest.mark.parametrize("async_load_tokens", [0, BLOCK_SIZE])
def test_after_a_prefix_cache_reset_and_a_reload_no_kv_of_the_old_weights_is_read(
    vllm_utils: ModuleType, tiny_model: str, async_load_tokens: int
) -> None:
    # A caller resets vLLM's prefix cache alone (no reset_connector), then reloads the
    # weights: vLLM serves none of the old KV from then on, and neither does the host
    # tier. The first step after the reload was planned before the scheduler half
    # heard of it: its host loads (in the step, or across steps) are refused and
    # recomputed; once it has heard, the host tier holds nothing of before.
    engine = Engine(vllm_utils, tiny_model, async_load_tokens=async_load_tokens)
    prompt = 5 * BLOCK_SIZE + 3
    engine.run(engine.request(1, prompt))
    _assert_drained(engine)
    assert len(engine.tier.pool) == 5
    assert engine.scheduler.reset_prefix_cache()
    _reload_weights(engine)
    engine.weights = 1000.0  # what the new weights compute
    engine.run(engine.request(1, prompt))  # a wrong slot read fails `step`
    assert engine.tier.stats.failed_loads == 1
    assert engine.invalid_blocks + engine.failed_loads * 5 >= 5
    # The recomputed blocks are stored anew, and read back right.
    assert engine.scheduler.reset_prefix_cache()
    checked, loaded = engine.checked_slots, engine.tier.stats.loaded_blocks
    engine.run(engine.request(1, prompt))
    assert engine.tier.stats.loaded_blocks - loaded == 5
    assert engine.checked_slots - checked >= 5 * BLOCK_SIZE
    assert engine.tier.stats.failed_loads == 1
    _assert_drained(engine)
    engine.shutdown()


@pytest.mark.parametrize("sign", ["reset_cache", "reload_weights"])
def test_weights_changed_at_run_time_are_neither_shared_nor_kept(
    vllm_utils: ModuleType,
    tiny_model: str,
    redis_url: str,
    tmp_path: Path,
    sign: str,
) -> None:
    # A's weights are replaced while it runs: vLLM resets the connector's cache first
    # (pause_generation(clear_cache=True)), or a worker's reload_weights tells the
    # worker half (runtime_weights.py). From then on A reads nothing the store holds
    # (computed with the weights it started with), writes nothing B would read, and
    # its file tier restores nothing at A's next start.
    tier = tmp_path / "a"
    tier.mkdir(mode=0o700)
    a = Engine(vllm_utils, tiny_model, redis_url, swap_space_path=str(tier))
    b = Engine(vllm_utils, tiny_model, redis_url)
    prompt = 4 * BLOCK_SIZE + 3
    # Prompts of this case alone: the store outlives each case.
    first = 31 if sign == "reset_cache" else 41
    b.run(b.request(first, prompt))
    a.run(a.request(first + 1, prompt))
    for engine in (a, b):
        _written_through(engine)
    if sign == "reset_cache":
        assert a.scheduler.reset_prefix_cache(reset_connector=True)
    else:
        assert a.worker.worker is not None
        a.worker.worker.weights_changed("reload_weights")
    a.run(a.request(first + 2, prompt))
    _written_through(a)
    a.run(a.request(first, prompt))
    assert a.tier.stats.remote_hit_tokens == 0
    assert a.tier.stats.remote_fetched_blocks == 0
    b.run(b.request(first + 2, prompt))
    assert b.tier.stats.remote_hit_tokens == 0
    for engine in (a, b):
        _written_through(engine)
        _assert_drained(engine)
        engine.shutdown()
    again = Engine(vllm_utils, tiny_model, swap_space_path=str(tier))
    try:
        assert len(again.tier.pool) == 0
    finally:
        again.shutdown()
