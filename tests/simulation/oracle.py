"""What every KV slot must hold: a value derived from the token prefix up to it, the
engine's fingerprint and the global KV head.

Equal prefixes give equal values on one engine and head (as real KV does, whatever the
`cache_salt` and the TP size), so a block reached through any path, written by an engine
of any TP size, can be checked; another prefix, head or engine gives another value.
Values fit in 24 bits, exact in float32.

A drafter's KV cache group (EAGLE-style: its KV at a position is computed from the
target's state there and the token after it) holds, at position p, a value derived from
the prefix through p + 1: at a block's last position it depends on the next block's
first token, which the block's hash does not cover. A cached block (vLLM's, or a host
block, keyed by that hash) holds the value of whichever continuation computed it first,
so there the check is that the slot holds this block's value for some next token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import islice

import torch

from vllm_cpu_offload.remote import value_format

MASK = (1 << 24) - 1
DRAFTER_MIX = 0x3C3C3C


def next_token(values: Sequence[int], end: int) -> int:
    """The token sampled after the prefix of `end` tokens whose prefix values are
    `values`: the world's model is deterministic."""
    return values[end - 1] % 4999 + 1


def head_of(name: str) -> int:
    """The value index a shard name stands for (the `rank` of `Oracle.slot_value`): the
    global KV head of a per-head value (`pp0-h{g}`); 0 for a stage's replicated KV
    (`pp0`), which every rank computes alike; the TP rank of a per-rank value
    (`tp{r}-pp0`)."""
    if name.startswith("tp"):
        return int(name.removeprefix("tp").partition("-")[0])
    _stage, _, head = name.partition("-h")
    return int(head) if head else 0


class Oracle:
    """The prefix values of every request the world made, and of every block hash
    those requests named, per engine namespace."""

    def __init__(
        self,
        block_size: int,
        kv_entries_per_slot: dict[int, int],
        drafter_groups: frozenset[int] = frozenset(),
    ) -> None:
        self.block_size = block_size
        # Per KV cache group, the slots of one block position in a host block: the
        # group's layers x (K, V).
        self.kv_entries_per_slot = kv_entries_per_slot
        self.drafter_groups = drafter_groups
        self._prefix: dict[str, list[int]] = {}  # request id -> value per position
        self._blocks: dict[str, list[int]] = {}  # block hash (hex) -> its values
        self._salts: dict[str, int] = {}  # namespace -> engine salt
        # request id -> its prefix values, and how many of them are in
        self._tensors: dict[str, tuple[torch.Tensor, int]] = {}
        self._adapters: dict[str, int] = {}  # request id -> its LoRA adapter's files

    def add_engine(self, namespace: str, salt: int) -> str | None:
        """Names an engine's KV; a problem when engines whose KV differs share a
        namespace (they would read each other's blocks)."""
        if self._salts.setdefault(namespace, salt) != salt:
            return f"engines whose KV differs share the namespace {namespace}"
        return None

    @staticmethod
    def slot_value(base: int, engine_salt: int, rank: int) -> int:
        """`rank` is the global KV head (0 for replicated KV; see `head_of`)."""
        return (base ^ engine_salt ^ (rank * 0x9E3779)) & MASK

    def prefix_tensor(self, req_id: str, tokens: Sequence[int], n: int) -> torch.Tensor:
        """The prefix values of the first `n` positions of `tokens` as an int64 tensor
        (a view: do not write it). O(new positions): each request's values are kept
        in a tensor that grows by doubling."""
        values = self.prefix_values(req_id, tokens, n)
        held, filled = self._tensors.get(req_id, (torch.empty(0, dtype=torch.int64), 0))
        if filled < n:
            if held.numel() < n:
                grown = torch.empty(max(2 * n, 64), dtype=torch.int64)
                grown[:filled] = held[:filled]
                held = grown
            held[filled:n] = torch.tensor(values[filled:n], dtype=torch.int64)
            self._tensors[req_id] = (held, n)
        return held[:n]

    def set_adapter(self, req_id: str, adapter: int) -> None:
        """The request's KV is computed with LoRA adapter files `adapter` (> 0): other
        values than the model's alone, and than another adapter's."""
        self._adapters[req_id] = adapter

    def prefix_values(
        self, req_id: str, tokens: Sequence[int], n: int | None = None
    ) -> list[int]:
        """The base value of each position of `tokens` (grown as tokens are added),
        of its first `n` at least."""
        values = self._prefix.setdefault(req_id, [])
        last = values[-1] if values else 0x12345 + 0x777 * self._adapters.get(req_id, 0)
        for token in islice(tokens, len(values), n):
            last = (last * 1000003 + token + 1) % (1 << 31)
            values.append(last)
        return values

    def note_blocks(
        self, req_id: str, tokens: Sequence[int], hashes: Sequence[bytes]
    ) -> None:
        values = self.prefix_values(req_id, tokens)
        bs = self.block_size
        for i, h in enumerate(hashes):
            self._blocks.setdefault(bytes(h).hex(), values[i * bs : i * bs + bs])

    def forget(self, req_id: str) -> None:
        self._prefix.pop(req_id, None)
        self._tensors.pop(req_id, None)
        self._adapters.pop(req_id, None)

    @staticmethod
    def is_drafter_tail(
        got: torch.Tensor,
        prefix: torch.Tensor,
        engine_salt: int | torch.Tensor,
        ranks: torch.Tensor,
    ) -> torch.Tensor:
        """Per row, whether `got` ([n, heads]) holds a drafter value at a position of
        prefix value `prefix` ([n]) with some next token, for each head of `ranks`
        (`engine_salt`: one, or one per row as [n, 1])."""
        mix = (engine_salt ^ (ranks * 0x9E3779)) ^ DRAFTER_MIX
        unmixed = (got.to(torch.int64) ^ mix) & MASK
        # The next prefix value is prefix * 1000003 + token + 1 (mod 2^31): its low
        # 24 bits less those of prefix * 1000003 + 1 are the token.
        start = (prefix * 1000003 + 1) & MASK
        token = (unmixed - start[:, None]) & MASK
        return ((token >= 1) & (token < 5000)).all(dim=1)

    def check_value(self, key: str, value: bytes) -> str | None:
        """Whether a store value holds what its shard key stands for: every slot's K
        and V in every layer of its group (a whole block of one head, or of a
        replicated stage). A drafter group's last slot depends on a token after the
        block: any one value there."""
        namespace, group_name, block_hex, shard = key.split("/")
        group = int(group_name)
        salt = self._salts.get(namespace)
        base = self._blocks.get(block_hex)
        if salt is None or base is None:
            return "a key the world never made"
        payload = memoryview(value)[value_format.HEADER_BYTES :].cast("f")
        head = head_of(shard)
        entries = self.kv_entries_per_slot[group]
        if group in self.drafter_groups:
            base = [b ^ DRAFTER_MIX for b in base[1:]]
        expected = Counter(float(self.slot_value(b, salt, head)) for b in base)
        for v in expected:
            expected[v] *= entries
        rest: Counter[float] = Counter(payload.tolist())
        rest.subtract(expected)
        if any(n < 0 for n in rest.values()):
            return "its bytes are another block's"
        left = +rest
        if group not in self.drafter_groups and left:
            return "its bytes are another block's"
        if group in self.drafter_groups:
            (tail, count), *more = left.items() or [(0.0, 0)]
            ok = self.is_drafter_tail(
                torch.tensor([[tail]]),
                torch.tensor([self._blocks[block_hex][-1]]),
                salt,
                torch.tensor([head]),
            )
            if more or count != entries or not bool(ok):
                return "its drafter slots are another block's"
        return None
