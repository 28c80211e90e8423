"""The copiers' start-up check: it proves a copier before any job, and it never writes
a host block, which a tier restored from `--swap-space-path` may already hold.

On CUDA the check runs for every kernel or copy-engine copier; here it is reached
through the same path (`select_copiers` with candidates) with torch copiers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm_cpu_offload.block_transfer import BlockTransfer  # noqa: E402
from vllm_cpu_offload.metadata import OffloadStepMetadata  # noqa: E402
from vllm_cpu_offload.persist.data_file import TierDataFile  # noqa: E402
from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier  # noqa: E402
from vllm_cpu_offload.worker.host_buffer import HostBuffer  # noqa: E402
from vllm_cpu_offload.worker.tier_worker import HostTierWorker  # noqa: E402
from vllm_cpu_offload.worker.transfer_engine import TransferEngine  # noqa: E402

LAYERS, BLOCKS, HOST_BLOCKS = 2, 8, 4
FINGERPRINT = {"model": "m", "dtype": "torch.float32"}
WORKER = "tp0-pp0"


def _caches(seed: int) -> dict[str, torch.Tensor]:
    # vLLM's CPU layout: [blocks, kv_heads, block_size, 2 * head_dim] per layer.
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(BLOCKS, 2, 4, 16, generator=g) for i in range(LAYERS)}


def _step(worker: HostTierWorker, meta: OffloadStepMetadata) -> None:
    worker.begin_step(meta)
    worker.start_loads(meta)
    for i in range(LAYERS):
        worker.wait_for_layer_load(f"l{i}")
        worker.save_layer(f"l{i}")
    worker.finish_step()
    worker.get_finished()


class _Recording:
    """A copier factory that records the host buffer of every copier it builds."""

    def __init__(self) -> None:
        self.hosts: list[HostBuffer] = []

    def __call__(
        self, caches: Mapping[str, torch.Tensor], host: HostBuffer
    ) -> TorchBlockCopier:
        self.hosts.append(host)
        return TorchBlockCopier(caches, host)


def test_the_check_leaves_a_restored_block_zero_as_it_was(tmp_path: Path) -> None:
    # Engine 1 stores device block 3 into host block 0 (the pool hands out low ids
    # first) and stops; its tier stays in the files.
    first = _caches(seed=1)
    stored = {name: t[3].clone() for name, t in first.items()}
    worker = HostTierWorker(
        HOST_BLOCKS, BLOCKS, memory=TierDataFile(str(tmp_path), WORKER, FINGERPRINT)
    )
    worker.register_kv_caches(first)
    _step(worker, OffloadStepMetadata(stores=[BlockTransfer(1, [3], [0], "a")]))
    assert worker.engine is not None
    block_zero = worker.engine.host.tensor[0].clone()
    worker.shutdown()

    # Engine 2 starts on the same tier with other device memory (its block 0 differs
    # from what block 0 holds); its copiers go through the start-up check.
    second = _caches(seed=2)
    factory = _Recording()
    data_file = TierDataFile(str(tmp_path), WORKER, FINGERPRINT)
    worker = HostTierWorker(
        HOST_BLOCKS,
        BLOCKS,
        memory=data_file,
        copier_candidates=[("torch views", factory)],
    )
    worker.register_kv_caches(second)
    assert worker.engine is not None
    host = worker.engine.host
    assert data_file.rebuilt_because is None  # the tier was kept
    assert torch.equal(host.tensor[0], block_zero)
    # The check ran: a probe over a one-block scratch buffer, then the real copier.
    assert len(factory.hosts) == 2
    probe_host, real_host = factory.hosts
    assert probe_host is not host and probe_host.num_slots == 1
    assert real_host is host
    # A hit on host block 0 loads what engine 1 stored.
    _step(worker, OffloadStepMetadata(loads=[BlockTransfer(2, [5], [0], "b")]))
    for name, t in second.items():
        assert torch.equal(t[5], stored[name]), name
    worker.shutdown()


class _Faulty:
    """A copier with a fault the check exists to catch: `inner` copies (None: nothing
    lands anywhere), then `after(to_host, device_ids)` runs."""

    def __init__(
        self,
        inner: TorchBlockCopier | None = None,
        after: Callable[[bool, torch.Tensor], None] | None = None,
    ) -> None:
        self._inner = inner
        self._after = after

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> None:
        if self._inner is not None:
            self._inner.copy(to_host, device_ids, host_ids, layers)
        if self._after is not None:
            self._after(to_host, device_ids)


def test_a_copier_that_fails_the_check_gives_way_to_the_next() -> None:
    caches = _caches(seed=3)
    host = HostBuffer.for_kv_caches(caches, HOST_BLOCKS)
    before = host.tensor.clone()
    engine = TransferEngine(
        caches,
        host,
        candidates=[
            ("writes nothing", lambda c, h: _Faulty()),
            ("torch views", TorchBlockCopier),
        ],
    )
    assert isinstance(engine.copiers.loads, TorchBlockCopier)
    assert engine.copiers.stores is engine.copiers.loads
    assert torch.equal(host.tensor, before)  # no check wrote the host buffer


def _loads_off_by_one(caches: Mapping[str, torch.Tensor], host: HostBuffer) -> _Faulty:
    """A copier that stores right and loads wrong bytes (each loaded block + 1)."""

    def after(to_host: bool, device_ids: torch.Tensor) -> None:
        if not to_host:
            for t in caches.values():
                for block in device_ids.tolist():
                    t[block].add_(1)

    return _Faulty(TorchBlockCopier(caches, host), after)


def test_the_check_loads_too_and_leaves_the_caches_as_they_were() -> None:
    # The check runs both directions before serving (a copier that compiles kernels
    # compiles both there); a copier whose loads are wrong gives way, and one that
    # passes leaves every device block as it found it.
    caches = _caches(seed=4)
    before = {name: t.clone() for name, t in caches.items()}
    host = HostBuffer.for_kv_caches(caches, HOST_BLOCKS)
    engine = TransferEngine(
        caches, host, candidates=[("torch views", TorchBlockCopier)]
    )
    assert isinstance(engine.copiers.loads, TorchBlockCopier)
    for name, t in caches.items():
        assert torch.equal(t, before[name]), name
    engine = TransferEngine(
        caches,
        host,
        candidates=[
            ("loads off by one", _loads_off_by_one),
            ("torch views", TorchBlockCopier),
        ],
    )
    assert isinstance(engine.copiers.loads, TorchBlockCopier)
