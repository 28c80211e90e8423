"""BounceBlockCopier's host hop on CPU tensors: batches larger than the bounce buffer go
in chunks, only the layers asked for move, the tier ends byte-exact with what a direct
copier writes, a store's host hop (on a thread of its own) is waited for by the next
copy and by the engine, and its failure fails the store's jobs. The device hop and its
streams are checked on CUDA (tests/kernels/test_bounce_copy_cuda.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent import futures

import pytest
import torch

from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.worker.copiers.bounce import BounceBlockCopier
from vllm_cpu_offload.worker.copiers.select import (
    Copiers,
    passes_start_up_check,
    select_copiers,
)
from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.transfer_engine import FinishedJobs, TransferEngine

NUM_LAYERS, NUM_BLOCKS, NUM_HOST_BLOCKS = 3, 32, 24


def _caches(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (NUM_LAYERS, NUM_BLOCKS, 2, 4, 16), dtype=torch.int16, generator=gen
    )
    return {f"model.layers.{i}.attn": raw[i] for i in range(NUM_LAYERS)}


def _bounce(
    caches: dict[str, torch.Tensor], host: HostBuffer, blocks: int
) -> BounceBlockCopier:
    return BounceBlockCopier(caches, host, TorchBlockCopier, bounce_blocks=blocks)


@pytest.mark.parametrize("bounce_blocks", [1, 3, 64])
def test_store_and_load_match_a_direct_copier(bounce_blocks: int) -> None:
    caches = _caches(0)
    direct_host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS, pin=False)
    bounced_host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS, pin=False)
    direct_host.tensor.fill_(7)
    bounced_host.tensor.fill_(7)
    copier = _bounce(caches, bounced_host, bounce_blocks)
    assert copier.bounce_blocks == min(bounce_blocks, NUM_HOST_BLOCKS)
    gen = torch.Generator().manual_seed(1)
    d = torch.randperm(NUM_BLOCKS, generator=gen)[:10]
    h = torch.randperm(NUM_HOST_BLOCKS, generator=gen)[:10]

    TorchBlockCopier(caches, direct_host).copy(True, d, h)
    work = copier.copy(True, d, h)
    assert work is not None
    work.synchronize()
    assert work.query()
    assert torch.equal(bounced_host.tensor, direct_host.tensor)

    # Loaded back into other device blocks of wiped caches: the same bytes arrive.
    expected = {n: t[d].clone() for n, t in caches.items()}
    for t in caches.values():
        t.zero_()
    targets = torch.randperm(NUM_BLOCKS, generator=gen)[:10]
    copier.copy(False, targets, h)
    for name, t in caches.items():
        assert torch.equal(t[targets], expected[name])
    untouched = torch.ones(NUM_BLOCKS, dtype=torch.bool)
    untouched[targets] = False
    assert all(int(t[untouched].abs().sum()) == 0 for t in caches.values())


def test_a_layer_subset_leaves_the_other_slots_alone() -> None:
    caches = _caches(2)
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS, pin=False)
    host.tensor.fill_(7)
    copier = _bounce(caches, host, 2)
    names = list(caches)
    d, h = torch.tensor([5, 1, 9]), torch.tensor([4, 0, 11])

    work = copier.copy(True, d, h, [names[1]])
    assert work is not None
    work.synchronize()
    for i, name in enumerate(names):
        rows = host.layer_view(name)[h]
        if i == 1:
            expected = caches[name][d].contiguous().view(3, -1).view(torch.uint8)
            assert torch.equal(rows, expected)
        else:
            assert bool((rows == 7).all()), f"layer {name} was written"

    before = {n: t.clone() for n, t in caches.items()}
    copier.copy(False, torch.tensor([2, 3, 4]), h, [names[1]])
    assert torch.equal(caches[names[1]][[2, 3, 4]], before[names[1]][d])
    for name in (names[0], names[2]):
        assert torch.equal(caches[name], before[name])


def test_loads_reuse_the_bounce_rows_without_mixing_chunks() -> None:
    # Seven blocks through one bounce row: each chunk's load must land before the next
    # chunk overwrites the row.
    caches = _caches(3)
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS, pin=False)
    h = torch.arange(7)
    for i in range(7):
        host.tensor[i].fill_(i + 1)
    copier = _bounce(caches, host, 1)
    d = torch.tensor([30, 2, 17, 8, 0, 25, 11])
    copier.copy(False, d, h)
    for i, block in enumerate(d.tolist()):
        for t in caches.values():
            assert bool((t[block].view(torch.uint8) == i + 1).all())


def test_unpinned_buffer_on_cpu_keeps_the_torch_copier() -> None:
    # The bounce path is CUDA's; the CPU platform copies views directly.
    caches = _caches(4)
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS, pin=False)
    copiers = select_copiers(caches, host)
    assert isinstance(copiers, Copiers)
    assert isinstance(copiers.loads, TorchBlockCopier)


def test_a_load_after_a_store_reads_what_the_store_wrote() -> None:
    # No wait in between: the load waits for the store's host hop, which still uses
    # the bounce rows, so the tier rows it reads are written.
    caches = _caches(5)
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS, pin=False)
    copier = _bounce(caches, host, 2)
    d, h = torch.tensor([4, 12, 7, 30, 21]), torch.tensor([3, 9, 0, 17, 5])
    stored = {n: t[d].clone() for n, t in caches.items()}
    copier.copy(True, d, h)
    targets = torch.tensor([1, 2, 3, 5, 6])
    copier.copy(False, targets, h)
    for name, t in caches.items():
        assert torch.equal(t[targets], stored[name])


def test_the_engine_waits_for_host_hops_and_fails_a_failed_one() -> None:
    caches = _caches(6)
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS, pin=False)
    host.tensor.zero_()
    copier = _bounce(caches, host, 4)
    engine = TransferEngine(caches, host, copier=copier)
    engine.store_layer(next(iter(caches)), [BlockTransfer(1, [8, 3], [2, 6])])
    engine.finish_step()
    assert engine.poll_finished() == FinishedJobs(stores={1})
    name = next(iter(caches))
    for d, h in ((8, 2), (3, 6)):
        expected = caches[name][d].contiguous().view(-1).view(torch.uint8)
        assert torch.equal(host.layer_view(name)[h], expected)

    # A hop whose tier rows cannot take the copy: its store's job fails, not the next.
    views = copier._row_views

    def broken(
        layers: object, *, words: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs = views(None, words=words)
        return [(tier[:1], bounce) for tier, bounce in pairs] if words else pairs

    copier._row_views = broken  # type: ignore[method-assign]
    engine.store_layer(name, [BlockTransfer(2, [5], [11])])
    engine.finish_step()
    copier._row_views = views  # type: ignore[method-assign]
    engine.start_loads([BlockTransfer(3, [9], [2])])
    finished = engine.poll_finished()
    assert finished.failed == {2}
    assert finished.loads == {3}
    assert torch.equal(caches[name][9], caches[name][8])


class _Deferred(futures.Future[None]):
    """A host hop that runs only when someone waits for it: a hop that nobody waits
    for never lands, whatever the timing."""

    def __init__(self, fn: Callable[[], None]) -> None:
        super().__init__()
        self._fn = fn

    def _run(self) -> None:
        if not self.done():
            try:
                self._fn()
                self.set_result(None)
            except Exception as e:
                self.set_exception(e)

    def result(self, timeout: float | None = None) -> None:
        self._run()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._run()
        return super().exception(timeout)


class _DeferredHops:
    def submit(self, fn: Callable[[], None]) -> _Deferred:
        return _Deferred(fn)


def test_the_start_up_check_waits_for_the_host_hop() -> None:
    # The check reads the scratch block right after the store: it must wait for the
    # store's host hop (here one that lands only when waited for).
    caches = _caches(7)
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS, pin=False)

    def make(c: Mapping[str, torch.Tensor], buffer: HostBuffer) -> BounceBlockCopier:
        copier = BounceBlockCopier(c, buffer, TorchBlockCopier, bounce_blocks=2)
        copier._hops = _DeferredHops()  # type: ignore[assignment]
        return copier

    assert passes_start_up_check(make, caches, host)
