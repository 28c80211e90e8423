"""The weight files vLLM's loader opened at start, observed where it opens them: the
weights identity is made of these, not of a list of places weights usually live.

The seam: every loader of vLLM 0.32 that reads checkpoint files hands them to one of
the weight iterators of `model_executor/model_loader/weight_utils.py`
(`safetensors_weights_iterator` :1079, `multi_thread_safetensors_weights_iterator`
:1216, `runai_safetensors_weights_iterator` :1246, `fastsafetensors_weights_iterator`
:1283, `instanttensor_weights_iterator` :1352, `pt_weights_iterator` :1426,
`multi_thread_pt_weights_iterator` :1445, `np_cache_weights_iterator` :846), each
taking the files as `hf_weights_files`; `DefaultModelLoader._get_weights_iterator`
(default_loader.py:265) calls them for `--model` and for every `secondary_weights`
source a model names (default_loader.py:382: Ultravox's `text_model_id` and
`audio_model_id`, KimiAudio's subfolder). Every function of that module with such a
parameter is wrapped (found by its signature, not by a list), here and where a loader
module imported it by name, so each file an iterator is given is recorded, with its
stat, while a model loads: the window is the loader's `load_model`, reached through
`get_model_loader` (model_loader/__init__.py:123), which every load at start goes
through (`get_model`, :131, the target's and a drafter's).

What the records prove (`start_reads`):
- a regular local file: its name, size and content SHA-256 (`file_digest.py`), taken
  when the tier asks; a file whose stat changed since it was read is not what was
  loaded;
- anything else an iterator was given (an object store URI, a stream): nothing, and
  the weights are unproven;
- a load that gave no iterator any file (dummy weights, a peer's memory, a loader that
  opens its files itself): nothing.
Unproven weights get no identity, so the shared tier shares nothing and the file tier
restores nothing (`kv_identity`).

Process layout: the weights load in the workers; the scheduler half lives in the engine
core, a process of its own where the workers are (multiprocess executor). The engine
core asks every worker for its start's identity before any half is built
(`Executor.initialize_from_config`, v1/executor/abstract.py:135, called by
`EngineCore._initialize_kv_caches`, v1/engine/core.py:377, before the scheduler is
made at :174 and before each worker builds its half, v1/worker/gpu_worker.py:874),
and tells every worker the engine's: the digest of every rank's. Both halves then
name the weights alike; a rank that cannot say makes the engine unproven.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import os
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_cpu_offload.file_digest import file_digests

_WEIGHT_UTILS = "vllm.model_executor.model_loader.weight_utils"
_LOADERS = "vllm.model_executor.model_loader"
_FILES_PARAMETER = "hf_weights_files"


@dataclass(frozen=True)
class StartWeights:
    """What names the weights this engine (or this process) loaded at start: an
    identity, or None and why not."""

    identity: str | None
    unproven: str = ""
    # The models (`--model`, a drafter's) whose loads these are.
    models: frozenset[str] = frozenset()


@dataclass
class _Reads:
    """What the loads of this process gave the weight iterators."""

    files: dict[str, os.stat_result] = field(default_factory=dict)
    unproven: str = ""
    models: set[str] = field(default_factory=set)
    # Which iterator call (1, 2, ...) first gave each file: the identity orders the
    # files by source and content, never by where a machine keeps them.
    source_of: dict[str, int] = field(default_factory=dict)
    calls: int = 0


# Open while a model loads in this process (`_observed_load`).
_window: _Reads | None = None
# Every start load of this process; None until one ran.
_start: _Reads | None = None
# The engine's, told by the engine core (`adopt_engine_weights`).
_engine: StartWeights | None = None
# Called with each model a loader made (`runtime_weights.watch_model`).
on_model_loaded: list[Callable[[Any], None]] = []


def install_read_observer() -> None:
    """Observes the loader's reads and the engine core's start; a second call changes
    nothing."""
    import vllm.model_executor.model_loader as loaders
    from vllm.model_executor.model_loader import weight_utils
    from vllm.v1.executor.abstract import Executor

    if hasattr(loaders.get_model_loader, "_cpu_offload_original"):
        return
    wrapped = {}
    for fn in vars(weight_utils).values():
        if inspect.isfunction(fn) and _takes_weight_files(fn):
            wrapped[fn] = _recording(fn)
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(_LOADERS):
            continue
        for name, value in list(vars(module).items()):
            if inspect.isfunction(value) and value in wrapped:
                setattr(module, name, wrapped[value])
    loaders.get_model_loader = _observing(loaders.get_model_loader)
    Executor.initialize_from_config = _naming_the_weights(
        Executor.initialize_from_config
    )


def _takes_weight_files(fn: Callable[..., Any]) -> bool:
    try:
        return _FILES_PARAMETER in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _recording(iterator: Callable[..., Any]) -> Callable[..., Any]:
    files_at = list(inspect.signature(iterator).parameters).index(_FILES_PARAMETER)

    @functools.wraps(iterator)
    def reading(*args: Any, **kwargs: Any) -> Any:
        files = args[files_at] if len(args) > files_at else kwargs[_FILES_PARAMETER]
        record_reads(files)
        return iterator(*args, **kwargs)

    reading._cpu_offload_original = iterator  # type: ignore[attr-defined]
    return reading


def record_reads(files: Iterable[object]) -> None:
    """Records that the loader reads `files` (while a model loads in this process)."""
    reads = _window
    if reads is None:
        return  # a reload at run time: `runtime_weights` hears of it
    reads.calls += 1
    for f in files:
        path = os.path.abspath(os.fspath(str(f)))
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            reads.unproven = reads.unproven or f"{f} (not a local file)"
        else:
            reads.files[path] = st
            reads.source_of.setdefault(path, reads.calls)


def _observing(get_model_loader: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(get_model_loader)
    def observed_loader(*args: Any, **kwargs: Any) -> Any:
        loader = get_model_loader(*args, **kwargs)
        load_model = loader.load_model
        # On the instance: loaders that override `load_model` are observed too.
        loader.load_model = functools.partial(_observed_load, load_model)
        return loader

    observed_loader._cpu_offload_original = get_model_loader  # type: ignore[attr-defined]
    return observed_loader


def _observed_load(load_model: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    global _window, _start
    outer = _window
    reads = outer if outer is not None else _Reads()
    _window = reads
    model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
    reads.models.add(str(getattr(model_config, "model", "")))
    try:
        model = load_model(*args, **kwargs)
    finally:
        _window = outer
    if outer is None:
        _start = reads if _start is None else _merged(_start, reads)
    for told in on_model_loaded:
        told(model)
    return model


def _merged(a: _Reads, b: _Reads) -> _Reads:
    later = {p: a.calls + n for p, n in b.source_of.items()}
    return _Reads(
        {**a.files, **b.files},
        a.unproven or b.unproven,
        a.models | b.models,
        {**later, **a.source_of},
        a.calls + b.calls,
    )


def process_start_weights() -> StartWeights | None:
    """What the loads of this process read, as an identity; None where no model
    loaded in this process."""
    reads = _start
    if reads is None:
        return None
    models = frozenset(reads.models)
    if reads.unproven:
        return StartWeights(None, f"weights read from {reads.unproven}", models)
    if not reads.files:
        return StartWeights(None, "weights read from no checkpoint file", models)
    paths = list(reads.files)
    try:
        digests = file_digests([Path(p) for p in paths])
        now = [os.stat(p) for p in paths]
    except OSError as err:
        why = f"weights in {err.filename} ({err.strerror or err})"
        return StartWeights(None, why, models)
    entries = []
    for path, digest, st in zip(paths, digests, now, strict=True):
        if _version(st) != _version(reads.files[path]):
            why = f"weights in {path} (changed since loaded)"
            return StartWeights(None, why, models)
        source = reads.source_of.get(path, 0)
        entries.append(f"{source}\0{Path(path).name}\0{st.st_size}\0{digest}\n")
    # Sorted: a folder lists its files in an order of its own (ext4 hashes names).
    h = hashlib.sha256("".join(sorted(entries)).encode())
    return StartWeights("read:" + h.hexdigest()[:32], models=models)


def _version(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def start_weights(model: str) -> StartWeights | None:
    """The start weights of the engine that loaded `model`: as the engine core said
    them, else as this process's own loads read them; None where this process
    neither loaded `model` nor was told of an engine that did (halves built by
    hand)."""
    if _engine is not None and model in _engine.models:
        return _engine
    if _start is not None and model in _start.models:
        return process_start_weights()
    return None


def engine_start_weights(each_rank: list[StartWeights | None]) -> StartWeights:
    """One engine's weights from every rank's: proven only where every rank's are."""
    for rank, weights in enumerate(each_rank):
        if weights is None:
            return StartWeights(None, f"weights rank {rank} loaded unobserved")
        if weights.identity is None:
            return weights
    identities = sorted(
        {w.identity for w in each_rank if w is not None and w.identity is not None}
    )
    if len(identities) == 1:
        return StartWeights(identities[0])
    joined = "\n".join(str(i) for i in identities).encode()
    return StartWeights("ranks:" + hashlib.sha256(joined).hexdigest()[:32])


def adopt_engine_weights(_worker: object, weights: StartWeights) -> None:
    """Run on each worker (`collective_rpc`): the engine's start weights."""
    global _engine
    _engine = weights


def _rank_start_weights(_worker: object) -> StartWeights | None:
    global _start
    weights = process_start_weights()
    # Said once: an engine built next in this process starts a record of its own.
    _start = None
    return weights


def _naming_the_weights(initialize: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(initialize)
    def initialize_from_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _engine
        # Once per engine: a later call (elastic scaling) keeps the start's name.
        named = getattr(self, "_cpu_offload_weights_named", False)
        if _uses_this_connector(self.vllm_config) and not named:
            self._cpu_offload_weights_named = True
            try:
                ranks = self.collective_rpc(_rank_start_weights)
                weights = engine_start_weights(list(ranks))
            except Exception as err:  # noqa: BLE001 - unproven, never a failed start
                weights = StartWeights(
                    None, f"weights the workers did not name ({err})"
                )
            weights = dataclasses.replace(weights, models=_models_of(self.vllm_config))
            _engine = weights
            self.collective_rpc(adopt_engine_weights, args=(weights,))
        return initialize(self, *args, **kwargs)

    initialize_from_config._cpu_offload_original = initialize  # type: ignore[attr-defined]
    return initialize_from_config


def _models_of(vllm_config: Any) -> frozenset[str]:
    draft = getattr(vllm_config.speculative_config, "draft_model_config", None)
    models = [vllm_config.model_config, draft]
    return frozenset(str(m.model) for m in models if m is not None)


def _uses_this_connector(vllm_config: Any) -> bool:
    # Any connector: this one may sit inside another (vLLM's MultiConnector).
    return getattr(vllm_config, "kv_transfer_config", None) is not None


@contextlib.contextmanager
def forget_start() -> Iterator[None]:
    """For tests: this process as if nothing had loaded yet."""
    global _window, _start, _engine
    saved = (_window, _start, _engine)
    _window = _start = _engine = None
    try:
        yield
    finally:
        _window, _start, _engine = saved
