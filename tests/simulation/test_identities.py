"""The simulation finds each identity fix put back: with the product's identity blind to
one way B's KV differs from A's, a seed of that kind breaks an invariant: two engines
under one namespace at start, or, where only some requests differ (a LoRA adapter's
files), a block of the other engine's read or stored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm_cpu_offload.kv_identity as kv_identity_module  # noqa: E402
from tests.simulation.identities import KINDS  # noqa: E402
from tests.simulation.world import Violation, World, vllm_test_utils  # noqa: E402
from vllm_cpu_offload import lora_identity  # noqa: E402


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
CAUGHT_AS = {kind: "share the namespace" for kind in KINDS} | {
    "lora-retrained": "another block's|wrong value"
}
STEPS = {kind: 4 for kind in KINDS} | {"lora-retrained": 120}


@pytest.mark.parametrize("kind", KINDS)
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
