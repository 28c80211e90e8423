"""With speculative decoding, host hits end where vLLM's own hits end, and an
EAGLE-style drafter's volatile last block is recomputed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.unit.test_tier_scheduler import (  # noqa: E402
    BS,
    Engine,
    _prefill,
    _request,
    hold,
)
from vllm_cpu_offload.scheduler.drafter_layer import (  # noqa: E402
    DrafterLayer,
    describe_drafter,
    drafter_group_ids,
    drafter_tail_is_volatile,
)


def _speculative(method: str, *, drop: bool = True, draft: bool = True) -> Any:
    return SimpleNamespace(
        method=method,
        draft_model_config=object() if draft else None,
        use_eagle=lambda: method in ("eagle", "eagle3", "mtp"),
        use_eagle_block_drop=lambda: drop and method in ("eagle", "eagle3", "mtp"),
    )


def _kv_cache_config(*eagle_groups: bool, layers: tuple[int, ...] = ()) -> Any:
    groups = [
        SimpleNamespace(
            is_eagle_group=marked,
            layer_names=[f"model.layers.{layers[i]}.self_attn.attn"] if layers else [],
        )
        for i, marked in enumerate(eagle_groups)
    ]
    return SimpleNamespace(kv_cache_groups=groups)


def _attach(engine: Engine, speculative: Any) -> None:
    model = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=1))
    spec = SimpleNamespace(
        vllm_config=SimpleNamespace(speculative_config=speculative, model_config=model),
        kv_cache_config=_kv_cache_config(False),
    )
    assert DrafterLayer.wanted(spec)  # type: ignore[arg-type]
    DrafterLayer(spec).attach_scheduler(engine.tier)  # type: ignore[arg-type]


def _with_drafter(speculative: Any) -> Engine:
    engine = Engine()
    _attach(engine, speculative)
    return engine


def _stored(engine: Engine, tokens: list[int]) -> None:
    engine.report(_prefill(engine, _request("a", tokens)).stores[0].job_id)


def test_without_a_drafter_a_hit_reaches_the_prompts_last_token() -> None:
    engine = Engine()
    _stored(engine, list(range(12)))
    assert engine.tier.get_num_new_matched_tokens(
        _request("b", list(range(12))), 0
    ) == (3 * BS - 1)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_with_a_drafter_a_hit_ends_a_block_before_the_prompts_end(method: str) -> None:
    # vLLM's own hit of a prompt that ends on a block boundary leaves its last block:
    # the first step then computes a block, not one token, as the proposers expect.
    engine = _with_drafter(_speculative(method, draft=method != "ngram"))
    _stored(engine, list(range(12)))
    twin = _request("b", list(range(12)))
    assert engine.tier.get_num_new_matched_tokens(twin, 0) == 2 * BS
    # Off a block boundary nothing changes.
    longer = _request("c", list(range(12)) + [99])
    assert engine.tier.get_num_new_matched_tokens(longer, 0) == 3 * BS


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_an_eagle_style_drafters_last_block_of_a_hit_is_recomputed(method: str) -> None:
    # Block 2's drafter KV at its last position was computed from token 12 of the
    # request that stored it; "c" goes on with another token there.
    engine = _with_drafter(_speculative(method))
    _stored(engine, list(range(12)) + [50, 51])
    other = _request("c", list(range(12)) + [77, 78])
    assert engine.tier.get_num_new_matched_tokens(other, 0) == 2 * BS
    # From a device hit of two blocks, the one host block past it is the hit's last.
    assert engine.tier.get_num_new_matched_tokens(other, 2 * BS) == 0
    # vLLM's block drop turned off: nothing is dropped.
    engine = _with_drafter(_speculative(method, drop=False))
    _stored(engine, list(range(12)) + [50, 51])
    other = _request("c", list(range(12)) + [77, 78])
    assert engine.tier.get_num_new_matched_tokens(other, 0) == 3 * BS


def test_an_eagle_style_hit_of_an_aligned_prompt_keeps_all_but_its_last_block() -> None:
    # The prompt ends on a block boundary: a hit ends a block before its end (block
    # 2 is recomputed), and the drop takes the block past that, whose hash covers
    # the token block 1's drafter KV was computed from: blocks 0 and 1 are served.
    engine = _with_drafter(_speculative("eagle"))
    _stored(engine, list(range(12)))
    twin = _request("b", list(range(12)))
    assert engine.tier.get_num_new_matched_tokens(twin, 0) == 2 * BS
    # The same from a device hit of one block.
    assert engine.tier.get_num_new_matched_tokens(twin, BS) == BS
    # Where the host tier lacks block 2, block 1 is the hit's last: dropped.
    engine = _with_drafter(_speculative("eagle"))
    _stored(engine, list(range(8)) + [90, 91, 92])
    assert engine.tier.get_num_new_matched_tokens(twin, 0) == BS


def test_the_start_up_line_says_what_the_drafter_stores_and_where() -> None:
    ngram = _speculative("ngram", draft=False)
    assert drafter_group_ids(ngram, _kv_cache_config(False), 2) == []
    assert "adds no KV" in describe_drafter(ngram, [])
    draft = _speculative("draft_model")
    # Unmarked groups of the target's layers: the drafter's layers share them.
    unmarked = _kv_cache_config(False, False, layers=(0, 1))
    assert drafter_group_ids(draft, unmarked, 2) == [0, 1]
    line = describe_drafter(draft, [0, 1])
    assert "(KV cache groups 0, 1)" in line and line.endswith("with the target's")
    eagle = _speculative("eagle3")
    # A group vLLM marks as the drafter's: its per-group counters count the
    # drafter's blocks stored and loaded.
    assert drafter_group_ids(eagle, _kv_cache_config(False, True), 2) == [1]
    # Unmarked: the group of the layer past the target's two (a window group, a
    # full group, the EAGLE head's group).
    hybrid = _kv_cache_config(False, False, False, layers=(0, 1, 2))
    assert drafter_group_ids(eagle, hybrid, 2) == [2]
    line = describe_drafter(eagle, [1])
    assert "(KV cache group 1)" in line and "last block is recomputed" in line
    assert not drafter_tail_is_volatile(draft)
    assert drafter_tail_is_volatile(_speculative("mtp"))


def test_an_eagle_drop_with_a_window_group_looks_for_the_shorter_hit_again() -> None:
    # A full group and an 8-token (two-block) window group. The host tier holds
    # blocks 0-5 of the full group and only 4-5 of the window group: a 6-block hit is
    # servable, but its volatile last block dropped, a 5-block hit needs window
    # block 3, which the tier lacks. Looked up again, the hit is the longest one
    # every group serves that ends earlier: none here, not a load bound to miss.
    engine = Engine(host_blocks=16, sliding_window=8)
    _attach(engine, _speculative("eagle"))
    request = _request("b", list(range(26)))
    hold(engine, request, 0, range(6))
    hold(engine, request, 1, range(4, 6))
    assert engine.tier.get_num_new_matched_tokens(request, 0) == 0
    # Window blocks 2 and 3 too: 5 blocks are servable.
    hold(engine, request, 1, range(2, 4))
    assert engine.tier.get_num_new_matched_tokens(request, 0) == 5 * BS


def test_the_dropped_last_block_of_an_eagle_style_hit_is_not_a_use() -> None:
    # The policy hears of the blocks a hit serves, not of the one it recomputes:
    # block 2, dropped, is no more recent for the lookup than before it.
    engine = _with_drafter(_speculative("eagle"))
    _stored(engine, list(range(12)) + [50, 51])
    heard: list[Any] = []
    policy = engine.pool.policy
    real = policy.on_access

    def on_access(blocks: list[Any]) -> None:
        heard.extend(block.key for block in blocks)
        real(blocks)

    policy.on_access = on_access  # type: ignore[method-assign,assignment]
    other = _request("c", list(range(12)) + [77, 78])
    assert engine.tier.get_num_new_matched_tokens(other, 0) == 2 * BS
    assert sorted(heard, key=str) == sorted(
        [(0, other.block_hashes[0]), (0, other.block_hashes[1])], key=str
    )
