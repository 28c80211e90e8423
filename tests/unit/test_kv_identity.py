"""The shared tier's namespace and the persistent tier's fingerprint: one description of
what a block's bytes depend on. Each thing that changes the bytes, changed alone,
changes both; equal engines agree; weights that nothing identifies are never shared or
restored."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")


from tests.unit.connector_configs import (  # noqa: E402
    one_layer_kv_config,
    vllm_config,
    with_connector,
)
from vllm_cpu_offload.persist.block_index import BlockIndex  # noqa: E402
from vllm_cpu_offload.persist.data_file import TierDataFile  # noqa: E402
from vllm_cpu_offload.persist.fingerprint import tier_fingerprint  # noqa: E402
from vllm_cpu_offload.remote.namespace import namespace_of  # noqa: E402
from vllm_cpu_offload.scheduler.kv_groups import KVGroup  # noqa: E402

GROUPS = (KVGroup(0),)
HOST_BLOCKS = 8
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def namespace(config: Any) -> str | None:
    return namespace_of(config, GROUPS, 1)


def fingerprint(config: Any) -> dict[str, Any]:
    return tier_fingerprint(config, GROUPS, HOST_BLOCKS, 1)


def as_hub_model(config: Any, cache_dir: Path, revision: str | None = None) -> Any:
    """`config` as if its model had come from the hub with `cache_dir` as
    `--download-dir`."""
    config.model_config.model = "org/model"
    config.model_config.revision = revision
    config.load_config.download_dir = str(cache_dir)
    return config


def hub_snapshot(cache_dir: Path, commit: str) -> None:
    """The Hugging Face cache after downloading org/model at `commit` as `main`."""
    repo = cache_dir / "models--org--model"
    (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def _backend(name: str) -> Any:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def _set(path: str, value: Callable[[], Any]) -> Callable[[Any], None]:
    def change(config: Any) -> None:
        *parents, attr = path.split(".")
        target = config
        for p in parents:
            target = getattr(target, p)
        setattr(target, attr, value())

    return change


# One change at a time, each one that gives other KV bytes for the same tokens.
CHANGES = {
    "layout-NHD-to-HND": _set("cache_config.kv_cache_layout", lambda: "LBHNC"),
    "attention-backend": _set(
        "attention_config.backend", lambda: _backend("FLASHINFER")
    ),
    "attention-backend-per-kind": _set(
        "attention_config.backend_per_kind",
        lambda: {"full_attention": _backend("FLEX_ATTENTION")},
    ),
    "weight-quantization-fp8": _set("model_config.quantization", lambda: "fp8"),
    "rope-scaling": _set(
        "model_config.hf_text_config.rope_parameters",
        lambda: {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    ),
    "kv-cache-quantization-skips-a-layer": _set(
        "cache_config.kv_cache_dtype_skip_layers", lambda: ["0"]
    ),
    "decode-context-parallel": _set(
        "parallel_config.decode_context_parallel_size", lambda: 2
    ),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_each_change_of_the_kv_bytes_changes_namespace_and_fingerprint(
    tiny_model: str, change: Callable[[Any], None]
) -> None:
    base, changed = vllm_config(tiny_model), vllm_config(tiny_model)
    change(changed)
    assert namespace(base) is not None and namespace(changed) is not None
    assert namespace(changed) != namespace(base)
    assert fingerprint(changed) != fingerprint(base)


def test_the_tp_size_is_left_out_where_values_do_not_depend_on_it(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tp1, tp2 = vllm_config(tiny_model), vllm_config(tiny_model)
    tp2.parallel_config.tensor_parallel_size = 2
    # One value per KV head: a head's bytes are the same at any TP size.
    assert namespace(tp1) == namespace(tp2)
    # The persistent tier's files hold each rank's own slots: pinned to the TP size.
    assert fingerprint(tp1) != fingerprint(tp2)
    # MLA: every rank holds the whole latent KV, the same at any TP size.
    monkeypatch.setattr(type(tp1.model_config), "use_mla", property(lambda _: True))
    assert namespace(tp1) == namespace(tp2)
    assert namespace(tp1) != namespace(vllm_config(tiny_model, dtype="float16"))
    monkeypatch.undo()
    # Context parallelism splits the tokens too: a rank's values need its TP size.
    tp1.parallel_config.decode_context_parallel_size = 2
    tp2.parallel_config.decode_context_parallel_size = 2
    assert namespace(tp1) != namespace(tp2)


def test_equal_engines_agree_in_every_process(tiny_model: str) -> None:
    # Two engines built alike, and a worker's pickled copy: one namespace, one
    # fingerprint.
    a, b = vllm_config(tiny_model), vllm_config(tiny_model)
    worker_copy = pickle.loads(pickle.dumps(a))
    assert namespace(a) == namespace(b) == namespace(worker_copy)
    named = namespace(a)
    assert named is not None and named.startswith("vco-")
    assert fingerprint(a) == fingerprint(b) == fingerprint(worker_copy)


def _write_checkpoint(
    folder: Path, k_scale: float = 0.5, scale_name: str = "k_scale", seed: int = 0
) -> None:
    """A safetensors checkpoint over 1 MiB: two weights with a KV-cache scale between
    them (out of reach of any sampled run)."""
    rng = random.Random(seed)
    tensors = {
        "layers.0.attn.qkv.weight": rng.randbytes(1 << 20),
        f"layers.0.attn.{scale_name}": struct.pack("<f", k_scale),
        "layers.0.mlp.weight": rng.randbytes(1 << 20),
    }
    header: dict[str, Any] = {}
    offset = 0
    for name, data in tensors.items():
        header[name] = {
            "dtype": "U8",
            "shape": [len(data)],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header).encode()
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(
        struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())
    )


@pytest.fixture
def local_model(tiny_model: str, tmp_path: Path) -> Path:
    """The tiny model's configs and tokenizer with a checkpoint of our own."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    _write_checkpoint(folder)
    return folder


@pytest.mark.parametrize(
    "rewrite",
    [
        lambda f: _write_checkpoint(f, k_scale=0.25),
        lambda f: _write_checkpoint(f, scale_name="v_scale"),
        lambda f: _write_checkpoint(f, seed=1),
    ],
    ids=["recalibrated-kv-scale", "header-only", "fine-tune-of-the-same-shape"],
)
def test_weights_rewritten_to_the_same_size_change_the_namespace(
    local_model: Path, rewrite: Callable[[Path], None]
) -> None:
    before = namespace(vllm_config(str(local_model)))
    rewrite(local_model)
    after = namespace(vllm_config(str(local_model)))
    assert before is not None and after is not None and after != before


def _with_drafter(config: Any, method: str, drafter: Any) -> Any:
    """`config` as vLLM resolves a speculative config with `drafter`'s model config
    (None: a method without a draft model)."""
    from types import SimpleNamespace

    model = None if drafter is None else str(drafter.model)
    config.speculative_config = SimpleNamespace(
        method=method, model=model, draft_model_config=drafter
    )
    return config


def test_the_drafter_and_its_weights_are_part_of_the_identity(
    local_model: Path, tiny_model: str, tmp_path: Path
) -> None:
    # Engines with another drafter, or none, write other bytes in the drafter's
    # layers: they share nothing. A draft model's weights count as the target's do.
    from vllm.config import ModelConfig

    drafter = tmp_path / "drafter"
    shutil.copytree(local_model, drafter)
    plain = namespace(vllm_config(tiny_model))
    ngram = namespace(_with_drafter(vllm_config(tiny_model), "ngram", None))
    draft = namespace(
        _with_drafter(vllm_config(tiny_model), "draft_model", ModelConfig(str(drafter)))
    )
    assert len({plain, ngram, draft}) == 3 and None not in {plain, ngram, draft}
    _write_checkpoint(drafter, seed=1)  # the drafter fine-tuned, at the same path
    retrained = namespace(
        _with_drafter(vllm_config(tiny_model), "draft_model", ModelConfig(str(drafter)))
    )
    assert retrained is not None and retrained != draft
    # A drafter whose weights nothing names shares nothing.
    unnamed = ModelConfig(str(drafter))
    unnamed.model_weights = "s3://bucket/drafter"
    config = _with_drafter(vllm_config(tiny_model), "draft_model", unnamed)
    assert namespace(config) is None


def test_a_copy_of_the_same_weights_shares(local_model: Path) -> None:
    # Machines of a fleet hold their own copies, with their own modification times.
    before = vllm_config(str(local_model))
    os.utime(local_model / "model.safetensors", (1, 1))
    assert namespace(vllm_config(str(local_model))) == namespace(before)


def test_a_hub_model_is_named_by_the_snapshot_it_was_loaded_from(
    tiny_model: str, tmp_path: Path
) -> None:
    # No --revision: `main` moved between two engines' downloads.
    hub_snapshot(tmp_path, COMMIT_A)
    first = namespace(as_hub_model(vllm_config(tiny_model), tmp_path))
    again = namespace(as_hub_model(vllm_config(tiny_model), tmp_path))
    hub_snapshot(tmp_path, COMMIT_B)
    moved = namespace(as_hub_model(vllm_config(tiny_model), tmp_path))
    assert first is not None and first == again
    assert moved is not None and moved != first


def test_a_hub_model_with_nothing_that_names_its_weights_is_not_shared(
    tiny_model: str, tmp_path: Path
) -> None:
    config = as_hub_model(vllm_config(tiny_model), tmp_path / "empty-cache")
    assert namespace(config) is None
    assert fingerprint(config)["weights"] != fingerprint(config)["weights"]
    from vllm_cpu_offload.kv_identity import unshared_notice

    notice = unshared_notice(config, persisted=True, shared=True)
    assert notice is not None and "\n" not in notice
    assert "shared tier is off" in notice and "--revision" in notice
    assert "weights_id" in notice
    assert unshared_notice(config, persisted=False, shared=False) is None
    pinned = as_hub_model(vllm_config(tiny_model), tmp_path, revision=COMMIT_A)
    assert namespace(pinned) is not None
    assert unshared_notice(pinned, persisted=True, shared=True) is None
    # A branch or a tag names no files: `main` moves.
    moving = as_hub_model(vllm_config(tiny_model), tmp_path / "empty", revision="v1")
    assert namespace(moving) is None


def test_weights_streamed_from_an_object_store_are_not_shared(tiny_model: str) -> None:
    config = vllm_config(tiny_model)
    config.model_config.model_weights = "s3://bucket/model"
    assert namespace(config) is None


@pytest.mark.parametrize("identified", [True, False])
def test_a_tier_of_unidentified_weights_starts_empty_at_every_start(
    tiny_model: str, tmp_path: Path, identified: bool
) -> None:
    def start() -> tuple[TierDataFile, BlockIndex, list[Any]]:
        config = vllm_config(tiny_model)
        if not identified:
            as_hub_model(config, tmp_path / "empty-cache")
        fp = fingerprint(config)
        data = TierDataFile(str(tier), "tp0-pp0", fp)
        data.map(HOST_BLOCKS, 64, {"layer": "layout"})
        index = BlockIndex(str(tier), fp, HOST_BLOCKS, ["tp0-pp0"])
        return data, index, index.open()

    tier = tmp_path / "tier"
    tier.mkdir(mode=0o700)
    data, index, _ = start()
    index.record([(0, (0, bytes(32)), None)])
    index.close()
    data.close()
    _, _, restored = start()
    assert len(restored) == (1 if identified else 0)


def test_the_connector_runs_without_the_shared_tier_and_says_so_once(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_cpu_offload import connector as connector_module
    from vllm_cpu_offload.remote import layer as shared_tier_layer
    from vllm_cpu_offload.scheduler.tier_seams import NoSharedTier

    def no_store(*args: object, **kwargs: object) -> None:
        raise AssertionError("an engine that shares nothing opened the store")

    warnings: list[str] = []
    monkeypatch.setattr(shared_tier_layer, "open_store", no_store)
    monkeypatch.setattr(shared_tier_layer.logger, "warning", warnings.append)
    config = as_hub_model(vllm_config(tiny_model), tmp_path)
    with_connector(config, remote_url="redis://127.0.0.1:9")
    connector = connector_module.CPUOffloadConnector(
        config, KVConnectorRole.SCHEDULER, one_layer_kv_config()
    )
    assert connector.scheduler is not None
    assert type(connector.scheduler.shared) is NoSharedTier
    assert len(warnings) == 1 and "shared tier is off" in warnings[0]


@pytest.mark.parametrize(
    "load_format", ["dummy", "ipc_cache", "modelexpress", "my_plugin_loader"]
)
def test_weights_a_loader_makes_up_or_brings_from_elsewhere_are_not_shared(
    tiny_model: str, load_format: str
) -> None:
    # Random values, another process's memory, a peer, a plugin's loader: the
    # files at --model say nothing of them.
    config = vllm_config(tiny_model)
    config.load_config.load_format = load_format
    assert namespace(config) is None
    from vllm_cpu_offload.kv_identity import unshared_notice

    notice = unshared_notice(config, persisted=False, shared=True)
    assert notice is not None and load_format in notice and "weights_id" in notice


def test_tensorizer_weights_are_named_by_the_file_they_come_from(
    tiny_model: str, tmp_path: Path
) -> None:
    # Two engines on one --model that deserialize different tensorizer files share
    # nothing; the same file shares; a URI nothing here can read shares nothing.
    def with_tensors(uri: str) -> Any:
        config = vllm_config(tiny_model)
        config.load_config.load_format = "tensorizer"
        config.load_config.model_loader_extra_config = {"tensorizer_uri": uri}
        return config

    first, second = tmp_path / "a.tensors", tmp_path / "b.tensors"
    first.write_bytes(b"\x01" * 4096)
    second.write_bytes(b"\x02" * 4096)
    a = namespace(with_tensors(str(first)))
    assert a is not None and a == namespace(with_tensors(str(first)))
    assert namespace(with_tensors(str(second))) not in (None, a)
    assert namespace(with_tensors("s3://bucket/model.tensors")) is None


@pytest.mark.parametrize("load_format", ["sharded_state", "runai_streamer"])
def test_a_streaming_loader_is_proven_by_local_files_only(
    tiny_model: str, load_format: str
) -> None:
    config = vllm_config(tiny_model)
    config.load_config.load_format = load_format
    assert namespace(config) is not None
    config.model_config.model_weights = "s3://bucket/model"
    assert namespace(config) is None


def test_modelscope_hub_ids_are_not_taken_from_the_hugging_face_cache(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The Hugging Face cache may hold another repository of the same name.
    hub_snapshot(tmp_path, COMMIT_A)
    assert namespace(as_hub_model(vllm_config(tiny_model), tmp_path)) is not None
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "True")
    assert namespace(as_hub_model(vllm_config(tiny_model), tmp_path)) is None


def test_the_operator_names_weights_the_tier_cannot_prove(
    tiny_model: str, tmp_path: Path
) -> None:
    # weights_id: the operator's word that engines giving the name compute the
    # same KV; another name shares nothing, and the start-up line says so.
    from vllm_cpu_offload.kv_identity import unshared_notice

    def named(name: str | None) -> Any:
        config = with_connector(vllm_config(tiny_model))
        config.load_config.load_format = "dummy"
        extra = config.kv_transfer_config.kv_connector_extra_config
        if name is not None:
            extra["weights_id"] = name
        return config

    assert namespace(named(None)) is None
    ours = namespace(named("ft-2026-11-20"))
    assert ours is not None and ours == namespace(named("ft-2026-11-20"))
    assert namespace(named("ft-2026-11-27")) not in (None, ours)
    notice = unshared_notice(named("ft-2026-11-20"), persisted=True, shared=True)
    assert notice is not None and "ft-2026-11-20" in notice


def test_engine_level_media_settings_change_the_identity(tiny_model: str) -> None:
    # --mm-processor-kwargs (e.g. max_pixels) is not in vLLM's model config digest,
    # and an item's hash covers only a request's own kwargs: two engines that
    # resize images differently would share placeholder blocks of other bytes.
    from vllm.config import MultiModalConfig

    def with_media(kwargs: dict[str, Any]) -> Any:
        config = vllm_config(tiny_model)
        config.model_config.multimodal_config = MultiModalConfig(
            mm_processor_kwargs=kwargs
        )
        return config

    small = namespace(with_media({"max_pixels": 200_704}))
    assert small is not None and small == namespace(with_media({"max_pixels": 200_704}))
    assert namespace(with_media({"max_pixels": 1_003_520})) != small
