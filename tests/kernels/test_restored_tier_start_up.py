"""A transfer engine that starts on a restored tier leaves its blocks as they were.

With `--swap-space-path` host block 0 often holds a live block after a restart (the pool
hands out low ids first). Every backend's copiers pass a start-up check before their
first job; on CUDA this runs each of them (kernels, copy engines, staged), here the same
check through injected torch copiers. Needs no vLLM: part of the GPU transfer check
(`scripts/gpu_transfer_check.sh`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.kernels.conftest import DEVICE, make_kv_caches
from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.persist.data_file import TierDataFile
from vllm_cpu_offload.worker.copiers.select import Candidate
from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.transfer_engine import TransferEngine

HOST_BLOCKS = 4
FINGERPRINT = {"model": "m"}
WORKER = "tp0-pp0"
BACKENDS = ("auto", "triton", "dma", "staged") if DEVICE == "cuda" else ("checked",)


def _engine(
    caches: dict[str, torch.Tensor], host: HostBuffer, backend: str
) -> TransferEngine:
    candidates: list[Candidate] | None = None
    if backend == "checked":  # no GPU: the check of the CUDA path, with torch copies
        candidates = [("torch views", TorchBlockCopier)]
        backend = "auto"
    return TransferEngine(caches, host, backend=backend, candidates=candidates)


def _finish(engine: TransferEngine) -> None:
    engine.finish_step()
    engine.wait_all()
    finished = engine.poll_finished()
    assert not finished.failed


@pytest.fixture(params=["disk", "tmpfs"])
def tier_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A tier directory on the test's own file system and one on /dev/shm: on CUDA,
    recent kernels pin a tmpfs mapping but not one of a disk file, so the two take
    different copiers (the pinned ones, or torch copies)."""
    if request.param == "disk":
        yield tmp_path
        return
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="kv-tier-test-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_up_leaves_restored_blocks_and_reads_them_back(
    tier_dir: Path, backend: str
) -> None:
    caches, _ = make_kv_caches("LBHNC", device=DEVICE)
    data_file = TierDataFile(str(tier_dir), WORKER, FINGERPRINT)
    host = HostBuffer.for_kv_caches(caches, HOST_BLOCKS, memory=data_file)
    assert host.pinned == host.tensor.is_pinned()
    engine = _engine(caches, host, backend)
    engine.start_loads([])
    engine.store_layer(next(iter(caches)), [BlockTransfer(1, [3], [0])])
    _finish(engine)
    stored = {name: t[3].clone() for name, t in caches.items()}
    block_zero = host.tensor[0].clone()
    del engine, host
    data_file.close()

    # A restart: other device memory, the same tier.
    for t in caches.values():
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
    data_file = TierDataFile(str(tier_dir), WORKER, FINGERPRINT)
    host = HostBuffer.for_kv_caches(caches, HOST_BLOCKS, memory=data_file)
    assert data_file.rebuilt_because is None
    engine = _engine(caches, host, backend)
    assert torch.equal(host.tensor[0], block_zero)
    engine.start_loads([BlockTransfer(2, [5], [0])])
    for name in caches:
        engine.wait_for_layer_load(name)
    _finish(engine)
    for name, t in caches.items():
        assert torch.equal(t[5].cpu(), stored[name].cpu()), name
    data_file.close()
