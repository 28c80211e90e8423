"""Which blocks each KV cache group needs, and the longest hit every group can serve."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from vllm_cpu_offload.config import OffloadConfigError  # noqa: E402
from vllm_cpu_offload.scheduler.kv_groups import KVGroup, kv_groups_of, longest_hit  # noqa: E402

BS = 4
ATTN: dict[str, Any] = dict(num_kv_heads=1, head_size=8, dtype=torch.float32)


def _config(*specs: object) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs)]  # type: ignore[arg-type]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_first_needed_block_matches_the_tokens_vllm_skips() -> None:
    # A window of 8 tokens after 6 blocks (24 tokens): tokens 0..16 are skipped, so
    # block 4 (tokens 16..19) is the first the next token attends to. A chunk of 8
    # tokens after 24 tokens starts a new chunk: nothing before block 6 is needed.
    window, chunk, full = (
        KVGroup(1, sliding_window=8),
        KVGroup(2, attention_chunk=8),
        KVGroup(0),
    )
    assert [window.first_needed_block(n, BS) for n in (0, 1, 2, 3, 6)] == [
        0,
        0,
        0,
        1,
        4,
    ]
    assert [chunk.first_needed_block(n, BS) for n in (1, 2, 3, 6, 7)] == [0, 2, 2, 6, 6]
    assert full.first_needed_block(100, BS) == 0


def test_longest_hit_needs_every_full_block_but_only_the_window() -> None:
    groups = (KVGroup(0), KVGroup(1, sliding_window=8))
    # window group: only blocks 4, 5
    held = {(0, i) for i in range(10)} | {
        (1, 4),
        (1, 5),
    }

    def ready(group: int, i: int) -> bool:
        return (group, i) in held

    # A hit of 6 blocks needs window blocks 4 and 5 (held); 7 would need 5 and
    # 6 (6 missing).
    assert longest_hit(groups, BS, 0, 10, ready) == 6
    # A gap in the full group ends the hit, whatever the window group holds.
    held.discard((0, 3))
    assert longest_hit(groups, BS, 0, 10, ready) == 0
    # From a device hit of 4 blocks: the window group needs block 4 onwards only.
    assert longest_hit(groups, BS, 4, 10, ready) == 2


def test_longest_hit_of_a_window_only_model_skips_what_the_window_left() -> None:
    # With no full group, blocks before the window never matter.
    groups = (KVGroup(0, sliding_window=8),)
    held = {(0, 7), (0, 8)}
    assert longest_hit(groups, BS, 0, 9, lambda g, i: (g, i) in held) == 9
    assert longest_hit(groups, BS, 0, 8, lambda g, i: (g, i) in held) == 0


def test_groups_of_a_hybrid_config() -> None:
    groups = kv_groups_of(
        _config(
            FullAttentionSpec(block_size=BS, **ATTN),
            SlidingWindowSpec(block_size=BS, sliding_window=64, **ATTN),
            ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=32, **ATTN),
        ),
        BS,
    )
    assert groups == (
        KVGroup(0),
        KVGroup(1, sliding_window=64),
        KVGroup(2, attention_chunk=32),
    )


def test_state_space_groups_and_mixed_block_sizes_are_refused_in_one_line() -> None:
    mamba = MambaSpec(block_size=BS, shapes=((2, 3),), dtypes=(torch.float32,))
    with pytest.raises(OffloadConfigError, match="group 1 is MambaSpec") as err:
        kv_groups_of(_config(FullAttentionSpec(block_size=BS, **ATTN), mamba), BS)
    assert "\n" not in str(err.value) and "drop --enable-cpu-offload" in str(err.value)
    with pytest.raises(OffloadConfigError, match="--block-size 8"):
        kv_groups_of(
            _config(
                FullAttentionSpec(block_size=BS, **ATTN),
                SlidingWindowSpec(block_size=8, sliding_window=64, **ATTN),
            ),
            BS,
        )
