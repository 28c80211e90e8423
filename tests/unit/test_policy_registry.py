"""Eviction policies named by import path or entry point: a user's class in place of
ours."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.external_policy.fifo import FIFOPolicy
from vllm_cpu_offload.config import OffloadConfig
from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.scheduler.block_pool import HostBlockPool
from vllm_cpu_offload.scheduler.policies import LRUPolicy
from vllm_cpu_offload.scheduler.policies.registry import (
    ENTRY_POINT_GROUP,
    POLICY_NAMES,
    available_policy_names,
    make_policy,
    resolve_policy,
)

FIFO_PATH = "tests.external_policy.fifo:FIFOPolicy"


def _store(pool: HostBlockPool, keys: list[str]) -> None:
    allocated = pool.allocate_for_store(keys, None)
    pool.complete_store([key for key, _ in allocated], True)


def test_a_policy_class_by_import_path_runs_the_pool() -> None:
    # Both spellings name the class; the pool then evicts in its order, not LRU's: the
    # oldest block goes although it was just looked up.
    assert resolve_policy(FIFO_PATH) is FIFOPolicy
    assert resolve_policy("tests.external_policy.fifo.FIFOPolicy") is FIFOPolicy
    assert OffloadConfig.from_extra_config(
        {"eviction_policy": FIFO_PATH}
    ).eviction_policy == (FIFO_PATH)
    evicted = {}
    for name in (FIFO_PATH, "lru"):
        pool = HostBlockPool(2, make_policy(name, 2))
        _store(pool, ["a"])
        _store(pool, ["b"])
        assert pool.count_hits(["a"]) == 1
        _store(pool, ["c"])
        evicted[name] = {"a", "b"} - {key for key in ("a", "b") if key in pool}
    assert evicted == {FIFO_PATH: {"a"}, "lru": {"b"}}
    assert isinstance(make_policy("lru", 2), LRUPolicy)


def test_a_policy_by_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An installed distribution declares the policy in the entry-point group; its name
    # is then as good as a built-in one.
    dist = tmp_path / "fifo_policy_plugin-1.0.dist-info"
    dist.mkdir()
    metadata = "Metadata-Version: 2.1\nName: fifo-policy-plugin\nVersion: 1.0\n"
    (dist / "METADATA").write_text(metadata)
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nfifo = {FIFO_PATH}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "fifo" in available_policy_names()
    assert resolve_policy("fifo") is FIFOPolicy
    assert isinstance(make_policy("fifo", 4), FIFOPolicy)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("fifo", f"'fifo' is not known; choose one of: {', '.join(POLICY_NAMES)}"),
        ("no_such_pkg.policies:FIFO", "cannot import module 'no_such_pkg.policies'"),
        ("tests.external_policy.fifo:LIFOPolicy", "has no 'LIFOPolicy'; fix the path"),
        ("tests.external_policy.fifo:NotAPolicy", "is not a subclass of"),
        (
            "tests.external_policy.fifo:HalfWrittenPolicy",
            "does not implement on_access, on_pin, on_ready, on_remove, on_unpin, "
            "pop_victim",
        ),
        ("tests.external_policy.fifo:", "is not an import path"),
    ],
)
def test_a_bad_policy_is_a_one_line_error_before_start(name: str, message: str) -> None:
    with pytest.raises(OffloadConfigError) as info:
        resolve_policy(name)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
