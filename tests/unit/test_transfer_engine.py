"""TransferEngine: job bookkeeping and the CPU path (the CUDA stream path:
test_transfer_engine_cuda.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from vllm_cpu_offload.block_transfer import BlockTransfer
from vllm_cpu_offload.worker.copiers.base import (
    BlockCopier,
    HostWork,
    ids_on_host,
    loads_whole_blocks,
)
from vllm_cpu_offload.worker.copiers.torch_views import TorchBlockCopier, runs_of
from vllm_cpu_offload.worker.host_buffer import HostBuffer
from vllm_cpu_offload.worker.transfer_engine import FinishedJobs, TransferEngine

NUM_LAYERS, NUM_BLOCKS, NUM_HOST_BLOCKS = 3, 8, 6


def _caches(device: str = "cpu") -> dict[str, torch.Tensor]:
    """The CPU layout of vLLM (LBHNC): all layers in one buffer, [B, H, N, 2 * D] per
    layer."""
    raw = torch.randn(NUM_LAYERS, NUM_BLOCKS, 2, 4, 16, device=device).to(
        torch.bfloat16
    )
    return {f"model.layers.{i}.attn": raw[i] for i in range(NUM_LAYERS)}


def _engine(caches: dict[str, torch.Tensor], **kwargs: object) -> TransferEngine:
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    host.tensor.zero_()
    return TransferEngine(caches, host, **kwargs)  # type: ignore[arg-type]


def _host_block(engine: TransferEngine, name: str, h: int) -> torch.Tensor:
    return engine.host.layer_view(name)[h]


def _device_block(t: torch.Tensor, d: int) -> torch.Tensor:
    return t[d].contiguous().view(-1).view(torch.uint8).cpu()


def _store_step(
    engine: TransferEngine, names: Sequence[str], jobs: list[BlockTransfer]
) -> None:
    for name in names:
        engine.store_layer(name, jobs)
    engine.finish_step()


def test_store_step_reports_jobs_and_copies_every_layer() -> None:
    # Two store jobs, every layer's hook called: both finished, bytes on the host.
    caches = _caches()
    engine = _engine(caches)
    jobs = [
        BlockTransfer(7, [3, 4], [0, 1]),
        # Ids as int64 tensors, which the engine takes too (typed as the lists the
        # scheduler sends).
        BlockTransfer(8, torch.tensor([6]), torch.tensor([5])),  # type: ignore[arg-type]
    ]
    _store_step(engine, list(caches), jobs)
    assert engine.poll_finished() == FinishedJobs(stores={7, 8})
    for name, t in caches.items():
        for d, h in ((3, 0), (4, 1), (6, 5)):
            assert torch.equal(_host_block(engine, name, h), _device_block(t, d))
    assert engine.poll_finished() == FinishedJobs()  # reported once


def test_layers_without_a_hook_are_stored_at_finish_step() -> None:
    # Only one layer's hook ran (e.g. a captured graph): finish_step stores the rest.
    caches = _caches()
    engine = _engine(caches)
    _store_step(engine, ["model.layers.0.attn"], [BlockTransfer(1, [2], [3])])
    assert engine.poll_finished().stores == {1}
    for name, t in caches.items():
        assert torch.equal(_host_block(engine, name, 3), _device_block(t, 2))


def test_loads_are_synchronous_on_cpu() -> None:
    # Host -> device at start_loads; waiting for a layer is free; reported as loads.
    caches = _caches()
    engine = _engine(caches)
    engine.host.tensor.copy_(
        torch.randint(0, 256, engine.host.tensor.shape, dtype=torch.uint8)
    )
    engine.start_loads([BlockTransfer(3, [5, 1], [2, 4])])
    for name, t in caches.items():
        engine.wait_for_layer_load(name)
        assert torch.equal(_device_block(t, 5), _host_block(engine, name, 2))
        assert torch.equal(_device_block(t, 1), _host_block(engine, name, 4))
    engine.finish_step()
    assert engine.poll_finished() == FinishedJobs(loads={3})


def test_background_loads_copy_at_once_on_cpu_and_are_reported_once() -> None:
    # Loads that span steps need no step around them on CPU: copied when queued,
    # reported by the next poll, once.
    caches = _caches()
    engine = _engine(caches)
    engine.host.tensor.copy_(
        torch.randint(0, 256, engine.host.tensor.shape, dtype=torch.uint8)
    )
    engine.start_background_loads([BlockTransfer(4, [0, 7], [5, 3])])
    for name, t in caches.items():
        assert torch.equal(_device_block(t, 0), _host_block(engine, name, 5))
        assert torch.equal(_device_block(t, 7), _host_block(engine, name, 3))
    assert engine.poll_finished() == FinishedJobs(loads={4})
    assert engine.poll_finished() == FinishedJobs()


def test_bad_ids_fail_only_their_job() -> None:
    # Out-of-range and mismatched ids: those jobs fail, the good one finishes.
    caches = _caches()
    engine = _engine(caches)
    jobs = [
        BlockTransfer(1, [NUM_BLOCKS], [0]),
        BlockTransfer(2, [0], [NUM_HOST_BLOCKS]),
        BlockTransfer(3, [0, 1], [0]),
        BlockTransfer(4, [-1], [0]),
        BlockTransfer(5, [1], [1]),
    ]
    _store_step(engine, list(caches), jobs)
    assert engine.poll_finished() == FinishedJobs(stores={5}, failed={1, 2, 3, 4})


# Picks the copies to fail by their device block ids and layers.
FailsWhen = Callable[[torch.Tensor, Sequence[str] | None], bool]


class FailingCopier:
    """A copier that raises on the batches `fails` picks, and copies the others.

    It reads the block ids only where `fails` does: on CUDA they are on the device,
    and reading them on the host waits for the current stream (a held one hangs)."""

    def __init__(self, inner: BlockCopier, fails: FailsWhen) -> None:
        self.inner, self.fails = inner, fails
        self.ids_on_host = ids_on_host(inner)
        self.whole_block_loads = loads_whole_blocks(inner)

    def copy(
        self,
        to_host: bool,
        device_ids: torch.Tensor,
        host_ids: torch.Tensor,
        layers: Sequence[str] | None = None,
    ) -> HostWork | None:
        if self.fails(device_ids, layers):
            raise RuntimeError("injected copy failure")
        return self.inner.copy(to_host, device_ids, host_ids, layers)


def fails_on_block(block: int) -> FailsWhen:
    """Fails the copies of `block` (reads the ids on the host)."""
    return lambda device_ids, layers: block in device_ids.tolist()


def fails_at_layer(name: str) -> FailsWhen:
    """Fails the copies of layer `name`, all layers included (never reads the ids)."""
    return lambda device_ids, layers: layers is None or name in layers


@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_raising_copy_fails_its_job_not_the_step(direction: str) -> None:
    # The copy of job 2 raises: job 2 is failed, jobs 1 and 3 complete, nothing escapes.
    caches = _caches()
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    engine = TransferEngine(
        caches,
        host,
        copier=FailingCopier(TorchBlockCopier(caches, host), fails_on_block(4)),
    )
    jobs = [
        BlockTransfer(1, [0], [0]),
        BlockTransfer(2, [4], [1]),
        BlockTransfer(3, [5], [2]),
    ]
    if direction == "store":
        _store_step(engine, list(caches), jobs)
        assert engine.poll_finished() == FinishedJobs(stores={1, 3}, failed={2})
    else:
        engine.start_loads(jobs)
        engine.finish_step()
        assert engine.poll_finished() == FinishedJobs(loads={1, 3}, failed={2})


def test_shared_kv_cache_is_copied_once() -> None:
    # Two names view one cache: it has one slot, and its alias' hooks are harmless.
    caches = _caches()
    caches["model.layers.3.attn"] = caches["model.layers.0.attn"]
    engine = _engine(caches)
    assert len(engine.host.slot_offsets) == NUM_LAYERS
    engine.start_loads([BlockTransfer(1, [0], [0])])
    engine.wait_for_layer_load("model.layers.3.attn")
    _store_step(engine, list(caches), [BlockTransfer(2, [1], [1])])
    assert engine.poll_finished() == FinishedJobs(stores={2}, loads={1})


def test_empty_steps_report_nothing() -> None:
    engine = _engine(_caches())
    engine.start_loads([])
    engine.store_layer("model.layers.0.attn", [])
    engine.finish_step()
    engine.wait_all()
    assert not engine.poll_finished()


def test_copy_blocks_round_trip() -> None:
    # The all-layers helper: store three blocks, load them into other blocks.
    caches = _caches()
    engine = _engine(caches)
    before = {n: t.clone() for n, t in caches.items()}
    engine.copy_blocks(True, [7, 0, 2], [3, 4, 5])
    engine.copy_blocks(False, [1, 5, 6], [3, 4, 5])
    for name, t in caches.items():
        for src, dst in ((7, 1), (0, 5), (2, 6)):
            assert torch.equal(t[dst], before[name][src])


def test_host_buffer_for_other_caches_is_refused() -> None:
    caches = _caches()
    host = HostBuffer.for_kv_caches({"x": torch.zeros(4, 8)}, 2)
    with pytest.raises(ValueError, match="no slot matching"):
        TransferEngine(caches, host)


def test_cpu_stack_covers_all_layers_of_one_buffer() -> None:
    # vLLM's CPU layout keeps layers evenly spaced in one buffer: one stacked view.
    caches = _caches()
    host = HostBuffer.for_kv_caches(caches, NUM_HOST_BLOCKS)
    assert TorchBlockCopier(caches, host).num_stacks == 1
    separate = {n: t.clone() for n, t in caches.items()}
    assert (
        TorchBlockCopier(separate, HostBuffer.for_kv_caches(separate, 2)).num_stacks
        == 3
    )


def test_runs_merge_consecutive_pairs() -> None:
    assert runs_of([5, 1, 2, 3, 7], [9, 0, 1, 4, 10]) == [
        (1, 0, 2),
        (3, 4, 1),
        (5, 9, 1),
        (7, 10, 1),
    ]
    assert runs_of([], []) == []
