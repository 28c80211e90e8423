"""The weights identity is made of the files vLLM's loader opened: a model's secondary
sources (`secondary_weights`, read through vLLM's own `DefaultModelLoader`) are in it,
a read no digest names makes the shared and file tiers private, and the engine core
names the weights by what every worker read."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.unit.connector_configs import vllm_config, with_connector  # noqa: E402
from vllm_cpu_offload import weight_reads  # noqa: E402
from vllm_cpu_offload.persist.fingerprint import tier_fingerprint  # noqa: E402
from vllm_cpu_offload.remote.namespace import namespace_of  # noqa: E402
from vllm_cpu_offload.scheduler.kv_groups import KVGroup  # noqa: E402
from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama  # noqa: E402
from vllm_cpu_offload.weight_reads import StartWeights  # noqa: E402

GROUPS = (KVGroup(0),)


@pytest.fixture
def observed() -> Iterator[None]:
    """vLLM's loader observed, in a process where nothing loaded yet."""
    weight_reads.install_read_observer()
    with weight_reads.forget_start():
        yield


def loaded(load: Callable[[], Any], model: Path) -> None:
    """`load` run as a load of `model` at start is (`get_model_loader`'s
    `load_model`)."""
    config = SimpleNamespace(model=str(model))
    weight_reads._observed_load(lambda **_: load(), model_config=config)


def tower(folder: Path, value: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {"proj.weight": torch.full((4, 4), value)}, str(folder / "model.safetensors")
    )
    return folder


def load_with_secondary(primary: Path, secondary: Path) -> None:
    """What vLLM's default loader reads for a model that names a second source, as
    Ultravox names its audio tower (default_loader.py:382)."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    loader = DefaultModelLoader(LoadConfig(load_format="safetensors"))
    model = torch.nn.Module()
    model.secondary_weights = [  # type: ignore[assignment]
        DefaultModelLoader.Source(str(secondary), None, prefix="audio_tower.")
    ]
    config = SimpleNamespace(model=str(primary), revision=None)
    loaded(lambda: [n for n, _ in loader.get_all_weights(config, model)], primary)  # type: ignore[arg-type]


def engine_namespace(primary: Path) -> str | None:
    config = with_connector(vllm_config(str(primary)), remote_url="redis://h:1")
    return namespace_of(config, GROUPS, 1)


def test_engines_whose_secondary_weights_differ_share_no_namespace(
    observed: None, tmp_path: Path
) -> None:
    primary = ensure_tiny_llama()
    namespaces = []
    for value in (1.0, 2.0):
        with weight_reads.forget_start():
            load_with_secondary(primary, tower(tmp_path / f"tower{value}", value))
            namespaces.append(engine_namespace(primary))
    assert None not in namespaces
    assert namespaces[0] != namespaces[1]


def test_equal_loads_from_other_folders_name_the_same_weights(
    observed: None, tmp_path: Path
) -> None:
    # Machines of a fleet hold their own copies: names and content, not paths.
    primary = ensure_tiny_llama()
    copy = tmp_path / "copy"
    shutil.copytree(primary, copy)
    namespaces = []
    for where, model in (("a", primary), ("b", copy)):
        with weight_reads.forget_start():
            load_with_secondary(model, tower(tmp_path / where, 1.0))
            start = weight_reads.start_weights(str(model))
            namespaces.append(None if start is None else start.identity)
    assert namespaces[0] is not None and namespaces[0] == namespaces[1]


def test_a_read_no_digest_names_makes_the_tiers_private(observed: None) -> None:
    from vllm.model_executor.model_loader import weight_utils

    primary = ensure_tiny_llama()
    streamed = ["s3://bucket/model.safetensors"]
    loaded(lambda: weight_utils.safetensors_weights_iterator(streamed, False), primary)
    config = with_connector(vllm_config(str(primary)), remote_url="redis://h:1")
    assert namespace_of(config, GROUPS, 1) is None
    assert str(tier_fingerprint(config, GROUPS, 8, 1)["weights"]).startswith(
        "unidentified"
    )


def test_a_load_that_read_no_file_is_unproven(observed: None) -> None:
    # Dummy weights, a peer's memory, a loader that opens its files itself.
    loaded(lambda: None, ensure_tiny_llama())
    assert engine_namespace(ensure_tiny_llama()) is None


def test_a_file_changed_since_it_was_loaded_is_not_what_was_loaded(
    observed: None, tmp_path: Path
) -> None:
    secondary = tower(tmp_path / "tower", 1.0)
    load_with_secondary(ensure_tiny_llama(), secondary)
    assert weight_reads.start_weights(str(ensure_tiny_llama())) is not None
    os.utime(secondary / "model.safetensors", ns=(1, 1))
    start = weight_reads.process_start_weights()
    assert start is not None and start.identity is None
    assert "changed since loaded" in start.unproven


class Ranks:
    """An executor of ranks that each report `weights` (`collective_rpc`)."""

    def __init__(self, weights: list[StartWeights | None]) -> None:
        self.vllm_config = with_connector(vllm_config(str(ensure_tiny_llama())))
        self.weights = weights
        self.told: list[StartWeights] = []

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = ()) -> list[Any]:
        if method == "initialize_from_config":  # vLLM's own, to the workers
            return []
        if method is weight_reads.adopt_engine_weights:
            self.told.extend(args)
            return [None for _ in self.weights]
        return list(self.weights)


def initialize(executor: Ranks) -> None:
    from vllm.v1.executor.abstract import Executor

    Executor.initialize_from_config(executor, [])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ranks", "named"),
    [
        ([StartWeights("read:a"), StartWeights("read:a")], True),
        ([StartWeights("read:a"), None], False),
        (
            [StartWeights("read:a"), StartWeights(None, "weights read from s3://b")],
            False,
        ),
    ],
)
def test_the_engine_core_names_the_weights_every_rank_read(
    observed: None,
    ranks: list[StartWeights | None],
    named: bool,
) -> None:
    # The scheduler half is made in the engine core, where no model loaded: it takes
    # what every worker read, and tells each worker the same.
    executor = Ranks(ranks)
    initialize(executor)
    start = weight_reads.start_weights(str(ensure_tiny_llama()))
    assert start is not None and executor.told == [start]
    assert (start.identity is not None) == named
    assert (engine_namespace(ensure_tiny_llama()) is not None) == named


def test_ranks_that_read_other_files_name_an_engine_of_their_own() -> None:
    one = weight_reads.engine_start_weights([StartWeights("read:a")] * 2)
    two = weight_reads.engine_start_weights(
        [StartWeights("read:a"), StartWeights("read:b")]
    )
    assert one.identity == "read:a"
    assert two.identity is not None and two.identity not in ("read:a", "read:b")
