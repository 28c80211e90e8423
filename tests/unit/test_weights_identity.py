"""A local checkpoint's identity is exact (any changed byte changes it), costs a stat at
a later start (each file's digest is kept on disk by the file's version), a Hugging Face
cache blob is identified by its content, checked once per version (a fine-tune saved
through the cache's links changes the identity), and weights that cannot be read are
unidentified, with one warning line naming the file."""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_cpu_offload import file_digest
from vllm_cpu_offload.weights_identity import checkpoint_digest, weights_identity

LONG_AGO = 1_000_000_000  # an mtime well past the settling time, in seconds


@pytest.fixture(autouse=True)
def digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A digest cache of the test's own, and a process that knows no digest yet."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("VLLM_CPU_OFFLOAD_CACHE", str(cache))
    file_digest.forget_in_process()
    yield cache / "digests"
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


def write_safetensors(folder: Path, layernorm: list[float] | None = None) -> Path:
    """A checkpoint over 1 MiB: two large weights with a 64-float LayerNorm weight
    between them, in the middle of the data (off every run of the old sampled
    digest, which read 16 runs of 4 KiB evenly spaced over the data)."""
    norm = layernorm if layernorm is not None else [1.0] * 64
    tensors = {
        "layers.0.mlp.up.weight": bytes(range(256)) * 4000,
        "layers.0.norm.weight": struct.pack("<64f", *norm),
        "layers.0.mlp.down.weight": bytes(range(255, -1, -1)) * 4000,
    }
    header: dict[str, Any] = {}
    offset = 0
    for name, data in tensors.items():
        header[name] = {
            "dtype": "F32" if "norm" in name else "U8",
            "shape": [len(data) // 4 if "norm" in name else len(data)],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header).encode()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = folder / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))
    settle(weights)
    return weights


def settle(f: Path, seconds: int = LONG_AGO) -> None:
    """As if `f` had been written long ago (a digest is kept of settled files only)."""
    os.utime(f, (seconds, seconds))


def test_a_layernorm_tuned_copy_has_another_identity(tmp_path: Path) -> None:
    # LayerNorm tuning: one 64-float tensor differs, same names, shapes and size.
    base = write_safetensors(tmp_path / "base")
    tuned = write_safetensors(tmp_path / "tuned", layernorm=[1.5] * 64)
    assert base.stat().st_size == tuned.stat().st_size > 1 << 20
    assert checkpoint_digest(base.parent) != checkpoint_digest(tuned.parent)
    again = write_safetensors(tmp_path / "copy")
    assert checkpoint_digest(again.parent) == checkpoint_digest(base.parent)


def test_a_kept_digest_is_not_read_again(tmp_path: Path, hashed: list[Path]) -> None:
    # A second start (a new process) pays a stat: the weights are not read.
    weights = write_safetensors(tmp_path / "model")
    first = checkpoint_digest(weights.parent)
    assert weights in hashed
    file_digest.forget_in_process()
    hashed.clear()
    assert checkpoint_digest(weights.parent) == first
    assert weights not in hashed


def test_a_file_rewritten_to_the_same_size_is_read_again(
    tmp_path: Path, hashed: list[Path]
) -> None:
    # A fine-tune written over the base in place: same size, a later mtime.
    weights = write_safetensors(tmp_path / "model")
    before = checkpoint_digest(weights.parent)
    write_safetensors(tmp_path / "model", layernorm=[0.5] * 64)
    settle(weights, LONG_AGO + 1)
    file_digest.forget_in_process()
    hashed.clear()
    assert checkpoint_digest(weights.parent) != before
    assert weights in hashed


def test_a_file_still_being_written_is_not_kept(
    tmp_path: Path, hashed: list[Path]
) -> None:
    weights = write_safetensors(tmp_path / "model")
    settle(weights, int(time.time()))
    checkpoint_digest(weights.parent)
    file_digest.forget_in_process()
    hashed.clear()
    checkpoint_digest(weights.parent)
    assert weights in hashed


def test_processes_of_one_start_read_a_file_once(
    tmp_path: Path, hashed: list[Path]
) -> None:
    # The scheduler and the workers ask together: one reads, the others wait for it.
    weights = write_safetensors(tmp_path / "model")
    barrier = threading.Barrier(4)
    digests: list[str] = []

    def start() -> None:
        barrier.wait()
        digests.append(file_digest.file_digest(weights))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(digests)) == 1 and len(digests) == 4
    assert hashed == [weights]


def test_an_unwritable_cache_still_gives_the_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = write_safetensors(tmp_path / "model")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("VLLM_CPU_OFFLOAD_CACHE", str(blocked))
    expected = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert file_digest.file_digest(weights) == expected


def hub_cache(root: Path, files: dict[str, bytes], commit: str = "c" * 40) -> Path:
    """A Hugging Face cache of one model: blobs named by their SHA-256, a snapshot of
    links to them. Returns the snapshot folder."""
    repo = root / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        settle(blob)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot


def test_a_hub_snapshot_agrees_with_a_plain_copy(tmp_path: Path) -> None:
    weights = write_safetensors(tmp_path / "plain")
    snapshot = hub_cache(tmp_path / "hub", {"model.safetensors": weights.read_bytes()})
    (snapshot / "config.json").symlink_to(weights.parent / "config.json")
    from_hub = checkpoint_digest(snapshot)
    # A plain copy of the snapshot's files, and a folder linking to it, agree with it.
    assert checkpoint_digest(weights.parent) == from_hub
    linked = tmp_path / "linked"
    linked.symlink_to(snapshot)
    assert checkpoint_digest(linked) == from_hub


def test_a_fine_tune_saved_through_hub_links_changes_the_identity(
    tmp_path: Path,
) -> None:
    # `save_pretrained` into a folder of Hugging Face cache links writes through them
    # into the blobs: the blobs' names still say the base model's content.
    base = write_safetensors(tmp_path / "base")
    snapshot = hub_cache(tmp_path / "hub", {"model.safetensors": base.read_bytes()})
    before = checkpoint_digest(snapshot)
    tuned = write_safetensors(tmp_path / "tuned", layernorm=[1.5] * 64)
    (snapshot / "model.safetensors").write_bytes(tuned.read_bytes())
    settle((snapshot / "model.safetensors").resolve(), LONG_AGO + 1)
    after = checkpoint_digest(snapshot)
    assert after != before
    assert after == checkpoint_digest(tuned.parent.joinpath("model.safetensors"))


def test_a_blob_is_read_once_per_version(tmp_path: Path, hashed: list[Path]) -> None:
    # Checked against its name at the first start; a later start pays a stat.
    base = write_safetensors(tmp_path / "base")
    snapshot = hub_cache(tmp_path / "hub", {"model.safetensors": base.read_bytes()})
    weights = snapshot / "model.safetensors"
    first = checkpoint_digest(snapshot)
    assert weights in hashed
    file_digest.forget_in_process()
    hashed.clear()
    assert checkpoint_digest(snapshot) == first
    assert hashed == []


def test_a_blob_not_named_by_its_sha256_is_read(tmp_path: Path) -> None:
    # A cache blob whose name is not 64 hex digits (a Git SHA-1): its content counts.
    snapshot = hub_cache(tmp_path / "hub", {"tokenizer.json": b"{}"})
    blob = (snapshot / "tokenizer.json").resolve()
    renamed = blob.with_name("a" * 40)
    blob.rename(renamed)
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(Path("..", "..", "blobs", renamed.name))
    before = checkpoint_digest(snapshot)
    renamed.write_bytes(b"[]")
    assert checkpoint_digest(snapshot) != before


def test_one_file_checkpoint(tmp_path: Path) -> None:
    # A GGUF file served by its path: a change of one byte counts.
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    before = checkpoint_digest(gguf)
    gguf.write_bytes(b"GGUF" + bytes(99) + b"\1")
    assert checkpoint_digest(gguf) != before


def hub_model(name: str = "org/name") -> Any:
    """A model config as vLLM makes it for a hub id, no revision pinned."""
    return SimpleNamespace(model=name, model_weights=None, revision=None)


def test_a_fine_tune_written_through_a_snapshot_changes_the_hub_identity(
    tmp_path: Path,
) -> None:
    # Served by its hub id, loaded from the snapshot of `main`; then fine-tuned and
    # saved into the snapshot folder: same commit, other weights.
    base = write_safetensors(tmp_path / "base")
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, {"model.safetensors": base.read_bytes()})
    (cache / "models--org--name" / "refs").mkdir()
    (cache / "models--org--name" / "refs" / "main").write_text(snapshot.name)
    before = weights_identity(hub_model(), str(cache))
    assert before is not None and before.startswith(f"hub:org/name@{snapshot.name}")
    tuned = write_safetensors(tmp_path / "tuned", layernorm=[1.5] * 64)
    (snapshot / "model.safetensors").write_bytes(tuned.read_bytes())
    settle((snapshot / "model.safetensors").resolve(), LONG_AGO + 1)
    after = weights_identity(hub_model(), str(cache))
    assert after is not None and after.startswith(f"hub:org/name@{snapshot.name}")
    assert after != before


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The plugin's warning lines, as they would be printed."""
    said: list[str] = []

    def collect(message: str, *args: object) -> None:
        said.append(message % args)

    monkeypatch.setattr(logging.getLogger("vllm.cpu_offload"), "warning", collect)
    return said


def test_an_unreadable_weight_file_leaves_the_weights_unidentified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    # The weights file is mode 000 for the user running vLLM (root reads any file:
    # the kernel's refusal is stood in for at the open, by either kind of open).
    weights = write_safetensors(tmp_path / "model")
    real_os_open, real_open = os.open, builtins.open

    def refuse(path: Any) -> None:
        if isinstance(path, (str, Path)) and Path(path) == weights:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        refuse(path)
        return real_os_open(path, *args, **kwargs)

    def open_(path: Any, *args: Any, **kwargs: Any) -> Any:
        refuse(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    config = SimpleNamespace(model=str(weights.parent), model_weights=None)
    assert weights_identity(config, None) is None
    assert weights_identity(config, None) is None  # asked again: said once
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert str(weights) in warnings[0] and "Permission denied" in warnings[0]
    # The tiers' start-up line says why, not "a hub model with no --revision".
    from vllm_cpu_offload.kv_identity import unshared_notice

    engine = SimpleNamespace(
        model_config=config,
        load_config=SimpleNamespace(
            download_dir=None, load_format="auto", model_loader_extra_config={}
        ),
        speculative_config=None,
    )
    notice = unshared_notice(engine, persisted=True, shared=True)
    assert notice is not None and f"{weights} cannot be read" in notice


def test_a_weight_file_that_fails_to_read_leaves_the_weights_unidentified(
    tmp_path: Path, warnings: list[str]
) -> None:
    # A file that opens and then fails at its first read (EIO, as from a failing disk
    # or a network mount): /proc/self/mem at address 0.
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to("/proc/self/mem")
    config = SimpleNamespace(model=str(model), model_weights=None)
    assert weights_identity(config, None) is None
    assert len(warnings) == 1 and "model.safetensors" in warnings[0]


def test_a_fifo_served_as_the_checkpoint_leaves_the_weights_unidentified(
    tmp_path: Path, warnings: list[str]
) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    config = SimpleNamespace(model=str(fifo), model_weights=None)
    assert weights_identity(config, None) is None
    assert len(warnings) == 1 and str(fifo) in warnings[0]
