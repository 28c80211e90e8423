"""A LoRA adapter rewritten in place twice while the engine runs, through vLLM's own
Scheduler with both halves of our connector (see
test_vllm_scheduler_with_our_connector.py): vLLM's block hasher makes each request's
hashes (`lora_identity` installed by the scheduler half), and the forward writes
token + the version of the adapter's files the workers hold, and checks every slot a
step reads. KV that one version of the files computed, read by a request that runs on
another, shows as a wrong value.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.request import Request  # noqa: E402

from tests.vllm_helpers.test_vllm_scheduler_with_our_connector import (  # noqa: E402
    BLOCK_SIZE,
    Engine,
    vllm_utils,  # noqa: F401 (a fixture)
)
from vllm_cpu_offload import file_digest, lora_identity  # noqa: E402

PROMPT_TOKENS = 5 * BLOCK_SIZE + 3  # 5 full blocks
# Requests of other prompts that take the 24-block device cache: what a LoRA request
# reads after them comes from the host tier, or is computed.
FLUSH_SEEDS = (2, 3, 4, 5, 6)


@pytest.fixture
def engine(
    vllm_utils: ModuleType,  # noqa: F811
    tiny_model: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Engine]:
    # vLLM's own LoRA keys until the scheduler half installs ours, and no identity
    # known before the test: a process that starts now.
    current = kv_cache_utils._gen_lora_extra_hash_keys
    vllm_own = getattr(current, "_vllm_lora_keys", current)
    monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys", vllm_own)
    monkeypatch.setenv("VLLM_CPU_OFFLOAD_CACHE", str(tmp_path / "cache"))
    lora_identity.forget()
    file_digest.forget_in_process()
    engine = Engine(vllm_utils, tiny_model)
    yield engine
    engine.worker.shutdown()
    lora_identity.forget()
    file_digest.forget_in_process()


def write_adapter(folder: Path, version: int) -> None:
    """The adapter's files at `version`: one size and modification time for every
    version, as a training loop that writes step N+1 over step N may leave them."""
    data = struct.pack("<64f", *([float(version)] * 64))
    header = json.dumps(
        {"lora_A.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}}
    ).encode()
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(struct.pack("<Q", len(header)) + header + data)
    os.utime(weights, (1_000_000_000, 1_000_000_000))


def lora_request(request_id: str, adapter: Path, load_inplace: bool = True) -> Request:
    """A request on the adapter, hashed now by vLLM's block hasher (as vLLM's
    `create_request` makes them, with the adapter added)."""
    init_none_hash(sha256)  # as vLLM's `create_request` does
    params = SamplingParams(max_tokens=8)
    params.update_from_generation_config({}, 7)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(PROMPT_TOKENS)),
        sampling_params=params,
        pooling_params=None,
        lora_request=LoRARequest("policy", 1, str(adapter), load_inplace=load_inplace),
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def reload(engine: Engine, adapter: Path, version: int) -> None:
    """The files rewritten at `version` and loaded by the workers in place: what
    they compute from now on differs."""
    write_adapter(adapter, version)
    engine.weights = float(version)


def flush_device_cache(engine: Engine) -> None:
    version, engine.weights = engine.weights, 0.0  # no adapter: the base model's KV
    for seed in FLUSH_SEEDS:
        engine.run(engine.request(seed, 6 * BLOCK_SIZE))
    engine.weights = version


def stored_and_flushed(engine: Engine, adapter: Path) -> Any:
    """Versions 1 and 2 of the files each computed the prompt (stored in the host
    tier), and the device cache holds neither."""
    reload(engine, adapter, 1)
    engine.run(lora_request("v1", adapter, load_inplace=False))
    reload(engine, adapter, 2)
    engine.run(lora_request("v2", adapter))
    flush_device_cache(engine)
    return engine.tier.stats.loaded_blocks


def test_a_request_after_the_second_reload_reads_no_kv_of_the_second_files(
    engine: Engine, tmp_path: Path
) -> None:
    adapter = tmp_path / "adapter"
    loaded = stored_and_flushed(engine, adapter)
    assert engine.tier.stats.stored_blocks >= 2 * 5
    reload(engine, adapter, 3)
    engine.run(lora_request("v3", adapter))  # the forward checks every slot it reads
    assert engine.tier.stats.loaded_blocks == loaded
    flush_device_cache(engine)
    loaded = engine.tier.stats.loaded_blocks
    engine.run(lora_request("v3-again", adapter, load_inplace=False))
    assert engine.tier.stats.loaded_blocks - loaded == 5  # the third files' own KV
    assert engine.invalid_blocks == 0


def test_a_request_queued_between_the_rewrites_neither_loads_nor_stores(
    engine: Engine, tmp_path: Path
) -> None:
    # Hashed while the files are at version 2, it runs after version 3 was loaded.
    adapter = tmp_path / "adapter"
    loaded = stored_and_flushed(engine, adapter)
    queued = lora_request("queued", adapter, load_inplace=False)
    reload(engine, adapter, 3)
    stored = engine.tier.stats.stored_blocks
    engine.run(queued)
    assert engine.tier.stats.loaded_blocks == loaded
    assert engine.tier.stats.stored_blocks == stored
    assert len(queued.output_token_ids) == 8 and engine.invalid_blocks == 0
