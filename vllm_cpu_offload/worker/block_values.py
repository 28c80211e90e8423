"""The values one worker's part of a host block has in the shared store, and where
their bytes are: the whole host block as it lies in host memory (one value, written
straight from it), or one value per KV head, cut into a staging buffer for a write and
joined from one after a fetch (`head_slices.py`; which applies is `kv_shards.py`'s
choice).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from vllm_cpu_offload.remote.store import Span
from vllm_cpu_offload.worker.head_slices import HeadSlices
from vllm_cpu_offload.worker.host_buffer import HostBuffer


class BlockValues:
    """A host block's values; see the module docstring.

    Attributes:
        names: the shard names of a block's values, in order.
        value_bytes: bytes of one value.
        staged: whether a write reads its values from a staging buffer (`cut`)
            rather than from host memory.

    """

    def __init__(
        self,
        host: HostBuffer,
        names: Sequence[str],
        *,
        blocks_per_host_block: int,
        slices: HeadSlices | None = None,
    ) -> None:
        self.names = tuple(names)
        self._slices = slices
        self._base = host.tensor.data_ptr()
        self._block_bytes = host.block_bytes * blocks_per_host_block
        self._num_host_blocks = host.num_slots // blocks_per_host_block
        if slices is None:
            assert len(self.names) == 1, "a whole host block is one value"
            self.value_bytes = self._block_bytes
        else:
            assert len(self.names) == slices.num_heads, "one value per KV head"
            self.value_bytes = slices.value_bytes
        self.staged = slices is not None

    @property
    def block_bytes(self) -> int:
        """Bytes of all of one block's values."""
        return len(self.names) * self.value_bytes

    def host_span(self, host_block: int) -> Span:
        if not 0 <= host_block < self._num_host_blocks:
            raise ValueError(f"host block {host_block} out of range")
        return Span(self._base + host_block * self._block_bytes, self._block_bytes)

    def write_spans(self, host_blocks: Sequence[int], staging_at: int) -> list[Span]:
        """Where each value of `host_blocks` is, block by block: host memory, or the
        staging buffer at `staging_at` (`staged`), which this fills."""
        spans = [self.host_span(h) for h in host_blocks]  # checks every id
        if self._slices is None:
            return spans
        self._slices.cut(host_blocks, self._tensor(staging_at, len(host_blocks)))
        size = self.value_bytes
        return [
            Span(staging_at + i * size, size)
            for i in range(len(host_blocks) * len(self.names))
        ]

    def land(
        self, payloads_at: int, rows: Sequence[int], host_blocks: Sequence[int]
    ) -> None:
        """Copies the fetched values of block row `rows[i]` of the payloads at
        `payloads_at` into `host_blocks[i]`."""
        if self._slices is None:
            for row, host_block in zip(rows, host_blocks, strict=True):
                target = self.host_span(host_block)
                ctypes.memmove(
                    target.address, payloads_at + row * self.block_bytes, target.size
                )
            return
        for host_block in host_blocks:
            self.host_span(host_block)
        fetched = self._tensor(payloads_at, max(rows) + 1)
        self._slices.join(fetched[list(rows)], host_blocks)

    def _tensor(self, address: int, blocks: int) -> torch.Tensor:
        """uint8 `[blocks, values, value_bytes]` over memory at `address`."""
        size = blocks * self.block_bytes
        memory = (ctypes.c_uint8 * size).from_address(address)
        flat = torch.frombuffer(memory, dtype=torch.uint8, count=size)
        return flat.view(blocks, len(self.names), self.value_bytes)
