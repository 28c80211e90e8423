"""The persisted tier's files: index and data survive a process, and nothing torn,
foreign or stale is ever served; the directory and files are private to their owner."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch import Tensor

from vllm_cpu_offload.config import OffloadConfig
from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.kv_identity import check_stable_block_hashes
from vllm_cpu_offload.persist.block_index import RECORD_BYTES, BlockIndex
from vllm_cpu_offload.persist.data_file import TierDataFile
from vllm_cpu_offload.persist.directory import check_tier_directory
from vllm_cpu_offload.scheduler.block_pool import BlockState, HostBlockPool
from vllm_cpu_offload.scheduler.policies.registry import make_policy

FINGERPRINT = {"model": "m", "dtype": "torch.bfloat16", "num_host_blocks": 8}
WORKERS = ["tp0-pp0"]
LAYOUTS = {"layer.0": "KVLayout(...)"}


def key(i: int) -> tuple[int, bytes]:
    return (0, i.to_bytes(32, "little"))


def make_tier(
    path: Path, slots: int = 8, slot_bytes: int = 64
) -> tuple[TierDataFile, Tensor]:
    data = TierDataFile(str(path), WORKERS[0], FINGERPRINT)
    return data, data.map(slots, slot_bytes, LAYOUTS)


def open_index(path: Path, fingerprint: dict | None = None) -> tuple[BlockIndex, list]:
    index = BlockIndex(str(path), fingerprint or FINGERPRINT, 8, WORKERS)
    return index, index.open()


def test_blocks_and_bytes_come_back_after_a_clean_close(tmp_path: Path) -> None:
    # A tier written, closed, and opened again by new objects: same bytes, same keys,
    # same chain links, oldest first; every file is private to its owner.
    data, tensor = make_tier(tmp_path)
    index, restored = open_index(tmp_path)
    assert restored == [] and index.rebuilt_because == "new"
    tensor[3].fill_(7)
    tensor[5].fill_(9)
    index.record([(3, key(1), None), (5, key(2), key(1))])
    data.close()
    index.close()
    for f in tmp_path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    data2, tensor2 = make_tier(tmp_path)
    assert data2.rebuilt_because is None and data2.incarnation == data.incarnation
    index2, restored2 = open_index(tmp_path)
    assert index2.rebuilt_because is None
    assert [(b.host_id, b.key, b.parent) for b in restored2] == [
        (3, key(1), None),
        (5, key(2), key(1)),
    ]
    assert bool((tensor2[3] == 7).all()) and bool((tensor2[5] == 9).all())


def test_a_cleared_record_is_not_restored(tmp_path: Path) -> None:
    make_tier(tmp_path)
    index, _ = open_index(tmp_path)
    index.record([(0, key(1), None), (1, key(2), key(1))])
    index.clear(0)
    index.close()
    _, restored = open_index(tmp_path)
    assert [b.key for b in restored] == [key(2)]


def test_a_torn_record_is_dropped_and_counted(tmp_path: Path) -> None:
    make_tier(tmp_path)
    index, _ = open_index(tmp_path)
    index.record([(0, key(1), None), (1, key(2), key(1))])
    index.close()
    # A write cut off half-way by a crash.
    with open(tmp_path / "index.bin", "r+b") as f:
        f.seek(1 * RECORD_BYTES + 20)
        f.write(b"\xff" * 8)
    index2, restored = open_index(tmp_path)
    assert [b.key for b in restored] == [key(1)] and index2.torn_records == 1


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: os.truncate(p / "index.bin", RECORD_BYTES * 3), "truncated"),
        (lambda p: (p / "tier.json").write_text("{not json"), "unreadable"),
        (lambda p: (p / "kv-tp0-pp0.json").unlink(), "missing"),
    ],
    ids=["truncated-index", "corrupt-metadata", "missing-worker-file"],
)
def test_a_damaged_tier_is_rebuilt_empty(tmp_path: Path, damage, reason: str) -> None:
    make_tier(tmp_path)[0].close()
    index, _ = open_index(tmp_path)
    index.record([(0, key(1), None)])
    index.close()
    damage(tmp_path)
    index2, restored = open_index(tmp_path)
    assert restored == [] and reason in (index2.rebuilt_because or "")
    index2.close()
    _, again = open_index(tmp_path)  # the rebuilt tier is whole again
    assert again == []


def test_a_different_configuration_starts_empty_and_says_what_differs(
    tmp_path: Path,
) -> None:
    make_tier(tmp_path)
    index, _ = open_index(tmp_path)
    index.record([(0, key(1), None)])
    index.close()
    index2, restored = open_index(tmp_path, {**FINGERPRINT, "dtype": "torch.float32"})
    assert restored == []
    assert "different configuration" in (index2.rebuilt_because or "")
    assert "dtype 'torch.bfloat16' -> 'torch.float32'" in (index2.rebuilt_because or "")


def test_a_rebuilt_worker_file_invalidates_the_index(tmp_path: Path) -> None:
    # The worker's layout changed: its file is rebuilt under a new incarnation, and the
    # index, which described the old bytes, starts empty.
    data, _ = make_tier(tmp_path)
    data.close()
    index, _ = open_index(tmp_path)
    index.record([(0, key(1), None)])
    index.close()
    data2 = TierDataFile(str(tmp_path), WORKERS[0], FINGERPRINT)
    tensor = data2.map(8, 64, {"layer.0": "another layout"})
    assert data2.rebuilt_because is not None and data2.incarnation != data.incarnation
    assert int(tensor.sum()) == 0
    index2, restored = open_index(tmp_path)
    assert restored == [] and "rebuilt" in (index2.rebuilt_because or "")


def test_a_tier_left_open_before_a_reboot_is_rebuilt(tmp_path: Path) -> None:
    data, _ = make_tier(tmp_path)
    index, _ = open_index(tmp_path)
    index.record([(0, key(1), None)])
    del data, index  # no close: what a crash leaves; the locks go with the file objects
    for name in ("tier.json", "kv-tp0-pp0.json"):
        meta = json.loads((tmp_path / name).read_text())
        meta["boot_id"] = "an-earlier-boot"
        (tmp_path / name).write_text(json.dumps(meta))
    data2 = TierDataFile(str(tmp_path), WORKERS[0], FINGERPRINT)
    data2.map(8, 64, LAYOUTS)
    assert "restarted" in (data2.rebuilt_because or "")


def test_a_crash_while_storing_leaves_only_recorded_blocks(tmp_path: Path) -> None:
    # A process maps the tier, records two blocks, starts writing a third block's bytes
    # and is killed (SIGKILL) before its record: the next process serves the two blocks,
    # with their bytes, and not the third.
    script = textwrap.dedent(
        f"""
        import os, signal
        from tests.unit.test_persist import (
            make_tier, open_index, key,
        )
        from pathlib import Path
        path = Path({str(tmp_path)!r})
        data, tensor = make_tier(path)
        index, _ = open_index(path)
        tensor[0].fill_(1); tensor[1].fill_(2)
        index.record([(0, key(1), None), (1, key(2), key(1))])
        tensor[2].fill_(3)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    assert proc.returncode == -signal.SIGKILL
    data, tensor = make_tier(tmp_path)
    assert data.rebuilt_because is None
    index, restored = open_index(tmp_path)
    assert index.rebuilt_because is None and index.torn_records == 0
    assert [b.key for b in restored] == [key(1), key(2)]
    assert int(tensor[0].min()) == 1 and int(tensor[1].min()) == 2


def test_a_second_engine_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    make_tier(tmp_path)
    index, _ = open_index(tmp_path)
    with pytest.raises(OffloadConfigError, match="in use by another running engine"):
        BlockIndex(str(tmp_path), FINGERPRINT, 8, WORKERS).open()
    with pytest.raises(OffloadConfigError, match="in use by another running engine"):
        check_tier_directory(str(tmp_path))
    index.close()


def test_the_directory_is_created_private_and_a_shared_one_is_refused(
    tmp_path: Path,
) -> None:
    new = tmp_path / "a" / "tier"
    check_tier_directory(str(new))
    assert stat.S_IMODE(new.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(OffloadConfigError, match="writable by other users.*chmod go-w"):
        check_tier_directory(str(shared))
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(OffloadConfigError, match="not a directory"):
        check_tier_directory(str(a_file))


def test_a_tier_larger_than_its_file_system_is_refused(tmp_path: Path) -> None:
    config = OffloadConfig(swap_space_gib=1e6, swap_space_path=str(tmp_path))
    from vllm_cpu_offload.flags import check_fits_in_host_memory

    with pytest.raises(
        OffloadConfigError, match=f"that {tmp_path} can hold; lower --swap-space"
    ):
        check_fits_in_host_memory(config)


def test_per_process_seeded_hashes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    check_stable_block_hashes("sha256", "--swap-space-path")
    check_stable_block_hashes("sha256_cbor", "--swap-space-path")
    with pytest.raises(
        OffloadConfigError, match="xxhash seeds them at random per process"
    ):
        check_stable_block_hashes("xxhash", "--swap-space-path")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    check_stable_block_hashes("xxhash", "--swap-space-path")


def test_swap_space_path_round_trips_through_the_extra_config(tmp_path: Path) -> None:
    config = OffloadConfig.from_extra_config({"swap_space_path": str(tmp_path)})
    assert OffloadConfig.from_extra_config(config.to_extra_config()) == config
    with pytest.raises(OffloadConfigError, match="must be a directory path"):
        OffloadConfig.from_extra_config({"swap_space_path": ""})


@pytest.mark.parametrize("policy", ["prefix_aware", "lru"])
def test_the_pool_records_what_it_serves_and_restores_it(
    tmp_path: Path, policy: str
) -> None:
    # A pool backed by an index: finished stores are recorded, evicted blocks cleared,
    # and a new pool adopts what is left with its chain links; it then stores and
    # evicts as usual.
    make_tier(tmp_path)
    index, _ = open_index(tmp_path)
    pool = HostBlockPool(4, make_policy(policy, 4), persistence=index)
    chain = [key(i) for i in range(6)]
    got = pool.allocate_for_store(chain[:4], None)
    pool.complete_store([k for k, _ in got], True)
    got = pool.allocate_for_store(chain[4:], chain[3])  # evicts to make room
    pool.complete_store([k for k, _ in got], True)
    held = {k: pool._by_key[k].block_id for k in chain if k in pool}
    index.close()

    index2, restored = open_index(tmp_path)
    assert {b.key: b.host_id for b in restored} == held
    pool2 = HostBlockPool(4, make_policy(policy, 4), persistence=index2)
    assert pool2.restore((b.host_id, b.key, b.parent) for b in restored) == len(held)
    pool2.check_invariants()
    for k in held:
        assert pool2.state_of(k) is BlockState.READY
        parent = pool2._by_key[k].parent
        i = chain.index(k)
        expected = chain[i - 1] if i and chain[i - 1] in held else None
        assert (parent.key if parent else None) == expected
    # The restored pool keeps working: new stores evict restored blocks and clear them.
    other = [key(100 + i) for i in range(4)]
    got = pool2.allocate_for_store(other, None)
    pool2.complete_store([k for k, _ in got], True)
    pool2.check_invariants()
    index2.close()
    _, final = open_index(tmp_path)
    assert {b.key for b in final} == set(pool2._by_key)
