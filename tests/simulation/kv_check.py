"""What a step's forward pass writes into each rank's device KV and checks there: every
slot the step reads as computed holds the oracle's value, however it got there.

The slots are worked out once a step for every rank (`StepSlots.of`): per KV cache
group, the device block and offset of each position each scheduled request reads (the
ones it had computed) and writes (the ones it computes now), with what the position's
value stands for before a head's mix: its prefix value (`Oracle.prefix_tensor`) and its
request's salt. Each rank then mixes in its heads and writes and checks with one
scatter and one gather per layer (`forward`). Cost: a tensor op or two per request a
step, then a few per group and layer for the whole batch, whatever the number of heads
and ranks (per request, per head and per rank, they were most of a run's time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tests.simulation.oracle import DRAFTER_MIX, MASK, Oracle, next_token
from tests.simulation.runtime_events import EngineChange

# More positions than a request of the simulation holds (twice its longest length).
_MAX_POSITIONS = 4096


@dataclass
class Slots:
    """One group's slots a step reads or writes: where (device block, offset) and
    what they stand for (prefix value, salt; `old_salts`: the salt of the values of
    before a runtime change where those may still be read, else None)."""

    blocks: torch.Tensor
    offsets: torch.Tensor
    base: torch.Tensor
    salts: torch.Tensor
    old_salts: torch.Tensor | None = None

    def values(self, heads: torch.Tensor, old: bool = False) -> torch.Tensor:
        """[n, heads] float32: the value each slot holds in each head (`heads`: each
        one's mix, `Oracle.slot_value`)."""
        salts = self.old_salts if old else self.salts
        assert salts is not None
        return (((self.base ^ salts)[:, None] ^ heads[None, :]) & MASK).float()


@dataclass
class StepSlots:
    """Per group, the slots the step reads and those it writes (see the module
    docstring); None where no request is scheduled."""

    read: list[Slots]
    written: list[Slots]

    @classmethod
    def of(
        cls,
        oracle: Oracle,
        block_size: int,
        num_groups: int,
        requests: Sequence[tuple[Any, int, list[int], int, list[list[int]]]],
        change: EngineChange,
    ) -> StepSlots | None:
        """`requests`: each scheduled request, its tokens scheduled, its tokens as the
        workers know them, its salt and its device blocks per group."""
        if not requests:
            return None
        read = [_Parts() for _ in range(num_groups)]
        written = [_Parts() for _ in range(num_groups)]
        stale = change.stale
        offsets = _offsets(block_size)
        for request, count, tokens, salt, block_ids in requests:
            req_id = request.request_id
            end = request.num_computed_tokens
            done = end - count
            salts = torch.full((end,), salt, dtype=torch.int64)
            # Where this request may read the values of before its engine's KV
            # changed (`runtime_events.Stale`).
            allowed = (
                None
                if stale is None
                else stale.allowed(req_id, request.block_hashes, done, block_size)
            )
            old_salts = None
            if allowed is not None:
                assert stale is not None
                old_salts = salts[:done].clone()
                old_salts[allowed] ^= stale.mix
            for group in range(num_groups):
                base = _group_base(oracle, req_id, tokens, end, group)
                blocks = torch.tensor(block_ids[group], dtype=torch.int64)
                blocks = blocks.repeat_interleave(block_size)[:end]
                read[group].add(
                    blocks[:done], offsets[:done], base[:done], salts[:done], old_salts
                )
                written[group].add(
                    blocks[done:end], offsets[done:end], base[done:], salts[done:]
                )
        return cls([p.joined() for p in read], [p.joined() for p in written])


class _Parts:
    """A group's slots, request by request, until joined."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, ...]] = []
        self.any_old = False

    def add(
        self,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        base: torch.Tensor,
        salts: torch.Tensor,
        old_salts: torch.Tensor | None = None,
    ) -> None:
        self.any_old |= old_salts is not None
        old = salts if old_salts is None else old_salts
        self.parts.append((blocks, offsets, base, salts, old))

    def joined(self) -> Slots:
        blocks, offsets, base, salts, old = (
            torch.cat(t) for t in zip(*self.parts, strict=True)
        )
        return Slots(blocks, offsets, base, salts, old if self.any_old else None)


_OFFSETS: dict[int, torch.Tensor] = {}


def _offsets(block_size: int) -> torch.Tensor:
    """Each position's offset in its block, for positions up to `_MAX_POSITIONS`."""
    if block_size not in _OFFSETS:
        _OFFSETS[block_size] = torch.arange(_MAX_POSITIONS) % block_size
    return _OFFSETS[block_size]


def _group_base(
    oracle: Oracle, req_id: str, tokens: list[int], end: int, group: int
) -> torch.Tensor:
    """[end]: each position's value in `group` before the salt and head mix. A
    drafter's value at a position is of the prefix through the token after it
    (`oracle.py`): at the last position, the prompt's next token or the one this
    step samples."""
    if group == 0:
        return oracle.prefix_tensor(req_id, tokens, end)
    if len(tokens) == end:
        values = oracle.prefix_values(req_id, tokens[:end])
        tokens = [*tokens, next_token(values, end)]
    return oracle.prefix_tensor(req_id, tokens, end + 1)[1:] ^ DRAFTER_MIX


def forward(
    oracle: Oracle,
    kv: dict[str, torch.Tensor],
    groups: Sequence[Sequence[str]],
    heads: tuple[int, ...],
    slots: StepSlots,
    block_size: int,
) -> set[int]:
    """Writes the step's computed slots of one rank (its `heads`), then checks every
    slot it reads; returns the device blocks whose slots were wrong. Writes go first,
    as a real layer writes the step's KV before its attention reads: a request may
    read blocks that another one computes in the same step (vLLM caches them at
    scheduling). A drafter group's slots at a block's last position must hold a
    drafter value for some next token."""
    ranks = torch.tensor(heads, dtype=torch.int64)
    mix = ranks * 0x9E3779
    wrong: set[int] = set()
    for group, layers in enumerate(groups):
        read, written = slots.read[group], slots.written[group]
        want_written = written.values(mix)
        want = read.values(mix)
        before = None if read.old_salts is None else read.values(mix, old=True)
        tail: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        if group == 1:
            tail = _tail_check(oracle, read, slots.read[0].base, ranks, block_size)
        for layer in layers:
            layer_kv = kv[layer]
            # Indexed by (blocks, offsets) around the heads' slice: [n, heads, 2].
            layer_kv[written.blocks, :, written.offsets] = want_written[:, :, None]
            got = layer_kv[read.blocks, :, read.offsets]
            bad = (got != want[:, :, None]).flatten(1).any(dim=1)
            if before is not None:
                bad &= (got != before[:, :, None]).flatten(1).any(dim=1)
            if tail is not None:
                tail(got, bad)
            wrong.update(read.blocks[bad].tolist())
    return wrong


def _tail_check(
    oracle: Oracle,
    read: Slots,
    prefix: torch.Tensor,
    ranks: torch.Tensor,
    block_size: int,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """What marks, in a drafter group's read, the slots at a block's last position
    bad unless they hold a drafter value for some next token (K and V alike) in the
    salt of now or, where allowed, of before; None where no read is at one."""
    loose = read.offsets == block_size - 1
    if not bool(loose.any()):
        return None
    at = prefix[loose]
    salts = read.salts[loose][:, None]
    old = None if read.old_salts is None else read.old_salts[loose][:, None]

    def check(got: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        loose_got = got[loose, :, 0]
        ok = oracle.is_drafter_tail(loose_got, at, salts, ranks)
        if old is not None:
            ok |= oracle.is_drafter_tail(loose_got, at, old, ranks)
        ok &= (loose_got == got[loose, :, 1]).all(dim=1)
        bad[loose] = ~ok
        return bad

    return check
