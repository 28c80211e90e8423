"""Request hints through the scheduler half, with vLLM's Request and KV manager:
`max_offload_tokens` caps the stores, `retain` keeps a prefix through a flood until it
is read again."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.unit.test_tier_scheduler import HASHER, Engine, _prefill  # noqa: E402
from vllm_cpu_offload.scheduler.hints_layer import attach_hints  # noqa: E402


def _hinted(retain_blocks: int = 0) -> Engine:
    """An engine whose scheduler reads hints and retains up to `retain_blocks`."""
    engine = Engine(host_blocks=8)
    attach_hints(engine.tier, retain_blocks=retain_blocks, max_retain_s=600.0)
    return engine


def _request(req_id: str, tokens: list[int], salt: str | None = None, **hints: Any):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": hints})
    return Request(req_id, tokens, params, None, block_hasher=HASHER, cache_salt=salt)


def _finish(engine: Engine, request: Any) -> None:
    """Prefill, report its stores, finish it."""
    meta = _prefill(engine, request)
    engine.report(*(s.job_id for s in meta.stores))
    engine.tier.request_finished(request)


def test_max_offload_tokens_caps_what_a_request_stores() -> None:
    engine = _hinted()
    capped = _request("a", list(range(13)), max_offload_tokens=5)
    (store,) = _prefill(engine, capped).stores
    assert len(store.host_block_ids) == 1  # 5 tokens: one whole 4-token block
    none = _request("b", list(range(100, 113)), max_offload_tokens=0)
    assert not _prefill(engine, none).stores


def test_hints_past_any_float_go_through_the_scheduler() -> None:
    # A 400-digit `retain` keeps the prefix for `max_retain_s`, a 400-digit
    # `max_offload_tokens` stores all of it. (vLLM 0.32 refuses ints past 64 bits in
    # `extra_args`; the hints are set on the request past that check.)
    engine = _hinted(retain_blocks=4)
    request = _request("h", list(range(13)), retain=1)
    request.kv_transfer_params = {"retain": 10**400, "max_offload_tokens": 10**400}
    _finish(engine, request)
    assert engine.tier.stats.retained_blocks == 3


def test_a_retained_prefix_survives_a_flood_and_is_read_again() -> None:
    engine = _hinted(retain_blocks=4)
    turn1 = _request("t1", list(range(13)), retain=60)
    _finish(engine, turn1)
    assert engine.tier.stats.retained_blocks == 3
    for i in range(4):  # one-off documents of three blocks each
        _finish(
            engine,
            _request(f"doc{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 13))),
        )
    engine.kv.reset_prefix_cache()  # the device keeps nothing
    turn2 = _request("t2", list(range(13)) + [77, 78, 79])
    assert engine.admit(turn2) == 12  # every block of turn 1 from host memory
    assert engine.tier.stats.retained_hit_blocks == 3
    assert engine.tier.stats.retained_blocks == 0


def test_without_the_retain_the_flood_evicts_the_prefix() -> None:
    # The control of the test above: the same flood, no hint.
    engine = _hinted(retain_blocks=4)
    _finish(engine, _request("t1", list(range(13))))
    for i in range(4):
        _finish(
            engine,
            _request(f"doc{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 13))),
        )
    engine.kv.reset_prefix_cache()
    assert engine.admit(_request("t2", list(range(13)) + [77, 78, 79])) == 0


def test_a_retain_action_of_vllms_hint_envelope_keeps_the_prefix_through_a_flood() -> (
    None
):
    # vLLM 0.33's own request path: an orchestrator's `KvHintsEnvelope` in the
    # engine-core request, through the engine core's serialization, made a
    # `Request` as the engine core makes it, read by our scheduler half.
    hints = pytest.importorskip("vllm.v1.kv_hints")
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    decoder = MsgpackDecoder(EngineCoreRequest)

    def enveloped(req_id: str, tokens: list[int], *actions: Any) -> Any:
        core = EngineCoreRequest(
            request_id=req_id,
            prompt_token_ids=tokens,
            mm_features=None,
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            kv_hints=hints.KvHintsEnvelope("1", f"m-{req_id}", list(actions)),
        )
        sent = decoder.decode(MsgpackEncoder().encode(core))
        return Request.from_engine_core_request(sent, block_hasher=HASHER)

    engine = _hinted(retain_blocks=4)
    retain = hints.KvHintAction("a1", "retain", "1", {"ttl_s": 60})
    _finish(engine, enveloped("t1", list(range(13)), retain))
    assert engine.tier.stats.retained_blocks == 3
    for i in range(4):
        _finish(
            engine,
            _request(f"doc{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 13))),
        )
    engine.kv.reset_prefix_cache()
    release = hints.KvHintAction("a2", "release", "1", {})
    turn2 = enveloped("t2", list(range(13)) + [77, 78, 79], release)
    assert engine.admit(turn2) == 12  # every block of turn 1 from host memory
    assert engine.tier.stats.retained_hit_blocks == 3
