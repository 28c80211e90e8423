"""Where an engine's weights come from, and whether the tier can prove what they are.

The identity is made of the files the loader opened at start (`weight_reads`: every
weight file vLLM's weight iterators were given while a model loaded, `--model`'s and
every secondary source's, digested). That names the weights only where a loader reads
its weights through those iterators: every loader of vLLM 0.32 and 0.33 is sorted
here, and a source the tier cannot prove gets no identity (the shared tier shares
nothing and the file tier restores nothing: `kv_identity`), with the reason for the
start-up line.

- auto, hf, safetensors, pt, npcache, fastsafetensors, instanttensor, mistral,
  runai_streamer, runai_streamer_sharded (a GGUF file and bitsandbytes checkpoints
  load through these): the files the iterators read, named by their digests; a file
  that is not local (an object store, a stream) makes the weights unproven;
- sharded_state: named the same way (it opens local shards itself,
  sharded_state_loader.py:260, so such a load reads nothing observed: unproven);
- tensorizer: the file at `model_loader_extra_config.tensorizer_uri`, named by its
  digest where it is a local file, unproven otherwise;
- dummy (random values), ipc_cache (another process's memory), modelexpress (a peer),
  and any loader a plugin registers: unproven.

Halves built by hand in a process where no model loaded and no engine core said what
was read (tests, the simulation) are named by the files at `--model` instead
(`weights_identity`). `--revision` and `--code-revision` are part of vLLM's model
config digest. The operator may name weights the tier cannot prove (`weights_id`),
and then the name is the identity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_cpu_offload.weight_reads import start_weights
from vllm_cpu_offload.weights_identity import (
    checkpoint_digest,
    unreadable_file,
    weights_identity,
)

# Loaders that read the checkpoint at --model.
CHECKPOINT_LOADERS = frozenset(
    {
        "auto",
        "hf",
        "safetensors",
        "pt",
        "npcache",
        "fastsafetensors",
        "instanttensor",
        "mistral",
    }
)
# Loaders that read the checkpoint at --model where it is a local path.
LOCAL_ONLY_LOADERS = frozenset(
    {"sharded_state", "runai_streamer", "runai_streamer_sharded"}
)
# The start-up line's fix where the loader's reads prove nothing.
_UNPROVEN_FIX = "serve local checkpoint files"
TENSORIZER = "tensorizer"


@dataclass(frozen=True)
class LoadedWeights:
    """What names the weights an engine loaded (None: nothing the tier can prove),
    and, where nothing does, why and how an operator names them."""

    identity: str | None
    unproven: str = ""  # what was loaded, for the start-up line
    fix: str = ""


def loaded_weights(model_config: Any, load_config: Any) -> LoadedWeights:
    """The identity of the weights `model_config` loaded with `load_config`."""
    fmt = str(load_config.load_format).lower()
    source = str(model_config.model_weights or model_config.model)
    if fmt == TENSORIZER:
        return _tensorizer(load_config.model_loader_extra_config)
    if fmt not in CHECKPOINT_LOADERS | LOCAL_ONLY_LOADERS:
        return LoadedWeights(
            None,
            f"the weights --load-format {fmt} loads",
            "load a checkpoint at --model",
        )
    observed = start_weights(str(model_config.model))
    if observed is not None:
        if observed.identity is None:
            return LoadedWeights(None, f"the {observed.unproven}", _UNPROVEN_FIX)
        return LoadedWeights(observed.identity)
    return _predicted(model_config, load_config, fmt, source)


def _predicted(
    model_config: Any, load_config: Any, fmt: str, source: str
) -> LoadedWeights:
    """The identity of the files at `--model`, where no load was observed."""
    local = Path(source).exists()
    if fmt in LOCAL_ONLY_LOADERS and not local:
        return LoadedWeights(
            None, f"the weights {fmt} streams from {source}", "serve a local copy"
        )
    if model_config.model_weights and not local:
        return LoadedWeights(
            None,
            f"the weights streamed from {model_config.model_weights}",
            "serve a local copy",
        )
    if not local and _uses_modelscope():
        return LoadedWeights(
            None,
            f"the weights of {source} from ModelScope",
            "serve a local directory",
        )
    identity = weights_identity(model_config, load_config.download_dir)
    if identity is not None:
        return LoadedWeights(identity)
    unreadable = unreadable_file(model_config)
    if unreadable is not None:
        return LoadedWeights(
            None,
            f"the weights of {source} ({unreadable} cannot be read)",
            "make it readable to the user running vLLM",
        )
    return LoadedWeights(
        None,
        f"the weights of {source} (a hub model with no snapshot in the Hugging "
        "Face cache and no --revision that is a commit)",
        "pin --revision to a commit or serve a local directory",
    )


def _tensorizer(extra: Any) -> LoadedWeights:
    uri = (
        extra.get("tensorizer_uri")
        if isinstance(extra, dict)
        else getattr(extra, "tensorizer_uri", None)
    )
    local = Path(os.path.expanduser(str(uri))) if uri else None
    if local is not None and local.is_file():
        try:
            return LoadedWeights("tensorizer:" + checkpoint_digest(local))
        except OSError as e:
            return LoadedWeights(
                None,
                f"the weights deserialized from {uri} ({e.strerror or e})",
                "make it readable to the user running vLLM",
            )
    return LoadedWeights(
        None,
        f"the weights deserialized from {uri or 'a tensorizer URI'}",
        "serve a local tensorizer file",
    )


def _uses_modelscope() -> bool:
    return os.getenv("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true")
