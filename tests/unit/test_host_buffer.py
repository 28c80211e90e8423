"""HostBuffer: block-major slots, one contiguous range per block, clear allocation
errors."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from vllm_cpu_offload.persist.data_file import TierDataFile
from vllm_cpu_offload.worker import host_buffer
from vllm_cpu_offload.worker.host_buffer import HostBuffer, HostBufferError
from vllm_cpu_offload.worker.kv_layout import KVLayout


def _caches() -> dict[str, torch.Tensor]:
    return {f"l{i}": torch.zeros(6, 2, 4, 16, dtype=torch.bfloat16) for i in range(3)}


def test_block_major_slots() -> None:
    # Three layers of 256-byte blocks: a host block is their three slots back to back.
    host = HostBuffer.for_kv_caches(_caches(), num_slots=5, pin=False)
    assert host.block_bytes == 3 * 256
    assert host.slot_offsets == {"l0": 0, "l1": 256, "l2": 512}
    assert host.tensor.shape == (5, 768) and host.tensor.is_contiguous()
    assert host.nbytes == 5 * 768
    host.tensor.zero_()
    host.layer_view("l1")[3].fill_(7)
    assert host.block(3)[256:512].eq(7).all() and not host.block(3)[:256].any()
    assert not host.tensor[[0, 1, 2, 4]].any()


def test_shared_caches_share_a_slot() -> None:
    # Cross-layer KV sharing: the second name of one tensor gets no slot of its own.
    caches = _caches()
    caches["shared"] = caches["l0"]
    host = HostBuffer.for_kv_caches(caches, num_slots=2, pin=False)
    assert list(host.slot_offsets) == ["l0", "l1", "l2"]


def test_slots_align_to_16_bytes() -> None:
    # A 6-byte block is padded to 16 so the next slot can be copied in wide words.
    layouts = {"a": KVLayout(4, 6, 1, 0, 6, 2), "b": KVLayout(4, 8, 1, 0, 8, 2)}
    host = HostBuffer(layouts, 3, pin=False)
    assert host.slot_offsets == {"a": 0, "b": 16}
    assert host.block_bytes == 32


def test_not_pinned_without_cuda() -> None:
    host = HostBuffer.for_kv_caches(_caches(), num_slots=1)
    assert host.pinned == torch.cuda.is_available()
    assert host.tensor.is_pinned() == host.pinned


def test_bad_sizes_raise_value_error() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        HostBuffer.for_kv_caches(_caches(), num_slots=0)
    with pytest.raises(ValueError, match="at least one layer"):
        HostBuffer({}, 4)


def test_failed_allocation_names_swap_space(monkeypatch: pytest.MonkeyPatch) -> None:
    # The allocator refuses: the error names --swap-space and the GiB asked for.
    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "empty", refuse)
    layouts = {"a": KVLayout(4, 1 << 20, 1, 0, 1 << 20, 2)}
    with pytest.raises(HostBufferError, match=r"--swap-space asked for 3\.00 GiB"):
        HostBuffer(layouts, 3 * 1024, pin=False)


def test_failed_pinning_names_swap_space(monkeypatch: pytest.MonkeyPatch) -> None:
    # cudaHostRegister refuses (e.g. the locked-memory limit): a clear error,
    # not a crash, and CUDA's last error cleared for whoever catches it.
    cleared: list[bool] = []
    monkeypatch.setattr(host_buffer, "_host_register", lambda ptr, size: 2)
    monkeypatch.setattr(host_buffer, "_clear_cuda_error", lambda: cleared.append(True))
    layouts = {"a": KVLayout(4, 1 << 20, 1, 0, 1 << 20, 2)}
    with pytest.raises(
        HostBufferError, match=r"--swap-space asked for 0\.50 GiB of pinned"
    ):
        HostBuffer(layouts, 512, pin=True)
    assert cleared == [True]


def test_pinning_registers_the_exact_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # The whole buffer is registered once, at its exact size (no power-of-two rounding).
    calls: list[tuple[int, int]] = []

    def register(ptr: int, size: int) -> int:
        calls.append((ptr, size))
        return 0

    monkeypatch.setattr(host_buffer, "_host_register", register)
    monkeypatch.setattr(
        host_buffer, "_host_unregister", lambda ptr: calls.append((ptr, -1))
    )
    host = HostBuffer.for_kv_caches(_caches(), num_slots=3, pin=True)
    assert calls == [(host.tensor.data_ptr(), 3 * 768)]
    ptr = host.tensor.data_ptr()
    del host
    assert calls[-1] == (ptr, -1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_on_cuda() -> None:
    host = HostBuffer.for_kv_caches(_caches(), num_slots=2)
    assert host.pinned and host.tensor.is_pinned()


def test_a_mapped_tier_that_cannot_be_pinned_runs_unpinned(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Kernels refuse long-term pins of some file systems' pages: a --swap-space-path
    # tier then runs unpinned (copied through the pinned bounce buffer) with a warning
    # naming the fix, and CUDA's last error is cleared so that the next launch does not
    # report it as its own.
    cleared: list[bool] = []
    monkeypatch.setattr(host_buffer, "_host_register", lambda ptr, size: 1)
    monkeypatch.setattr(host_buffer, "_clear_cuda_error", lambda: cleared.append(True))
    data_file = TierDataFile(str(tmp_path), "tp0-pp0", {"model": "m"})
    with caplog.at_level(logging.WARNING, logger=host_buffer.__name__):
        host = HostBuffer.for_kv_caches(
            _caches(), num_slots=3, pin=True, memory=data_file
        )
    assert not host.pinned and not host.tensor.is_pinned()
    assert cleared == [True]
    assert f"--swap-space-path {tmp_path}" in caplog.text
    assert "/dev/shm" in caplog.text
    host.tensor[2].fill_(7)  # still the file's mapping: written through
    del host
    data_file.close()
    data_file = TierDataFile(str(tmp_path), "tp0-pp0", {"model": "m"})
    again = HostBuffer.for_kv_caches(
        _caches(), num_slots=3, pin=False, memory=data_file
    )
    assert data_file.rebuilt_because is None
    assert int(again.tensor[2].min()) == 7
    data_file.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_mapped_tier_on_cuda_is_pinned_or_leaves_cuda_clean(tmp_path: Path) -> None:
    # Whether this machine's kernel pins file pages or not, the buffer says which it
    # is, and the next CUDA work runs.
    data_file = TierDataFile(str(tmp_path), "tp0-pp0", {"model": "m"})
    host = HostBuffer.for_kv_caches(_caches(), num_slots=3, memory=data_file)
    assert host.pinned == host.tensor.is_pinned()
    assert int(torch.ones(4, device="cuda").sum()) == 4
    del host
    data_file.close()
