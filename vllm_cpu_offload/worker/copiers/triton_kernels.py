"""Triton kernels that copy scattered KV blocks between device memory and the host
buffer.

One launch copies a batch of (device block, host block) pairs for any set of layers that
share one `KVLayout`, in either direction: every layer of a step's stores, or one layer
of a step's loads. The data moves as raw integer words (the widest of 8/4/2/1 bytes that
every address, stride and run length allows), so bf16, fp16, fp8 and fp32 caches are all
the same to it. Host memory is pinned and mapped, so the kernel reads and writes it
directly: no staging copy, and one launch instead of one DMA per block.

Imports torch and triton only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.kv_layout import KVLayout

# A launch runs a fixed number of programs that stride over its work items: PCIe, not
# the SMs, bounds the copy, and every SM a copy holds is one the forward pass beside it
# loses. Measured on an H100 (PCIe 5.0 x16), 128 scattered blocks of a Llama-3-8B cache:
# 16 to 32 programs of 1024 8-byte words and 4 warps copy as fast as a grid of one
# program per 8 KiB (about 48 GB/s device->host, 46 GB/s host->device), 8 programs lose
# a quarter of the host->device rate, and a concurrent GEMM slows by about 1.3-1.5x
# beside 16-32 programs against 6x beside the full grid. `benchmarks/transfer.py
# --sweep` re-measures these.
BLOCK_WORDS = 1024
NUM_WARPS = 4
NUM_PROGRAMS = 32

_TL_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}

# Arguments that change from launch to launch but only bound loops or feed scalar
# loads: were Triton to specialize on them (a value of 1, a multiple of 16, a 16-byte
# aligned address: a slice of the layer table starting at an odd layer is not), every
# new combination would compile a kernel the first time a step met it, a stall of about
# a second in the forward pass. Unspecialized, a layout has one kernel per direction,
# both compiled by the start-up check. `host_addr` is typed int64: left to Triton, an
# address under 2**31 (the check's small scratch buffer can have one) would be an i32
# and compile a kernel of its own.
_VARYING_ARGS = (
    "layer_addrs",
    "slot_offsets",
    "device_ids",
    "host_ids",
    "num_items",
    "num_layers",
)


@triton.jit(
    do_not_specialize=_VARYING_ARGS, do_not_specialize_on_alignment=_VARYING_ARGS
)
def _copy_blocks_kernel(
    layer_addrs,  # int64[num_layers]: address of each layer's device KV data
    slot_offsets,  # int64[num_layers]: word offset of each layer's slot in a host block
    host_addr: tl.int64,  # address of host block 0
    device_ids,  # int64[num_pairs]
    host_ids,  # int64[num_pairs]
    num_items,  # pairs * layers * runs * tiles
    num_layers,
    num_chunks,  # runs per block
    num_tiles,  # BLOCK-word tiles per run
    block_stride,  # words between device blocks
    chunk_stride,  # words between the runs of one device block
    chunk_words,  # words per run
    host_block_words,  # words per host block
    WORD: tl.constexpr,
    TO_HOST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.arange(0, BLOCK)
    # Widened anyway: a Triton that ignored the annotation would pass a low address
    # as i32.
    host_base = host_addr.to(tl.int64).to(tl.pointer_type(WORD))
    # Items in (pair, layer, run, tile) order: neighbouring programs write neighbouring
    # bytes of one host block.
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        tile = item % num_tiles
        rest = item // num_tiles
        chunk = (rest % num_chunks).to(tl.int64)
        rest = rest // num_chunks
        layer = rest % num_layers
        pair = rest // num_layers
        device_block = tl.load(device_ids + pair)
        host_block = tl.load(host_ids + pair)
        device = tl.load(layer_addrs + layer).to(tl.pointer_type(WORD))
        device = device + device_block * block_stride + chunk * chunk_stride
        host = host_base + host_block * host_block_words + tl.load(slot_offsets + layer)
        host = host + chunk * chunk_words
        idx = tile * BLOCK + offsets
        mask = idx < chunk_words
        if TO_HOST:
            tl.store(host + idx, tl.load(device + idx, mask=mask), mask=mask)
        else:
            tl.store(device + idx, tl.load(host + idx, mask=mask), mask=mask)


def word_bytes(*byte_counts: int) -> int:
    """Widest copy word (8, 4, 2 or 1 bytes) dividing every address, stride and size
    given."""
    return math.gcd(8, *byte_counts)


class _LayoutGroup:
    """Layers that share one layout: one launch covers any subset given by index
    range."""

    def __init__(
        self,
        layout: KVLayout,
        names: list[str],
        tensors: list[torch.Tensor],
        host: HostBuffer,
    ) -> None:
        self.layout = layout
        self.names = names
        host_addr = host.tensor.data_ptr()
        addrs = [t.data_ptr() for t in tensors]
        slots = [host.slot_offsets[n] for n in names]
        word = word_bytes(
            layout.block_stride,
            layout.chunk_stride,
            layout.chunk_bytes,
            host.block_bytes,
            host_addr,
            *addrs,
            *slots,
        )
        self.word = word
        self.tl_word = _TL_WORDS[word]
        self.host_addr = host_addr
        self.host_block_words = host.block_bytes // word
        device = tensors[0].device
        self.layer_addrs = torch.tensor(addrs, dtype=torch.int64, device=device)
        self.slot_offsets = torch.tensor(
            [s // word for s in slots], dtype=torch.int64, device=device
        )
        self.chunk_words = layout.chunk_bytes // word
        self.num_tiles = triton.cdiv(self.chunk_words, BLOCK_WORDS)

    def launch(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        lo: int,
        hi: int,
    ) -> None:
        num_pairs = device_ids.numel()
        if num_pairs == 0 or hi <= lo:
            return
        layout, word = self.layout, self.word
        num_items = num_pairs * (hi - lo) * layout.num_chunks * self.num_tiles
        _copy_blocks_kernel[(min(NUM_PROGRAMS, num_items),)](
            self.layer_addrs[lo:hi],
            self.slot_offsets[lo:hi],
            self.host_addr,
            device_ids,
            host_ids,
            num_items,
            hi - lo,
            layout.num_chunks,
            self.num_tiles,
            layout.block_stride // word,
            layout.chunk_stride // word,
            self.chunk_words,
            self.host_block_words,
            WORD=self.tl_word,
            TO_HOST=to_host,
            BLOCK=BLOCK_WORDS,
            num_warps=NUM_WARPS,
        )


class TritonBlockCopier:
    """Copies blocks between the device KV caches and a `HostBuffer` with Triton
    kernels.

    `kv_caches` holds the layers that own a host slot (one tensor per distinct cache).
    Launches go to the current stream; callers pick the stream. Block ids must be int64
    tensors on the caches' device, already validated against both block counts.
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], host: HostBuffer) -> None:
        self._groups = [
            _LayoutGroup(
                host.layouts[names[0]], names, [kv_caches[n] for n in names], host
            )
            for names in host.layout_groups(kv_caches)
        ]
        self._where = {
            name: (group, i)
            for group in self._groups
            for i, name in enumerate(group.names)
        }

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> None:
        """Copies block `device_ids[i]` <-> host block `host_ids[i]` for the given
        layers.

        One launch per layout group covers all layers; a single named layer is one
        launch.
        """
        if layers is None:
            for group in self._groups:
                group.launch(to_host, device_ids, host_ids, 0, len(group.names))
            return
        for name in layers:
            group, i = self._where[name]
            group.launch(to_host, device_ids, host_ids, i, i + 1)
