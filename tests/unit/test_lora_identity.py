"""A LoRA request's block hashes, made by vLLM's own block hasher, depend on the
adapter's contents once `lora_identity` is installed: an adapter retrained in place
gets other hashes in the next process, an unchanged one the same."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from vllm_cpu_offload import file_digest, lora_identity, stat_trust  # noqa: E402

BLOCK_SIZE = 16
BLOCKS = 8
FUSE_SUPER_MAGIC = 0x65735546  # statfs(2)'s f_type of a FUSE mount
init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)


@pytest.fixture(autouse=True)
def fresh_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The LoRA keys of vLLM itself during the test (a connector built by an earlier
    test of this process installed ours), whatever was installed again after it, and
    no identity known before it."""
    current = kv_cache_utils._gen_lora_extra_hash_keys
    vllm_own = getattr(current, "_vllm_lora_keys", current)
    monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys", vllm_own)
    monkeypatch.setenv("VLLM_CPU_OFFLOAD_CACHE", str(tmp_path / "cache"))
    new_process()
    yield
    new_process()


def new_process() -> None:
    lora_identity.forget()
    file_digest.forget_in_process()


def write_adapter(folder: Path, scale: float) -> None:
    """A PEFT adapter folder: its config and a safetensors file of one LoRA tensor."""
    data = struct.pack("<64f", *([scale] * 64))
    header = json.dumps(
        {"lora_A.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}}
    ).encode()
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (folder / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + data
    )
    os.utime(folder / "adapter_model.safetensors", (1_000_000_000, 1_000_000_000))


def lora_request(adapter: Path | str, load_inplace: bool = False) -> Request:
    lora = LoRARequest("sql-adapter", 1, str(adapter), load_inplace=load_inplace)
    request = Request(
        "r",
        list(range(BLOCK_SIZE * BLOCKS)),
        SamplingParams(max_tokens=1),
        None,
        lora_request=lora,
        block_hasher=HASHER,
    )
    assert len(request.block_hashes) == BLOCKS
    return request


def block_hashes(adapter: Path | str, load_inplace: bool = False) -> list[bytes]:
    return list(lora_request(adapter, load_inplace).block_hashes)


def test_vllm_alone_keys_an_adapter_by_its_name_and_path(tmp_path: Path) -> None:
    # The defect: retrained in place, the adapter's blocks keep their hashes.
    adapter = tmp_path / "adapter"
    write_adapter(adapter, 1.0)
    before = block_hashes(adapter)
    write_adapter(adapter, 2.0)
    assert block_hashes(adapter) == before


def test_an_adapter_retrained_in_place_gets_other_hashes(tmp_path: Path) -> None:
    # A restart of the file tier after the adapter was retrained at the same path.
    lora_identity.install()
    adapter = tmp_path / "adapter"
    write_adapter(adapter, 1.0)
    before = block_hashes(adapter)
    new_process()
    write_adapter(adapter, 2.0)
    assert block_hashes(adapter) != before


@pytest.mark.parametrize("load_inplace", [False, True], ids=["reloaded", "inplace"])
def test_an_adapter_rewritten_while_the_engine_runs_is_this_process_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, load_inplace: bool
) -> None:
    # Rewritten in place in a running engine: the workers may hold either version
    # (reloaded after an eviction, or in place), so no file digest names what they
    # compute with. New requests get this process's keys; another process that
    # sees the same rewrite gets others.
    lora_identity.install()
    adapter = tmp_path / "adapter"
    write_adapter(adapter, 1.0)
    first = block_hashes(adapter)
    write_adapter(adapter, 2.0)
    after = block_hashes(adapter, load_inplace=load_inplace)
    assert after != first
    assert block_hashes(adapter) == after  # the requests after it alike
    new_process()
    monkeypatch.setattr(lora_identity, "_PROCESS_TOKEN", "another process")
    write_adapter(adapter, 1.0)
    assert block_hashes(adapter) == first  # the first files, another start
    write_adapter(adapter, 2.0)
    assert block_hashes(adapter) != after


def test_a_request_hashed_before_its_adapter_changed_is_kept_out_of_the_tier(
    tmp_path: Path,
) -> None:
    # Queued before an in-place reload, a request runs on the new files with the
    # old files' hashes: its KV must not be stored or loaded under them.
    lora_identity.install()
    adapter = tmp_path / "adapter"
    write_adapter(adapter, 1.0)
    queued = lora_request(adapter)
    assert lora_identity.hashes_hold(queued)
    write_adapter(adapter, 2.0)
    reloading = lora_request(adapter, load_inplace=True)
    assert not lora_identity.hashes_hold(queued)
    assert lora_identity.hashes_hold(reloading)
    write_adapter(adapter, 1.0)  # the old files back: still no telling
    assert not lora_identity.hashes_hold(queued)


def test_each_rewrite_of_an_adapter_in_a_running_engine_is_a_new_identity(
    tmp_path: Path,
) -> None:
    # An RL loop writes step N+2 over N+1 and reloads in place: the requests after
    # each reload get keys no earlier version had, and a request queued between the
    # two rewrites (hashed on N+1) runs on N+2's files: it neither loads nor stores.
    lora_identity.install()
    adapter = tmp_path / "adapter"
    write_adapter(adapter, 1.0)
    first = block_hashes(adapter)
    write_adapter(adapter, 2.0)
    second = block_hashes(adapter, load_inplace=True)
    queued = lora_request(adapter)
    assert lora_identity.hashes_hold(queued)
    write_adapter(adapter, 3.0)
    third = lora_request(adapter, load_inplace=True)
    assert not lora_identity.hashes_hold(queued)
    assert lora_identity.hashes_hold(third)
    assert len({first[0], second[0], third.block_hashes[0]}) == 3
    assert not set(third.block_hashes) & (set(first) | set(second))
    assert block_hashes(adapter) == list(third.block_hashes)  # N+2 stays N+2
    write_adapter(adapter, 2.0)  # N+1's files back: a version of its own again
    assert not set(block_hashes(adapter)) & (set(second) | set(third.block_hashes))


def test_an_adapter_where_stat_proves_nothing_stays_out_of_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a FUSE mount whose server keeps a file's stat when its object is replaced
    # (same size and time, its ctime made up): no look at stat tells the rewrite,
    # so no request of the adapter loads or stores, and another process that finds
    # the same files gets other keys.
    real = file_digest.FileVersion.of
    monkeypatch.setattr(
        file_digest.FileVersion,
        "of",
        classmethod(lambda cls, path: dataclasses.replace(real(path), ctime_ns=0)),
    )
    monkeypatch.setattr(stat_trust, "fs_magic", lambda path: FUSE_SUPER_MAGIC)
    lora_identity.install()
    adapter = tmp_path / "adapter"
    write_adapter(adapter, 1.0)
    queued = lora_request(adapter)
    assert not lora_identity.hashes_hold(queued)
    write_adapter(adapter, 2.0)
    reloading = lora_request(adapter, load_inplace=True)
    assert not lora_identity.hashes_hold(queued)
    assert not lora_identity.hashes_hold(reloading)
    new_process()
    monkeypatch.setattr(lora_identity, "_PROCESS_TOKEN", "another process")
    assert block_hashes(adapter) != list(reloading.block_hashes)


def test_a_request_keeps_the_keys_of_its_first_block(tmp_path: Path) -> None:
    # The blocks a request adds while it decodes take the identity it was hashed
    # with first, so its chain of hashes stays one adapter's.
    lora_identity.install()
    adapter = tmp_path / "adapter"
    write_adapter(adapter, 1.0)
    request = lora_request(adapter)
    keys = kv_cache_utils._gen_lora_extra_hash_keys(request)
    write_adapter(adapter, 2.0)
    assert kv_cache_utils._gen_lora_extra_hash_keys(request) == keys


def test_an_unchanged_adapter_keeps_its_hashes(tmp_path: Path) -> None:
    # Hosts of a fleet holding equal adapter files (rewritten, same bytes): one key.
    lora_identity.install()
    adapter = tmp_path / "adapter"
    write_adapter(adapter, 1.0)
    before = block_hashes(adapter)
    new_process()
    write_adapter(adapter, 1.0)
    assert block_hashes(adapter) == before
    lora_identity.install()  # a second connector in the process changes nothing
    assert block_hashes(adapter) == before


def test_requests_without_lora_are_hashed_as_before() -> None:
    tokens = list(range(BLOCK_SIZE * 2))
    params = SamplingParams(max_tokens=1)
    plain = Request("a", tokens, params, None, block_hasher=HASHER).block_hashes
    lora_identity.install()
    assert Request("b", tokens, params, None, block_hasher=HASHER).block_hashes == plain


def test_the_adapter_is_read_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM asks once per block, and each request checks its adapter: the files are
    # stat-ed per request, read once.
    reads: list[Path] = []
    real = file_digest._read_and_hash

    def counting(path: Path, version: file_digest.FileVersion) -> tuple[str, bool]:
        reads.append(path)
        return real(path, version)

    monkeypatch.setattr(file_digest, "_read_and_hash", counting)
    lora_identity.install()
    adapter = tmp_path / "adapter"
    write_adapter(adapter, 1.0)
    os.utime(adapter / "adapter_config.json", (1_000_000_000, 1_000_000_000))
    request = lora_request(adapter)
    assert lora_identity.hashes_hold(request)
    block_hashes(adapter)
    assert sorted(p.name for p in reads) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def test_a_hub_adapter_is_this_process_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # A hub id is resolved by the workers: nothing here names its contents.
    lora_identity.install()
    before = block_hashes("org/sql-adapter")
    assert block_hashes("org/sql-adapter") == before
    new_process()
    monkeypatch.setattr(lora_identity, "_PROCESS_TOKEN", "another process")
    assert block_hashes("org/sql-adapter") != before


def test_the_scheduler_half_installs_it(tiny_model: str) -> None:
    # The engine core's half of the connector, where vLLM hashes blocks.
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.unit.connector_configs import one_layer_kv_config
    from vllm_cpu_offload.connector import CPUOffloadConnector

    vllm_own = kv_cache_utils._gen_lora_extra_hash_keys
    config = VllmConfig(
        model_config=ModelConfig(model=tiny_model),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        kv_transfer_config=KVTransferConfig(
            kv_connector="CPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"swap_space_gib": 16 * 4 * BLOCK_SIZE / 2**30},
        ),
    )
    config.cache_config.kv_cache_layout = "LBNHC"
    CPUOffloadConnector(
        config, KVConnectorRole.SCHEDULER, one_layer_kv_config(BLOCK_SIZE)
    )
    installed = kv_cache_utils._gen_lora_extra_hash_keys
    assert installed is not vllm_own
    assert installed._vllm_lora_keys is vllm_own  # type: ignore[attr-defined]
