"""The transfer engine over the CPU copier's helper threads: a copy that raises on
one thread fails its job alone."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_cpu_copy import (  # noqa: F401 - split_everything is a fixture
    NUM_HOST_BLOCKS,
    _caches,
    _device_block,
    split_everything,
)
from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.worker.copiers import torch_views
from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.transfer_engine import FinishedJobs, TransferEngine


@pytest.mark.usefixtures("split_everything")
@pytest.mark.parametrize("direction", ["store", "load"])
def test_engine_fails_the_job_whose_shared_copy_raises(
    direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Any thread's copy of device block 30 raises: the shared batch raises, the engine
    # retries job by job, and only the job holding block 30 fails.
    caches = _caches()
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    host.tensor.copy_(torch.randint(0, 256, host.tensor.shape, dtype=torch.uint8))
    engine = TransferEngine(
        caches, host, copier=TorchBlockCopier(caches, host, threads=2)
    )
    copy = torch_views._copy

    def failing_copy(
        to_host: bool, dev: torch.Tensor, hv: torch.Tensor, d: int, h: int, n: int
    ) -> None:
        if d <= 30 < d + n:
            raise RuntimeError("injected copy failure")
        copy(to_host, dev, hv, d, h, n)

    monkeypatch.setattr(torch_views, "_copy", failing_copy)
    jobs = [
        BlockTransfer(1, list(range(30)), list(range(30))),
        BlockTransfer(2, [30], [40]),
    ]
    if direction == "store":
        engine.store_layer("model.layers.0.attn", jobs)
        engine.finish_step()
        assert engine.poll_finished() == FinishedJobs(stores={1}, failed={2})
    else:
        engine.start_loads(jobs)
        engine.finish_step()
        assert engine.poll_finished() == FinishedJobs(loads={1}, failed={2})
    for name, t in caches.items():
        for b in range(30):
            assert torch.equal(host.layer_view(name)[b], _device_block(t, b))
