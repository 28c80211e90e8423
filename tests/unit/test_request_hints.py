"""Per-request hints: parsed from `kv_transfer_params` (a bad one is a warning), and
what each does to the host tier: `max_offload_tokens` caps the stores, `retain` keeps a
prefix from eviction within a fair, bounded share until read or expired, `done` makes a
session's blocks go first."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest

from vllm_cpu_offload.scheduler.block_pool import BlockState, HostBlockPool
from vllm_cpu_offload.scheduler.policies.registry import make_policy
from vllm_cpu_offload.scheduler.request_hints import (
    DEFAULT_RETAIN_S,
    NO_HINTS,
    RequestHints,
    hints_of,
)
from vllm_cpu_offload.scheduler.retention import Retention
from vllm_cpu_offload.scheduler.tier_stats import TierStats


def _hints(params: Any, max_retain_s: float = 600.0) -> RequestHints:
    request = types.SimpleNamespace(request_id="r1", kv_transfer_params=params)
    return hints_of(request, max_retain_s=max_retain_s)


# ---- parsing ----


def test_hints_are_read_from_kv_transfer_params() -> None:
    assert _hints(None) == NO_HINTS and not NO_HINTS.any
    assert _hints({"max_offload_tokens": 0}) == RequestHints(max_offload_tokens=0)
    assert _hints({"retain": 30}) == RequestHints(retain_s=30.0)
    assert _hints({"retain": True}).retain_s == DEFAULT_RETAIN_S
    assert _hints({"retain": 1e9}, max_retain_s=60).retain_s == 60
    assert _hints({"done": True}) == RequestHints(done=True)
    # Other connectors' parameters are theirs: no hint, no warning.
    assert _hints({"do_remote_prefill": True}) == NO_HINTS


def test_a_bad_hint_is_ignored_with_one_warning_naming_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    params = {"max_offload_tokens": -1, "retain": "soon", "done": "yes"}
    with caplog.at_level(logging.WARNING):
        assert _hints(params) == NO_HINTS
        assert _hints({"retain": 20, "max_offload_tokens": 1.5}).retain_s == 20
    first, second = (r.getMessage() for r in caplog.records)
    assert "r1" in first and "max_offload_tokens=-1" in first
    assert "retain='soon'" in first and "done='yes'" in first
    assert "max_offload_tokens=1.5" in second


def test_a_huge_infinite_or_nan_hint_is_capped_or_ignored_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Past the cap, however far (an int no float can hold, infinity), `retain` is the
    # cap; NaN is no number of seconds; a cap on stores past any request caps nothing.
    assert _hints({"retain": 10**400}, max_retain_s=60).retain_s == 60.0
    assert _hints({"retain": float("inf")}, max_retain_s=60).retain_s == 60.0
    assert _hints({"retain": 10**400}).retain_s == 600.0
    assert _hints({"max_offload_tokens": 10**400}).max_offload_tokens == 10**400
    with caplog.at_level(logging.WARNING):
        assert _hints({"retain": float("nan")}) == NO_HINTS
        assert _hints({"retain": -(10**5000), "done": float("nan")}) == NO_HINTS
    nan, huge = (r.getMessage() for r in caplog.records)
    assert "retain=nan" in nan
    assert "retain=<an int of 16610 bits>" in huge and "done=nan" in huge


def _action(kind: str, payload: Any = None, version: str = "1") -> Any:
    """A `KvHintAction` as vLLM 0.33 carries it (`vllm/v1/kv_hints/protocol.py`)."""
    return types.SimpleNamespace(
        action_id="a1",
        action_type=kind,
        action_version=version,
        payload={} if payload is None else payload,
    )


def _enveloped(*actions: Any, params: Any = None, max_retain_s: float = 600.0):
    envelope = types.SimpleNamespace(
        protocol_version="1", message_id="m1", actions=list(actions)
    )
    request = types.SimpleNamespace(
        request_id="r1", kv_transfer_params=params, kv_hints=envelope
    )
    return hints_of(request, max_retain_s=max_retain_s)


def test_retain_and_release_are_read_from_the_kv_hints_envelope() -> None:
    assert _enveloped(_action("retain")).retain_s == DEFAULT_RETAIN_S
    assert _enveloped(_action("retain", {"ttl_s": 45})) == RequestHints(retain_s=45.0)
    assert _enveloped(_action("retain", {"ttl_s": 1e9}), max_retain_s=60).retain_s == 60
    assert _enveloped(_action("release")) == RequestHints(done=True)
    # Another component's action is its own; an empty envelope says nothing.
    assert _enveloped(_action("prefetch", {"destination": "w1"})) == NO_HINTS
    assert _enveloped() == NO_HINTS


def test_both_channels_speak_the_longer_retain_wins_either_done_counts() -> None:
    params = {"retain": 30, "max_offload_tokens": 8}
    assert _enveloped(_action("retain", {"ttl_s": 90}), params=params) == RequestHints(
        max_offload_tokens=8, retain_s=90.0
    )
    assert _enveloped(_action("retain", {"ttl_s": 5}), params=params).retain_s == 30
    assert _enveloped(_action("release"), params={"retain": 30}) == RequestHints(
        retain_s=30.0, done=True
    )


def test_a_bad_envelope_action_is_ignored_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        hints = _enveloped(
            _action("retain", version="2"),
            _action("release", payload="now"),
            _action("retain", {"ttl_s": -3}),
        )
    assert hints == NO_HINTS
    (record,) = caplog.records
    text = record.getMessage()
    assert "r1" in text and "action_version='2'" in text
    assert "payload of a str" in text and "retain=-3" in text


# ---- retention over the real pool ----


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pool(blocks: int = 8) -> HostBlockPool:
    return HostBlockPool(blocks, make_policy("lru", blocks))


def _store(pool: HostBlockPool, name: str, n: int, ready: bool = True) -> list:
    """A chain of `n` blocks named `name`, stored (READY) or being stored."""
    keys = [(0, f"{name}{i}") for i in range(n)]
    got = pool.allocate_for_store(keys, None)
    assert len(got) == n, "the pool had no room"
    if ready:
        pool.complete_store(keys, True)
    return keys


def _retention(pool: HostBlockPool, budget: int) -> tuple[Retention, Clock]:
    clock = Clock()
    return Retention(pool, budget, TierStats(block_bytes=1), clock=clock), clock


def test_retained_blocks_outlive_pressure_until_the_last_one_is_read() -> None:
    pool = _pool()
    retention, _ = _retention(pool, budget=4)
    kept = _store(pool, "a", 3)
    retention.retain(kept, None, 60)
    for name in "bcdef":  # five more chains of two blocks through a pool of eight
        _store(pool, name, 2)
    assert all(pool.state_of(k) is BlockState.READY for k in kept)
    assert retention.stats.retained_blocks == 3
    retention.read(kept[:2])  # another session reads the prefix it shares
    assert retention.stats.retained_blocks == 3 and pool.num_pinned == 3
    retention.read(kept)  # the client came back
    assert retention.stats.retained_hit_blocks == 3
    assert retention.stats.retained_blocks == pool.num_pinned == 0
    _store(pool, "g", 8)  # evictable again, like any used block
    assert not any(k in pool for k in kept)
    retention.check_invariants()
    pool.check_invariants()


def test_sessions_that_share_a_prefix_hold_it_together() -> None:
    # Two agents behind one system prompt: the prompt stays pinned until the last
    # retain that holds it ends; the budget counts it once.
    pool = _pool()
    retention, _ = _retention(pool, budget=4)
    prompt = _store(pool, "p", 2)
    a = [(0, "a")]
    b = [(0, "b")]
    pool.allocate_for_store(a, prompt[-1])
    pool.complete_store(a, True)
    pool.allocate_for_store(b, prompt[-1])
    pool.complete_store(b, True)
    retention.retain(prompt + a, "t", 60)
    retention.retain(prompt + b, "t", 60)
    assert retention.stats.retained_blocks == pool.num_pinned == 4
    retention.read(prompt + a)  # agent a's next step
    assert pool.num_pinned == 3 and _pinned(pool, prompt + b)
    retention.check_invariants()


def test_a_retain_ends_when_its_time_passes_counted_unread() -> None:
    pool = _pool()
    retention, clock = _retention(pool, budget=4)
    retention.retain(_store(pool, "a", 2), None, 10)
    clock.now = 9.9
    retention.expire()
    assert pool.num_pinned == 2
    clock.now = 10.0
    retention.expire()
    assert pool.num_pinned == 0
    assert retention.stats.retains_expired_unread == 1
    assert retention.stats.retained_blocks == 0


def test_tenants_share_the_budget_fairly() -> None:
    pool = _pool(16)
    retention, _ = _retention(pool, budget=4)
    x1, x2 = _store(pool, "x", 2), _store(pool, "xx", 2)
    retention.retain(x1, "x", 60)
    retention.retain(x2, "x", 30)  # x holds the whole budget: no one else asks
    assert retention.stats.retained_blocks == 4
    y = _store(pool, "y", 2)
    retention.retain(y, "y", 90)  # x past its share (2): y trims x's due last
    assert pool.state_of(x1[0]) is BlockState.READY and not _pinned(pool, x1)
    assert _pinned(pool, x2) and _pinned(pool, y)
    x3 = _store(pool, "xxx", 2)
    retention.retain(x3, "x", 20)  # x at its share gives up its own due last
    assert _pinned(pool, x3) and _pinned(pool, y) and not _pinned(pool, x2)
    x4 = _store(pool, "xxxx", 2)
    retention.retain(x4, "x", 40)  # due after x3: the new one waits, no room left
    assert _pinned(pool, x3) and not _pinned(pool, x4)
    z = _store(pool, "z", 4)
    retention.retain(z, "z", 60)  # x and y hold their shares (4 // 2): z gets none
    assert retention.stats.retained_blocks == 4
    assert _pinned(pool, x3) and _pinned(pool, y) and not _pinned(pool, z[:1])
    retention.check_invariants()


def test_with_more_sessions_than_room_the_retains_that_fit_are_read() -> None:
    # Three sessions retain in turn, each due back 30 s later, in room for two: the
    # third waits (due last), and the first two keep theirs until they are read,
    # instead of each retain being given up for the next just before its read.
    pool = _pool(16)
    retention, clock = _retention(pool, budget=4)
    sessions = [_store(pool, name, 2) for name in ("a", "b", "c")]
    for t, keys in enumerate(sessions):
        clock.now = float(t)
        retention.retain(keys, None, 30)
    a, b, c = sessions
    assert _pinned(pool, a) and _pinned(pool, b) and not _pinned(pool, c)
    clock.now = 20.0
    retention.read(a)
    retention.retain(c, None, 30)  # room again: c's next retain is kept
    retention.read(b)
    assert retention.stats.retained_hit_blocks == 4
    assert _pinned(pool, c) and not _pinned(pool, a)
    retention.check_invariants()


def test_a_retain_given_up_for_room_does_not_let_the_new_one_past_the_budget() -> None:
    # x's new retain extends its old one, which is given up for room: the prefix the
    # two shared leaves with it, and is new again; the budget still holds.
    pool = _pool(16)
    retention, _ = _retention(pool, budget=4)
    retention.retain(_store(pool, "y", 2), "y", 60)
    prefix = _store(pool, "p", 2)
    retention.retain(prefix, "x", 60)
    tail = [(0, "z0"), (0, "z1")]
    pool.allocate_for_store(tail, prefix[-1])
    pool.complete_store(tail, True)
    retention.retain(prefix + tail, "x", 60)
    assert retention.num_blocks <= 4 and pool.num_pinned <= 4
    retention.check_invariants()


def test_blocks_still_storing_are_kept_once_stored_a_failed_store_ends_it() -> None:
    pool = _pool()
    retention, _ = _retention(pool, budget=8)
    good, bad = _store(pool, "g", 2, ready=False), _store(pool, "b", 2, ready=False)
    retention.retain(good, None, 60)
    retention.retain(bad, None, 60)
    assert pool.num_pinned == 0 and retention.stats.retained_blocks == 4
    pool.complete_store(good, True)
    retention.stored(good, True)
    pool.complete_store(bad, False)
    retention.stored(bad, False)  # a hit would stop at the gap: nothing to keep
    assert _pinned(pool, good) and retention.stats.retained_blocks == 2
    retention.check_invariants()
    pool.check_invariants()


def test_done_blocks_go_first_leaf_first_unless_read_again() -> None:
    pool = _pool(7)
    old, done = _store(pool, "old", 2), _store(pool, "done", 2)
    read_again = _store(pool, "again", 2)
    pool.demote(done + read_again)
    assert pool.count_hits(read_again) == 2  # used after all: no longer doomed
    _store(pool, "new", 2)  # room for one (one free): the done chain's leaf goes
    assert done[0] in pool and done[1] not in pool
    _store(pool, "newer", 1)
    assert not any(k in pool for k in done)
    assert all(k in pool for k in old + read_again)
    pool.check_invariants()


def test_done_leaves_alone_the_prefix_other_sessions_share() -> None:
    pool = _pool(8)
    prompt = _store(pool, "p", 2)
    mine, theirs = [(0, "m")], [(0, "t")]
    for chain in (mine, theirs):
        pool.allocate_for_store(chain, prompt[-1])
        pool.complete_store(chain, True)
    pool.demote(prompt + mine)  # only "m" is this session's alone
    assert list(pool._doomed.values()) == mine


def _pinned(pool: HostBlockPool, keys: list) -> bool:
    return all(pool._by_key[k].pin_count > 0 for k in keys)
