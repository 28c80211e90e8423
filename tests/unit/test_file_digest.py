"""The digest cache takes nobody's word but this user's: entries only from a folder of
this user that no one else may write, only entries no one else may write, no write
through a link planted in it; and nothing across starts for a file on a FUSE mount,
whose stat its server makes up. Each case gets the file's real digest.

The tests run as root; "another user" is uid 65534, given a folder or file by chown."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_offload import file_digest, fuse_mounts, safe_cache_dir

LONG_AGO = 1_000_000_000  # an mtime well past the settling time, in seconds
OTHER_UID = 65534
PLANTED = "0" * 64  # the digest another user would have this user take


@pytest.fixture(autouse=True)
def digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A digest cache of the test's own, and a process that knows no digest yet."""
    monkeypatch.setenv("VLLM_CPU_OFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(safe_cache_dir, "_refused", set())
    file_digest.forget_in_process()
    yield tmp_path / "cache" / "digests"
    file_digest.forget_in_process()


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files whose content is read to be hashed, in order."""
    read: list[Path] = []
    real = file_digest._read_and_hash

    def counting(path: Path, version: Any) -> tuple[str, bool]:
        read.append(path)
        return real(path, version)

    monkeypatch.setattr(file_digest, "_read_and_hash", counting)
    return read


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """A settled weight file large enough for its digest to be kept on disk."""
    f = tmp_path / "model.safetensors"
    f.write_bytes(bytes(range(256)) * (file_digest.CACHED_MIN_BYTES // 256 + 1))
    os.utime(f, (LONG_AGO, LONG_AGO))
    return f


def real_digest(f: Path) -> str:
    return hashlib.sha256(f.read_bytes()).hexdigest()


def stem(f: Path) -> str:
    """The name of `f`'s cache entry, less its suffix."""
    return hashlib.sha256(str(f.absolute()).encode()).hexdigest()[:32]


def plant_entry(folder: Path, f: Path, mode: int = 0o600, uid: int = 0) -> Path:
    """An entry that matches `f`'s version and names another digest."""
    version = dataclasses.asdict(file_digest.FileVersion.of(f))
    entry = folder / (stem(f) + ".json")
    entry.write_text(json.dumps({"version": version, "sha256": PLANTED}))
    os.chmod(entry, mode)
    os.chown(entry, uid, -1)
    return entry


def test_the_cache_folder_and_its_entries_are_private(
    weights: Path, digests: Path
) -> None:
    assert file_digest.file_digest(weights) == real_digest(weights)
    assert stat.S_IMODE(digests.stat().st_mode) == 0o700
    entry = digests / (stem(weights) + ".json")
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("uid", "mode"),
    [(OTHER_UID, 0o777), (OTHER_UID, 0o700), (0, 0o777), (0, 0o770)],
    ids=["other-users-shared", "other-users-private", "world-writable", "group"],
)
def test_a_digest_planted_in_a_folder_others_control_is_not_taken(
    weights: Path,
    digests: Path,
    hashed: list[Path],
    monkeypatch: pytest.MonkeyPatch,
    uid: int,
    mode: int,
) -> None:
    # Another user made the cache folder (or may write in it) before this user's
    # first start, and put an entry for this user's weights in it.
    digests.mkdir(parents=True)
    os.chown(digests, uid, -1)
    os.chmod(digests, mode)
    plant_entry(digests, weights, uid=uid)
    said: list[str] = []
    monkeypatch.setattr(
        safe_cache_dir.logger, "warning", lambda m, *a: said.append(m % a)
    )
    assert file_digest.file_digest(weights) == real_digest(weights)
    assert len(said) == 1 and str(digests) in said[0] and "not private" in said[0]
    # Nor is anything written into it: the next start reads again.
    assert sorted(p.name for p in digests.iterdir()) == [stem(weights) + ".json"]
    file_digest.forget_in_process()
    hashed.clear()
    assert file_digest.file_digest(weights) == real_digest(weights)
    assert hashed == [weights]


@pytest.mark.parametrize(
    ("uid", "mode"),
    [(OTHER_UID, 0o600), (0, 0o666), (0, 0o620)],
    ids=["other-users", "world-writable", "group-writable"],
)
def test_an_entry_others_could_write_is_not_taken(
    weights: Path, digests: Path, uid: int, mode: int
) -> None:
    digests.mkdir(parents=True, mode=0o700)
    plant_entry(digests, weights, mode=mode, uid=uid)
    assert file_digest.file_digest(weights) == real_digest(weights)


def test_an_entry_that_is_a_link_is_not_followed(weights: Path, digests: Path) -> None:
    digests.mkdir(parents=True, mode=0o700)
    entry = plant_entry(digests.parent, weights)
    (digests / entry.name).symlink_to(entry)
    assert file_digest.file_digest(weights) == real_digest(weights)


@pytest.mark.parametrize("target_exists", [True, False], ids=["file", "missing"])
@pytest.mark.parametrize(
    "suffix", [".lock", f".{os.getpid()}.tmp"], ids=["lock", "tmp"]
)
def test_no_file_is_written_through_a_link_planted_in_the_cache(
    weights: Path, digests: Path, tmp_path: Path, suffix: str, target_exists: bool
) -> None:
    # A link named as the lock or the temporary entry would be, to a file of this
    # user's, or to where an open with O_CREAT would make one.
    digests.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim"
    if target_exists:
        victim.write_text("precious")
    (digests / (stem(weights) + suffix)).symlink_to(victim)
    assert file_digest.file_digest(weights) == real_digest(weights)
    if target_exists:
        assert victim.read_text() == "precious"
    else:
        assert not victim.exists()


def fake_fuse_mountinfo(tmp_path: Path, f: Path, fs_type: str) -> Path:
    """This process's mountinfo with `f`'s file system shown as `fs_type`."""
    dev = f.stat().st_dev
    text = Path(fuse_mounts.MOUNTINFO).read_text()
    text += f"999 1 {os.major(dev)}:{os.minor(dev)} / /mnt rw - {fs_type} x rw\n"
    fake = tmp_path / "mountinfo"
    fake.write_text(text)
    return fake


@pytest.mark.parametrize("fs_type", ["fuse.s3fs", "fuse", "fuseblk"])
def test_on_a_fuse_mount_nothing_is_kept_across_starts(
    weights: Path,
    digests: Path,
    tmp_path: Path,
    hashed: list[Path],
    monkeypatch: pytest.MonkeyPatch,
    fs_type: str,
) -> None:
    # An object store mount: its server may report the same ctime and inode for an
    # object replaced by one of the same size and modification time.
    fake = fake_fuse_mountinfo(tmp_path, weights, fs_type)
    monkeypatch.setattr(fuse_mounts, "MOUNTINFO", str(fake))
    assert file_digest.file_digest(weights) == real_digest(weights)
    assert file_digest.file_digest(weights) == real_digest(weights)
    assert hashed == [weights]  # once per process
    file_digest.forget_in_process()
    assert file_digest.file_digest(weights) == real_digest(weights)
    assert hashed == [weights, weights]
    assert not digests.exists() or not any(digests.iterdir())


def test_a_kernel_file_system_is_not_taken_for_fuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = tmp_path.stat().st_dev
    assert not fuse_mounts.on_fuse(device, fuse_mounts.fuse_devices())
    fake = fake_fuse_mountinfo(tmp_path, tmp_path, "fuse.gcsfuse")
    monkeypatch.setattr(fuse_mounts, "MOUNTINFO", str(fake))
    assert fuse_mounts.on_fuse(device, fuse_mounts.fuse_devices())
    monkeypatch.setattr(fuse_mounts, "MOUNTINFO", str(tmp_path / "missing"))
    # Cannot tell: taken for FUSE.
    assert fuse_mounts.on_fuse(device, fuse_mounts.fuse_devices())


def test_a_fifo_is_refused_not_waited_for(tmp_path: Path) -> None:
    # Opening a FIFO for reading waits for a writer: the digest must not.
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    outcome: list[BaseException | str] = []

    def digest() -> None:
        try:
            outcome.append(file_digest.file_digest(fifo))
        except OSError as err:
            outcome.append(err)

    worker = threading.Thread(target=digest, daemon=True)
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():
        # Let the waiting open return (it would hold the test process otherwise).
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join()
    assert len(outcome) == 1 and isinstance(outcome[0], OSError)
    assert str(fifo) in str(outcome[0])
