"""A change of the weights reaches every tier even where one fails to hear it, and a
file tier that cannot be made private (its metadata write fails: ENOSPC, EIO) records
nothing more and restores nothing of after the change."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_offload.persist import directory as tier_dir
from vllm_cpu_offload.persist.block_index import RECORD_BYTES, BlockIndex
from vllm_cpu_offload.persist.data_file import TierDataFile
from vllm_cpu_offload.scheduler.block_pool import HostBlockPool
from vllm_cpu_offload.scheduler.policies.registry import make_policy
from vllm_cpu_offload.scheduler.tier_scheduler import HostTierScheduler

FINGERPRINT = {"model": "m", "weights": "read:a", "num_host_blocks": 8}
WORKERS = ["tp0-pp0"]


def key(i: int) -> tuple[int, bytes]:
    return (0, i.to_bytes(32, "little"))


def disk_full(*_: Any, **__: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class Tiers:
    """A scheduler half with a file tier's index and a shared tier that is told."""

    def __init__(self, path: Path) -> None:
        self.data = TierDataFile(str(path), WORKERS[0], FINGERPRINT)
        self.data.map(8, 64, {"layer.0": "KVLayout(...)"})
        self.index = BlockIndex(str(path), FINGERPRINT, 8, WORKERS)
        self.index.open()
        self.index.record([(3, key(1), None)])  # stored before the change
        pool = HostBlockPool(8, make_policy("lru", 8))
        self.tier = HostTierScheduler(
            pool, block_size=16, num_workers=1, block_bytes=64
        )
        self.sealed: list[str] = []
        self.tier.on_identity_change += [self.index.make_private, self.sealed.append]

    def reopened(self) -> list[Any]:
        self.index.close()
        self.data.close()
        again = BlockIndex(str(self.index.path), FINGERPRINT, 8, WORKERS)
        restored = again.open()
        again.close()
        return [b.key for b in restored]


def test_a_failed_metadata_write_still_seals_the_shared_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiers = Tiers(tmp_path)
    monkeypatch.setattr(tier_dir, "write_json", disk_full)
    tiers.tier.identity_changed("weights changed")  # no error into the engine core
    assert tiers.sealed == ["weights changed"]
    assert tiers.index.unusable
    tiers.index.record([(4, key(2), None)])  # KV of the new weights: not recorded
    tiers.index.clear(3)
    monkeypatch.undo()
    # The next start, on the old weights, finds the index emptied: nothing restored.
    assert tiers.reopened() == []


def test_a_tier_that_cannot_be_emptied_records_nothing_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Neither the metadata nor a truncation goes through (EIO): nothing of the new
    # weights is recorded, a reused slot is still cleared, and the close names this
    # start once the disk takes a write again.
    tiers = Tiers(tmp_path)
    tiers.index.record([(5, key(3), None)])
    monkeypatch.setattr(tier_dir, "write_json", disk_full)
    monkeypatch.setattr(os, "ftruncate", disk_full)
    tiers.tier.identity_changed("weights changed")
    assert tiers.sealed == ["weights changed"] and tiers.index.unusable
    tiers.index.clear(5)  # its slot takes KV of the new weights
    tiers.index.record([(5, key(4), None)])
    view = tiers.index._map
    assert view is not None and view[5 * RECORD_BYTES + 4] == 0  # not valid
    monkeypatch.undo()
    assert tiers.reopened() == []
