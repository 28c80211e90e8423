"""Replicated KV (MLA) stored once: one host region every tensor-parallel rank maps,
stores copied by the first rank, loads by every rank (the shared store's names:
test_kv_shards.py). The region is private to its stage: a memory file without a name,
made by the first rank and opened by the others through its descriptor."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import threading
from collections.abc import Callable

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.unit.test_tier_worker import BLOCKS, HOST_BLOCKS, LAYERS, _step  # noqa: E402
from vllm_cpu_offload.metadata import BlockTransfer, OffloadStepMetadata  # noqa: E402
from vllm_cpu_offload.worker.host_buffer import HostBuffer  # noqa: E402
from vllm_cpu_offload.worker.shared_region import (  # noqa: E402
    NO_REGION,
    RegionHandle,
    SharedRegion,
)
from vllm_cpu_offload.worker.tier_worker import HostTierWorker  # noqa: E402

SHM_DIR = "/dev/shm"
SLOTS, SLOT_BYTES = 4, 4096


class _Stage:
    """The collectives of a stage whose ranks are threads of this process; rank 0
    leads. `tamper` changes the handle the other ranks receive; `before_agree(rank)`
    runs on every rank between mapping and agreeing; the ranks in `vote_no` vote no
    whatever they mapped. A rank that raises breaks the barrier: the others raise
    too, as a dead rank's peers do, instead of hanging."""

    def __init__(
        self,
        ranks: int,
        *,
        tamper: Callable[[RegionHandle], RegionHandle] | None = None,
        before_agree: Callable[[int], object] | None = None,
        vote_no: frozenset[int] = frozenset(),
    ) -> None:
        self.barrier = threading.Barrier(ranks, timeout=30)
        self.sent = NO_REGION
        self.votes: list[bool] = []
        self.tamper = tamper
        self.before_agree = before_agree
        self.vote_no = vote_no

    def region(
        self, rank: int, name: str = "vllm-cpu-offload-test-region"
    ) -> SharedRegion:
        return SharedRegion(name, _Rank(self, rank), leader=rank == 0)


@dataclasses.dataclass
class _Rank:
    """One rank's `StageCollectives` over a `_Stage`."""

    stage: _Stage
    rank: int

    def broadcast(self, payload: bytes) -> bytes:
        if self.rank == 0:
            self.stage.sent = payload
        self.stage.barrier.wait()
        handle = RegionHandle.unpack(self.stage.sent)
        if self.rank != 0 and handle is not None and self.stage.tamper is not None:
            return self.stage.tamper(handle).pack()
        return self.stage.sent

    def agree(self, ok: bool) -> bool:
        try:
            if self.stage.before_agree is not None:
                self.stage.before_agree(self.rank)
        except BaseException:
            self.stage.barrier.abort()
            raise
        self.stage.votes.append(ok and self.rank not in self.stage.vote_no)
        self.stage.barrier.wait()
        return all(self.stage.votes)


def _run_ranks(
    ranks: int, work: Callable[[int], object]
) -> tuple[list[object], list[BaseException]]:
    """Runs `work(rank)` for every rank at once (ranks are threads here): what each
    returned, and what they raised."""
    results: list[object] = [None] * ranks
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as e:  # returned
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return results, errors


def _in_ranks(ranks: int, work: Callable[[int], object]) -> list[object]:
    results, errors = _run_ranks(ranks, work)
    assert not errors, errors
    return results


def _backing(tensor: torch.Tensor) -> tuple[str, int]:
    """The file (its name in /proc/self/maps, and inode) of the mapping that holds
    `tensor`."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return (fields[5].strip() if len(fields) > 5 else ""), int(fields[4])
    raise AssertionError("no mapping holds the tensor")


def _workers(ranks: int) -> list[tuple[HostTierWorker, dict]]:
    stage = _Stage(ranks)
    torch.manual_seed(0)
    # The same device KV on every rank, as MLA's latent KV is.
    caches = {f"l{i}": torch.randn(BLOCKS, 16, 64) for i in range(LAYERS)}

    def make(rank: int) -> tuple[HostTierWorker, dict]:
        own = {name: t.clone() for name, t in caches.items()}
        worker = HostTierWorker(HOST_BLOCKS, BLOCKS, memory=stage.region(rank))
        worker.register_kv_caches(own)
        return worker, own

    return _in_ranks(ranks, make)  # type: ignore[return-value]


def test_ranks_map_one_region_the_first_rank_stores_and_every_rank_loads() -> None:
    (leader, leader_kv), (replica, replica_kv) = _workers(2)
    leader_host, replica_host = leader.engine.host, replica.engine.host  # type: ignore[union-attr]
    assert leader_host.shared and replica_host.shared
    # One memory file without a name in any directory, mapped by both ranks.
    (path, inode), (replica_path, replica_inode) = (
        _backing(leader_host.tensor),
        _backing(replica_host.tensor),
    )
    assert path.startswith("/memfd:vllm-cpu-offload-test-region") and path.endswith(
        "(deleted)"
    )
    assert (replica_path, replica_inode) == (path, inode)
    # One memory: a byte written through one rank's view shows in the other's.
    leader_host.tensor[3, 5] = 77
    assert int(replica_host.tensor[3, 5]) == 77
    leader_host.tensor.zero_()

    store = OffloadStepMetadata(stores=[BlockTransfer(1, [5], [2], "a")])
    # The replica copies nothing and reports at once; the leader copies.
    _step(replica, store)
    assert not bool(replica_host.tensor.any())
    _step(leader, store)
    for worker in (leader, replica):
        report = worker.take_report()
        assert report is not None and dict(report.finished) == {1: 1}

    # Every rank loads the block from the one region into its own device blocks.
    load = OffloadStepMetadata(loads=[BlockTransfer(2, [1], [2], "b")])
    for worker, kv in ((leader, leader_kv), (replica, replica_kv)):
        _step(worker, load)
        for t in kv.values():
            assert torch.equal(t[1], t[5])
        report = worker.take_report()
        assert report is not None and dict(report.finished) == {2: 1}


def _own_buffers(stage: _Stage) -> list[HostBuffer]:
    """Every rank's host buffer, asserted to be memory of its own."""

    def make(rank: int) -> HostBuffer:
        layouts = {"l0": torch.zeros(BLOCKS, 16, 64)}
        return HostBuffer.for_kv_caches(layouts, HOST_BLOCKS, memory=stage.region(rank))

    buffers: list[HostBuffer] = _in_ranks(2, make)  # type: ignore[assignment]
    for buffer in buffers:
        assert isinstance(buffer, HostBuffer) and not buffer.shared
    a, b = buffers
    a.tensor[0, 0] = 9
    assert int(b.tensor[0, 0]) == 0
    return buffers


def test_a_rank_that_cannot_map_the_region_makes_every_rank_keep_its_own() -> None:
    # Rank 1 votes no, as a rank that could not map the region does.
    _own_buffers(_Stage(2, vote_no=frozenset({1})))


def test_a_leader_that_cannot_reserve_the_region_makes_every_rank_keep_its_own(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with caplog.at_level(logging.WARNING):
        _own_buffers(_Stage(2))
    # The leader says why; the others, with nothing of their own to say, say nothing.
    warnings = [r.getMessage() for r in caplog.records if "own copy" in r.getMessage()]
    assert len(warnings) == 1 and "reserving its memory" in warnings[0], warnings


def _pid_of_no_process(handle: RegionHandle) -> RegionHandle:
    with open("/proc/sys/kernel/pid_max") as f:
        return dataclasses.replace(handle, pid=int(f.read()))


def _another_file(handle: RegionHandle) -> RegionHandle:
    # A descriptor of the leader's process, but not of its region.
    return dataclasses.replace(handle, fd=0)


def _another_inode(handle: RegionHandle) -> RegionHandle:
    return dataclasses.replace(handle, ino=handle.ino + 1)


def _another_host(handle: RegionHandle) -> RegionHandle:
    return dataclasses.replace(handle, boot_id=bytes(16))


@pytest.mark.parametrize(
    "tamper", [_pid_of_no_process, _another_file, _another_inode, _another_host]
)
def test_a_rank_that_cannot_open_the_leaders_region_makes_every_rank_keep_its_own(
    tamper: Callable[[RegionHandle], RegionHandle], caplog: pytest.LogCaptureFixture
) -> None:
    # The replica finds no region, or another file, where the leader's handle says.
    with caplog.at_level(logging.WARNING):
        _own_buffers(_Stage(2, tamper=tamper))
    warnings = [r.getMessage() for r in caplog.records if "own copy" in r.getMessage()]
    assert len(warnings) == 1 and "first rank" in warnings[0], warnings


def test_two_engines_with_one_engine_id_map_two_regions() -> None:
    # Two engines started from one config (one engine id, so one region name) map
    # their regions at once: neither reads the other's KV.
    both = threading.Barrier(4, timeout=30)
    stages = [_Stage(2, before_agree=lambda _: both.wait()) for _ in range(2)]

    def work(thread: int) -> object:
        return (
            stages[thread // 2]
            .region(thread % 2, "one-engine-id")
            .map(SLOTS, SLOT_BYTES)
        )

    first, first_replica, second, second_replica = _in_ranks(4, work)
    assert all(isinstance(t, torch.Tensor) for t in (first, second))
    first[1, 2] = 55  # type: ignore[index]
    assert int(first_replica[1, 2]) == 55  # type: ignore[index]
    assert int(second[1, 2]) == 0 and int(second_replica[1, 2]) == 0  # type: ignore[index]
    assert _backing(first)[1] != _backing(second)[1]  # type: ignore[arg-type]


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")
def test_no_file_in_dev_shm_is_opened_or_made() -> None:
    # A file made first (by another user) under the name a region once had: the ranks
    # neither read it nor write it, and make no file in /dev/shm of their own.
    name = f"vllm-cpu-offload-test-{os.getpid()}-dp0-pp0"
    planted = os.path.join(SHM_DIR, name)
    with open(planted, "wb") as f:
        f.write(b"\xab" * SLOTS * SLOT_BYTES)
    try:
        before = _listing()
        while_mapped: list[set[str]] = []
        stage = _Stage(2, before_agree=lambda _: while_mapped.append(_listing()))
        leader, replica = _in_ranks(
            2, lambda r: stage.region(r, name).map(SLOTS, SLOT_BYTES)
        )
        assert isinstance(leader, torch.Tensor) and isinstance(replica, torch.Tensor)
        assert while_mapped == [before, before]
        assert not bool(leader.any()), "the region holds the planted file's bytes"
        leader.fill_(7)
        with open(planted, "rb") as f:
            assert f.read() == b"\xab" * SLOTS * SLOT_BYTES
        assert _backing(leader)[0].startswith("/memfd:")
    finally:
        os.unlink(planted)


def _listing() -> set[str]:
    # The names a region ever had: other tests' engines (vLLM's own shared memory)
    # may come and go in /dev/shm meanwhile.
    return {n for n in os.listdir(SHM_DIR) if n.startswith("vllm-cpu-offload")}


def _region_descriptors() -> set[str]:
    """This process's open descriptors of a region's memory file."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if "vllm-cpu-offload" in os.readlink(f"/proc/self/fd/{fd}"):
                found.add(fd)
    return found


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")
def test_a_rank_that_dies_before_agreeing_leaves_nothing_behind() -> None:
    # A rank is killed between mapping the region and agreeing (OOM, a probe): no
    # file is left in /dev/shm, and no descriptor of the region stays open.
    before = _listing()
    descriptors = _region_descriptors()
    while_mapped: list[set[str]] = []

    def die(rank: int) -> None:
        while_mapped.append(_listing())
        if rank == 1:
            raise RuntimeError("killed")

    stage = _Stage(2, before_agree=die)
    _, errors = _run_ranks(2, lambda r: stage.region(r).map(SLOTS, SLOT_BYTES))
    assert len(errors) == 2, errors  # the dead rank's and its peer's
    assert while_mapped and all(seen == before for seen in while_mapped)
    assert _listing() == before
    assert _region_descriptors() == descriptors
