"""On CUDA, a host buffer CUDA did not pin is reached through the pinned bounce buffer:
every backend picks it for both directions, and a whole engine step (loads waited for
layer by layer, stores from the layer hooks, a load and a store sharing the bounce rows,
batches larger than the bounce buffer) lands byte-exact. Needs no vLLM: part of the GPU
transfer check (`scripts/gpu_transfer_check.sh`); skipped without a GPU (the host hop
is tested on CPU in tests/unit/test_bounce_copy.py)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, block_bytes, make_kv_caches
from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.worker.copiers import bounce
from vllm_cpu_offload.worker.copiers.bounce import BounceBlockCopier
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.transfer_engine import FinishedJobs, TransferEngine

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")

NUM_BLOCKS, HOST_BLOCKS, BOUNCE_BLOCKS = 24, 20, 3


def _host_bytes(host: HostBuffer, name: str, h: int) -> torch.Tensor:
    return host.layer_view(name)[h].cpu()


@pytest.mark.parametrize("backend", ["auto", "triton", "dma"])
@pytest.mark.parametrize("layout", ["LBHNC", "2N_NHD"])
def test_engine_step_through_the_bounce_buffer(
    backend: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, block_dim = make_kv_caches(layout, num_blocks=NUM_BLOCKS)
    host = HostBuffer.for_kv_caches(caches, HOST_BLOCKS, pin=False)
    assert not host.pinned
    monkeypatch.setattr(bounce, "BOUNCE_BYTES", BOUNCE_BLOCKS * host.block_bytes)
    engine = TransferEngine(caches, host, backend=backend)
    assert isinstance(engine.copiers.loads, BounceBlockCopier)
    assert engine.copiers.stores is engine.copiers.loads
    assert engine.copiers.loads.bounce_blocks == BOUNCE_BLOCKS
    tier = torch.randint(0, 256, host.tensor.shape, dtype=torch.uint8)
    host.tensor.copy_(tier)

    # One step: 7 blocks loaded (3 chunks) while 8 others are stored (3 chunks).
    load_d, load_h = [20, 3, 11, 0, 17, 6, 9], [1, 4, 5, 8, 12, 15, 19]
    store_d, store_h = [2, 5, 7, 10, 13, 16, 21, 23], [0, 2, 3, 6, 7, 9, 10, 11]
    loads, stores = (
        [BlockTransfer(1, load_d, load_h)],
        [BlockTransfer(2, store_d, store_h)],
    )
    engine.begin_step()
    engine.start_loads(loads)
    for name in caches:
        engine.wait_for_layer_load(name)
        engine.store_layer(name, stores)
    engine.finish_step()
    engine.wait_all()
    assert engine.poll_finished() == FinishedJobs(stores={2}, loads={1})

    for name, t in caches.items():
        for d, h in zip(load_d, load_h, strict=True):
            assert torch.equal(
                block_bytes(t, block_dim, d),
                tier[h].view(-1)[
                    host.slot_offsets[name] : host.slot_offsets[name]
                    + host.layouts[name].block_bytes
                ],
            ), f"load of host block {h} into {d}, {name}"
        for d, h in zip(store_d, store_h, strict=True):
            assert torch.equal(_host_bytes(host, name, h), block_bytes(t, block_dim, d))
    untouched = sorted(set(range(HOST_BLOCKS)) - set(store_h))
    assert torch.equal(host.tensor[untouched], tier[untouched])
