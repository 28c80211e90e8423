"""benchmarks/trace_replay.py's `VllmTier` drives vLLM's own `CPUOffloadingManager` as
vLLM's `OffloadingConnector` does: no `touch` of device hits (the connector has no such
call), and after a host load a store offer that starts past the loaded keys. A replay
that touched device hits fed `prefix_aware`'s admission host uses that never happen in
an engine (10,432 replayed host-hit tokens against the engine's 7,520)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from trace_replay import VllmTier  # noqa: E402


def _recording(tier: VllmTier) -> dict[str, list[Any]]:
    """The manager's touch and prepare_store calls, by the replay's own keys."""
    calls: dict[str, list[Any]] = {"touch": [], "offers": []}
    mgr = tier.manager
    prepare_store = mgr.prepare_store

    def touch(keys: Any, ctx: Any) -> None:
        calls["touch"].append(list(keys))

    def store(keys: Any, ctx: Any) -> Any:
        replay_key = {v: k for k, v in tier._keys.items()}
        calls["offers"].append([replay_key[k] for k in keys])
        return prepare_store(keys, ctx)

    mgr.touch = touch  # type: ignore[method-assign]
    mgr.prepare_store = store  # type: ignore[method-assign]
    return calls


def test_device_hits_are_not_touched_and_loaded_keys_are_not_offered_again() -> None:
    tier = VllmTier("lru", 16)
    calls = _recording(tier)
    assert tier.serve(0, [1, 2, 3, 4], 0) == 0  # computed: every key offered
    assert calls["offers"] == [[1, 2, 3, 4]]
    # two device hits, two host hits, one new key: the offer starts past the load
    assert tier.serve(1, [1, 2, 3, 4, 5], 2) == 2
    assert calls["offers"][-1] == [5]
    # a device hit and no host hit: the connector offers from chunk 0
    assert tier.serve(2, [1, 6, 9], 1) == 0
    assert calls["offers"][-1] == [1, 6, 9]
    assert calls["touch"] == []


def test_a_request_whose_every_key_was_loaded_offers_nothing() -> None:
    tier = VllmTier("lru", 16)
    calls = _recording(tier)
    tier.serve(0, [7, 8], 0)
    assert tier.serve(1, [7, 8], 0) == 2
    assert calls["offers"] == [[7, 8]]
