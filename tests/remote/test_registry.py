"""Backends by URL: a user's class by `py://` import path or by an entry point's
scheme, and one-line refusals of bad ones. (The built-in stores' URLs are tested with
each store: test_redis_faults.py, test_mooncake_faults.py.)"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.remote.registry import check_remote_url, open_store
from vllm_cpu_offload.remote.store import RemoteStore, Span
from vllm_cpu_offload.remote.url import ENTRY_POINT_GROUP, RemoteUrl
from vllm_cpu_offload.remote.value_format import CHECKSUM_MODULE

from .conftest import requires, without_module

# Every store's values are checked with CRC-32C: without the library no URL resolves.
needs_checksums = requires(CHECKSUM_MODULE)


class DictStore(RemoteStore):
    """A user's backend: a dict in this process."""

    def __init__(self, url: RemoteUrl, *, role: str) -> None:
        self.url, self.role = url, role
        self.values: dict[str, bytes] = {}

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        return [k in self.values for k in keys]

    def put(
        self, keys: Sequence[str], values: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        return [True for _ in keys]

    def get(
        self, keys: Sequence[str], into: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        return [False for _ in keys]

    @property
    def description(self) -> str:
        return "a dict"


class HalfStore(RemoteStore):
    """Forgets `get` and `description`."""

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        return []

    def put(
        self, keys: Sequence[str], values: Sequence[Sequence[Span]], timeout_s: float
    ) -> list[bool]:
        return []


class NotAStore:
    pass


HERE = __name__


@needs_checksums
def test_user_class_by_import_path() -> None:
    # py://module:Class builds that class with the parsed URL and the role.
    store = open_store(f"py://{HERE}:DictStore?bucket=b", role="scheduler")
    assert isinstance(store, DictStore)
    assert store.role == "scheduler" and store.url.option("bucket") == "b"


@pytest.mark.parametrize(
    ("target", "fix"),
    [
        (f"{HERE}:NotAStore", "subclass it"),
        (f"{HERE}:HalfStore", "implement every abstract method"),
        (f"{HERE}:Nothing", "fix the path"),
        ("no_such_pkg.mod:Store", "install it or fix the path"),
    ],
)
@needs_checksums
def test_bad_user_classes_are_refused(target: str, fix: str) -> None:
    # A class that is missing or not a complete RemoteStore: one line with the fix.
    with pytest.raises(OffloadConfigError) as raised:
        check_remote_url(f"py://{target}")
    assert "\n" not in str(raised.value) and fix in str(raised.value)


@needs_checksums
def test_entry_point_scheme(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A scheme an installed distribution declares resolves to its class; a broken
    # entry point is refused with the group named.
    info = tmp_path / "dictstore-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Name: dictstore\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ndict = {HERE}:DictStore\nbroken = nowhere:X\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    store = open_store("dict://somewhere:9?x=1", role="worker")
    assert isinstance(store, DictStore) and store.url.host == "somewhere"
    with pytest.raises(OffloadConfigError, match=ENTRY_POINT_GROUP):
        check_remote_url("broken://h:1")


def test_bad_role() -> None:
    # A role other than the two sides is our bug, not the user's.
    with pytest.raises(ValueError, match="role"):
        open_store(f"py://{HERE}:DictStore", role="both")


def test_missing_checksum_library_is_named_for_every_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without_module(monkeypatch, "google_crc32c")
    for url in ("redis://h:6379", f"py://{HERE}:DictStore"):
        with pytest.raises(OffloadConfigError, match="pip install google-crc32c"):
            check_remote_url(url)
