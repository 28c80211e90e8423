"""The simulation finds each identity fix put back: with the product's identity blind to
one way B's KV differs from A's, a seed of that kind breaks an invariant: two engines
under one namespace at start, or, where only some requests differ (a LoRA adapter's
files), a block of the other engine's read or stored. Likewise for what changes while
the fleet runs (`runtime_events.py`): with the product deaf to a weight update or to
an adapter rewritten in place, the changed engine's KV reaches the others (or theirs
it); and the product keeps it apart on those seeds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm_cpu_offload.kv_identity as kv_identity_module  # noqa: E402
from tests.simulation.identities import KINDS, RUNTIME_KINDS  # noqa: E402
from tests.simulation.world import Violation, World, vllm_test_utils  # noqa: E402
from vllm_cpu_offload import lora_identity, runtime_weights  # noqa: E402
from vllm_cpu_offload.scheduler.tier_scheduler import (  # noqa: E402
    HostTierScheduler,
)
from vllm_cpu_offload.worker.tier_worker import HostTierWorker  # noqa: E402

STATIC_KINDS = tuple(k for k in KINDS if k not in RUNTIME_KINDS)


def _without_config_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    # Named fields only, as before vLLM's digests were taken.
    monkeypatch.setattr(kv_identity_module, "CONFIG_DIGESTS", ())


def _without_rope_or_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_config_digests(monkeypatch)
    monkeypatch.setattr(kv_identity_module, "_rope_of", lambda model: None)


def _without_the_built_length(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_config_digests(monkeypatch)
    monkeypatch.setattr(kv_identity_module, "_built_model_len", lambda model: None)


def _weights_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Weights named by where they are, not by what the files hold.
    from vllm_cpu_offload import weights_source

    monkeypatch.setattr(
        weights_source,
        "weights_identity",
        lambda model, download_dir: f"files:{model.model}",
    )


def _adapters_by_name_and_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's own LoRA keys: the adapter's name and path, not its files.
    from vllm.v1.core import kv_cache_utils

    current = kv_cache_utils._gen_lora_extra_hash_keys
    vllm_own = getattr(current, "_vllm_lora_keys", current)
    monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys", vllm_own)
    monkeypatch.setattr(lora_identity, "install", lambda: None)


BLIND_TO: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "rope-theta": _without_rope_or_digests,
    "max-model-len": _without_the_built_length,
    "fine-tuned-norm": _weights_by_path,
    "soft-cap": _without_config_digests,
    "lora-retrained": _adapters_by_name_and_path,
}
# What the run reports first, by kind; and how long it runs to see it.
CAUGHT_AS = {kind: "share the namespace" for kind in STATIC_KINDS} | {
    "lora-retrained": "another block's|wrong value"
}
STEPS = {kind: 4 for kind in STATIC_KINDS} | {"lora-retrained": 120}


@pytest.mark.parametrize("kind", STATIC_KINDS)
def test_an_identity_blind_to_a_difference_is_caught(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    utils: Any = vllm_test_utils()
    seed = KINDS.index(kind)  # B differs by `kind` on this seed
    BLIND_TO[kind](monkeypatch)
    world = World(utils, tiny_model, seed, tp=1, steps=STEPS[kind])
    assert world.identities.kind == kind
    with pytest.raises(Violation, match=CAUGHT_AS[kind]):
        world.run()


def _weights_changes_unheard(monkeypatch: pytest.MonkeyPatch) -> None:
    # As before `runtime_weights`: vLLM's weight updates and cache resets leave the
    # shared store (and the file tier) open.
    monkeypatch.setattr(runtime_weights, "weights_changing", lambda why: None)
    monkeypatch.setattr(HostTierScheduler, "identity_changed", lambda self, why: None)


def _adapter_files_looked_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # As before the adapter's files were looked at again: its identity stays what
    # the process first found, and every request's hashes hold.
    looked = lora_identity._checked

    def first_seen(lora: Any) -> Any:
        adapter = looked(lora)
        adapter.identity = adapter.first_seen
        return adapter

    monkeypatch.setattr(lora_identity, "_checked", first_seen)


RUNTIME_DEAF_TO: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "weights-updated": _weights_changes_unheard,
    "adapter-reloaded": _adapter_files_looked_at_once,
}
# Seeds of each runtime kind (weights: A2 reloads after a reset of vLLM's prefix
# cache alone at step 20; A resets at step 17; A reloads at step 16; adapter:
# rewritten under A2 at step 23), and the steps they run.
RUNTIME_SEEDS = [
    ("weights-updated", 5),
    ("weights-updated", 40),
    ("weights-updated", 12),
    ("adapter-reloaded", 6),
]
RUNTIME_STEPS = 60


@pytest.mark.parametrize(("kind", "seed"), RUNTIME_SEEDS)
def test_a_runtime_change_unheard_is_caught(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, kind: str, seed: int
) -> None:
    utils: Any = vllm_test_utils()
    RUNTIME_DEAF_TO[kind](monkeypatch)
    world = World(utils, tiny_model, seed, tp=1, steps=RUNTIME_STEPS)
    assert world.identities.kind == kind
    with pytest.raises(Violation, match="another block's|wrong KV"):
        world.run()


def _host_tier_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # As before the host tier dropped its blocks at a weight change: the layers are
    # told, the pool keeps what the old weights computed.
    def told_only(self: HostTierScheduler, why: str) -> None:
        for listener in self.on_identity_change:
            listener(why)

    monkeypatch.setattr(HostTierScheduler, "identity_changed", told_only)


def _loads_of_the_window_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # As before a worker refused the loads planned before the scheduler half heard
    # of its weight change.
    monkeypatch.setattr(HostTierWorker, "_plan_is_current", True)
    monkeypatch.setattr(HostTierWorker, "_current", lambda self, job_id: True)


@pytest.mark.parametrize("blind", [_host_tier_kept, _loads_of_the_window_run])
def test_old_kv_the_host_tier_serves_after_a_reload_is_caught(
    tiny_model: str,
    monkeypatch: pytest.MonkeyPatch,
    blind: Callable[[pytest.MonkeyPatch], None],
) -> None:
    # Seed 5: A2's caller resets vLLM's prefix cache alone, then reloads the
    # weights. vLLM serves nothing of before; a host tier that still does (from
    # its blocks of before, or in the steps planned before it heard) reads a value
    # of the old weights.
    utils: Any = vllm_test_utils()
    blind(monkeypatch)
    world = World(utils, tiny_model, 5, tp=1, steps=RUNTIME_STEPS)
    assert world.event is not None and world.event.mode == "prefix-reset"
    with pytest.raises(Violation, match="wrong KV"):
        world.run()


@pytest.mark.parametrize(("kind", "seed"), RUNTIME_SEEDS)
def test_the_product_keeps_a_runtime_change_apart(
    tiny_model: str, kind: str, seed: int
) -> None:
    # The same seeds, with the product as it is: nothing wrong is read or stored,
    # and the engines that did not change still share.
    utils: Any = vllm_test_utils()
    world = World(utils, tiny_model, seed, tp=1, steps=RUNTIME_STEPS)
    world.run()
    changed = [e.name for e in world.engines if e.change.fired_at is not None]
    assert changed == [world.event.engine if world.event else None]


def _loads_checked_where_their_copy_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # As before a load's epoch was checked where it ends: an async load whose copy
    # had started when the weights or the adapter changed was taken.
    monkeypatch.setattr(HostTierWorker, "_stale_loads", lambda self, loads: set())


# Seeds whose change lands while a load of its engine runs across steps (started,
# its copy still to run): 12, A's weights reloaded.
IN_FLIGHT_SEEDS = [("weights-updated", 12)]


@pytest.mark.parametrize(("kind", "seed"), IN_FLIGHT_SEEDS)
def test_a_load_whose_copy_runs_across_a_change_is_caught(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, kind: str, seed: int
) -> None:
    # The load's copy runs late, as CUDA's background stream runs it; the change
    # lands before it ends. A worker that takes its result reads the values of
    # before where the request now computes other ones.
    utils: Any = vllm_test_utils()
    _loads_checked_where_their_copy_starts(monkeypatch)
    world = World(utils, tiny_model, seed, tp=1, steps=RUNTIME_STEPS)
    assert world.event is not None and world.event.kind == kind
    assert world.event.in_flight
    with pytest.raises(Violation, match="wrong KV"):
        world.run()
