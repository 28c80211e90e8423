"""The digest cache takes nobody's word but this user's: entries only from a folder of
this user that no one else may write, only entries no one else may write, no write
through a link planted in it; and nothing across starts for a file on a file system
whose stat a server or an image makes up, or that cannot be told. Each case gets the
file's real digest.

The tests run as root; "another user" is uid 65534, given a folder or file by chown."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_offload import file_digest, safe_cache_dir, stat_trust

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


# statfs(2) f_type of file systems whose stat a server or an image makes up, and
# of one nobody knows (linux/magic.h).
MADE_UP_STAT = {
    "fuse": 0x65735546,
    "overlayfs": 0x794C7630,
    "cifs": 0xFF534D42,
    "smb2": 0xFE534D42,
    "9p": 0x01021997,
    "nfs": 0x6969,
    "squashfs": 0x73717368,
    "erofs": 0xE0F5E1E2,
    "unknown": 0x12345678,
}


def assert_nothing_kept_across_starts(
    f: Path, digests: Path, hashed: list[Path]
) -> None:
    assert file_digest.file_digest(f) == real_digest(f)
    assert file_digest.file_digest(f) == real_digest(f)
    assert hashed == [f]  # once per process
    file_digest.forget_in_process()
    assert file_digest.file_digest(f) == real_digest(f)
    assert hashed == [f, f]
    assert not digests.exists() or not any(digests.iterdir())


@pytest.mark.parametrize("fs_type", [*MADE_UP_STAT, "cannot-tell"])
def test_where_stat_proves_nothing_nothing_is_kept_across_starts(
    weights: Path,
    digests: Path,
    hashed: list[Path],
    monkeypatch: pytest.MonkeyPatch,
    fs_type: str,
) -> None:
    # An object store mount: its server may report the same ctime and inode for an
    # object replaced by one of the same size and modification time. Or a file
    # system the process cannot tell: the same.
    magic = MADE_UP_STAT.get(fs_type)
    monkeypatch.setattr(stat_trust, "fs_magic", lambda path: magic)
    assert_nothing_kept_across_starts(weights, digests, hashed)


@pytest.fixture
def overlay(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """An overlayfs whose lower layer lies on another file system (a tmpfs) than
    its upper one (the test's folder), as a container's root over lazily pulled
    layers: (the overlay's folder, the lower layer's)."""
    layer_fs, merged = tmp_path / "layer-fs", tmp_path / "merged"
    for d in ("layer-fs", "upper", "work", "merged"):
        (tmp_path / d).mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(layer_fs)]).returncode:
        pytest.skip("cannot mount here")
    lower = layer_fs / "lower"
    lower.mkdir()
    upper, work = tmp_path / "upper", tmp_path / "work"
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    try:
        if subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)]
        ).returncode:
            pytest.skip("cannot mount an overlayfs here")
        try:
            yield merged, lower
        finally:
            subprocess.run(["umount", str(merged)], check=True)
    finally:
        subprocess.run(["umount", str(layer_fs)], check=True)


def mountinfo_devices() -> set[int]:
    devices = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        major, _, minor = line.split()[2].partition(":")
        devices.add(os.makedev(int(major), int(minor)))
    return devices


def test_a_file_of_an_overlays_lower_layer_is_not_trusted(
    overlay: tuple[Path, Path],
    digests: Path,
    hashed: list[Path],
) -> None:
    # The lower layer a snapshotter serves over FUSE: through the overlay the file
    # shows a device made up per layer, which no mountinfo line lists, and the
    # layer's own stat. Nothing of it is kept across starts.
    merged, lower = overlay
    content = bytes(range(256)) * (file_digest.CACHED_MIN_BYTES // 256 + 1)
    (lower / "model.safetensors").write_bytes(content)
    f = merged / "model.safetensors"
    os.utime(f, (LONG_AGO, LONG_AGO))
    assert f.stat().st_dev not in mountinfo_devices()
    assert stat_trust.fs_magic(f) == MADE_UP_STAT["overlayfs"]
    assert_nothing_kept_across_starts(f, digests, hashed)


def test_local_kernel_file_systems_are_trusted(
    weights: Path, digests: Path, hashed: list[Path]
) -> None:
    # The test's folder (ext4 or another local one here) and a tmpfs: a later start
    # stats the file and reads its kept digest.
    assert stat_trust.stat_follows_content(weights), hex(
        stat_trust.fs_magic(weights) or 0
    )
    assert stat_trust.stat_follows_content(Path("/dev/shm"))
    assert not stat_trust.stat_follows_content(Path("/proc/self/status"))
    assert not stat_trust.stat_follows_content(weights.parent / "missing")
    assert file_digest.file_digest(weights) == real_digest(weights)
    file_digest.forget_in_process()
    assert file_digest.file_digest(weights) == real_digest(weights)
    assert hashed == [weights]


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
