"""Which copiers a worker uses, and the start-up check each must pass first.

On the CPU platform, torch views both ways. On CUDA, by `copy_backend`:

    "triton"  kernels both ways
    "dma"     the copy engines both ways (a copier for each direction)
    "staged"  whole blocks through device staging, both ways
    "auto"    kernels for loads (one cheap launch per layer, inside the step); stores
              on the copy engines where every run is at least `DMA_MIN_RUN_BYTES`
              (they leave the forward's SMs alone), else on the kernels

A host buffer CUDA could not pin (a `--swap-space-path` tier on a disk file system)
is reached through a pinned bounce buffer (`bounce.py`) by the same kernels or copy
engines.

A candidate that cannot be built, or fails the start-up check, gives way to the next
(copy engines, then kernels, then torch copies: slower, still correct).

The start-up check proves that a copier writes host memory where the layout says
(kernels address pinned memory through its host pointer, which needs a GPU and platform
with unified addressing) and reads it back. It runs a probe copier, built by the same
factory, over a scratch buffer of one block with the same layouts: device block 0 goes
to the scratch block and comes back unchanged. It never writes a host block, which with
`--swap-space-path` may hold a block restored from a previous run; running both
directions compiles a kernel copier's kernels before serving instead of in a step.

The CUDA copiers are a table of names (`CUDA_COPIERS`), each imported when it is a
candidate: the CPU platform imports none of them, and a tier built without one falls
back as if it had failed its check. Imports torch; triton only when its kernels are a
candidate.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_cpu_offload.worker.copiers.base import (
    BlockCopier,
    finish_on_host,
    ids_on_host,
)
from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier
from vllm_cpu_offload.worker.host_buffer import HostBuffer

logger = logging.getLogger(__name__)

# With backend "auto", stores go to the copy engines when every run is at least this
# long, else to the Triton kernels. Measured on an H100 (`benchmarks/transfer.py
# --run-sweep`): over 8 streams the copy engines match the kernel from 32 KiB runs up
# (47-50 GB/s) and beat it from 128 KiB (52 vs 40-45), but collapse below 32 KiB (3-14
# GB/s); at 32 KiB a scattered batch also costs the host a microsecond per 32 KiB. Whole
# blocks of a layer-compact layout go as one pitched copy each, whatever the run.
DMA_MIN_RUN_BYTES = 64 << 10

# The CUDA copiers by name: "module:class", imported when a candidate needs it.
CUDA_COPIERS: dict[str, str] = {
    "triton": f"{__package__}.triton_kernels:TritonBlockCopier",
    "dma": f"{__package__}.dma:DmaBlockCopier",
    "staged": f"{__package__}.staged:StagedBlockCopier",
    "bounce": f"{__package__}.bounce:BounceBlockCopier",
}

Caches = Mapping[str, torch.Tensor]
# Builds a copier between these caches and this host buffer; raises if it cannot.
CopierFactory = Callable[[Caches, HostBuffer], BlockCopier]
Candidate = tuple[str, CopierFactory]


@dataclass(frozen=True)
class Copiers:
    """The copier of each direction (the same object when one serves both)."""

    loads: BlockCopier
    stores: BlockCopier


def select_copiers(
    caches: Caches,
    host: HostBuffer,
    backend: str = "auto",
    *,
    candidates: Sequence[Candidate] | None = None,
) -> Copiers:
    """The copiers for `backend` on the caches' platform; see the module docstring.

    `candidates` replaces the platform's choice with these (first that passes the
    check serves both ways), and runs the start-up check on any platform: how tests
    reach the check without a GPU.
    """
    if candidates is not None:
        copier = first_passing(caches, host, candidates) or TorchBlockCopier(
            caches, host
        )
        return Copiers(copier, copier)
    device = next(iter(caches.values())).device
    if device.type != "cuda":
        copier = TorchBlockCopier(caches, host)
        return Copiers(copier, copier)
    if not host.pinned:
        bounce = first_passing(caches, host, [("pinned bounce", _bounce(backend))])
        if bounce is None:
            logger.warning(
                "KV offload copies use torch copies: the host buffer is not pinned"
            )
            bounce = TorchBlockCopier(caches, host)
        return Copiers(bounce, bounce)
    if backend == "staged":
        staged = first_passing(caches, host, [("staged", _staged)])
        if staged is not None:
            return Copiers(staged, staged)
    shortest_run = min(host.layouts[n].chunk_bytes for n in caches)
    dma_stores = backend == "dma" or (
        backend == "auto" and shortest_run >= DMA_MIN_RUN_BYTES
    )
    loads = _kernels_or_dma(caches, host, dma=backend == "dma")
    if not dma_stores:
        return Copiers(loads, loads)
    # A copier of its own even when both are DMA: a DMA copier forks over its own
    # streams, and a load queued there would wait behind the stores queued before it.
    return Copiers(loads, _kernels_or_dma(caches, host, dma=True))


def first_passing(
    caches: Caches, host: HostBuffer, candidates: Sequence[Candidate]
) -> BlockCopier | None:
    """The first candidate that builds and passes the start-up check, if any."""
    for name, make in candidates:
        try:
            if not passes_start_up_check(make, caches, host):
                logger.warning("%s block copies failed their start-up check", name)
                continue
            copier = make(caches, host)
        except Exception as e:
            logger.info("%s block copies are unavailable: %s", name, e)
            continue
        logger.info("KV offload copies use %s", name)
        return copier
    return None


def passes_start_up_check(
    make: CopierFactory, caches: Caches, host: HostBuffer
) -> bool:
    """Whether a copier from `make` stores device block 0 of every layer where the
    layout says, into a one-block scratch buffer like `host` (never into `host`), and
    loads it back unchanged. Both directions run once here, so that a copier that
    compiles kernels on first use does so before serving, not inside a step."""
    scratch = HostBuffer(host.layouts, 1, pin=host.pinned)
    probe = make(caches, scratch)
    name, cache = next(iter(caches.items()))
    layout = scratch.layouts[name]
    zero = torch.zeros(
        1, dtype=torch.int64, device="cpu" if ids_on_host(probe) else cache.device
    )
    # Every layer at once, the way stores go.
    finish_on_host(probe.copy(True, zero, zero, None))
    _synchronize(cache)
    # A copy even on CPU, where .cpu() would return a view of the block itself.
    expected = layout.block_view(cache, 0).reshape(-1).to("cpu", copy=True)
    if not torch.equal(scratch.layer_view(name)[0], expected):
        return False
    # The same bytes back into the block they came from: the caches are unchanged.
    finish_on_host(probe.copy(False, zero, zero, None))
    _synchronize(cache)
    return torch.equal(layout.block_view(cache, 0).cpu().reshape(-1), expected)


def _synchronize(cache: torch.Tensor) -> None:
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)


def _kernels_or_dma(caches: Caches, host: HostBuffer, *, dma: bool) -> BlockCopier:
    """The copy engines if asked for and they work, else Triton kernels, else torch
    copies."""
    candidates: list[Candidate] = [("DMA", _dma)] if dma else []
    candidates.append(("Triton", _triton))
    copier = first_passing(caches, host, candidates)
    if copier is not None:
        return copier
    logger.warning(
        "KV offload copies fall back to torch copies (slower, still correct)"
    )
    return TorchBlockCopier(caches, host)


def cuda_copier(name: str) -> Any:
    """The copier class `CUDA_COPIERS` names.

    Raises:
        RuntimeError: this tier has no such copier (the candidate is skipped).

    """
    path = CUDA_COPIERS.get(name)
    if path is None:
        raise RuntimeError(f"no {name} copier in this build")
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def _bounce(backend: str) -> CopierFactory:
    """Copies for an unpinned host buffer through a pinned one (`bounce.py`), whose
    device hop is the kernels or, if asked for, the copy engines."""

    def make(caches: Caches, host: HostBuffer) -> BlockCopier:
        return cuda_copier("bounce")(
            caches,
            host,
            lambda c, pinned: _kernels_or_dma(c, pinned, dma=backend == "dma"),
        )

    return make


def _staged(caches: Caches, host: HostBuffer) -> BlockCopier:
    staged = cuda_copier("staged")
    try:
        return staged(caches, host, gather="dma")
    except RuntimeError:  # no layer-compact layout: gather with the kernels
        return staged(caches, host, gather="kernel")


def _dma(caches: Caches, host: HostBuffer) -> BlockCopier:
    return cuda_copier("dma")(caches, host)


def _triton(caches: Caches, host: HostBuffer) -> BlockCopier:
    # Triton only where its kernels are a candidate: the CPU platform runs without it.
    return cuda_copier("triton")(caches, host)
