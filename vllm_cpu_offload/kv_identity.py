"""What a KV block's bytes depend on besides its tokens: one description, from which the
persistent tier's fingerprint and the shared tier's namespace are both made.

Two engines may exchange a block only when they would have written the same bytes for
it. The model's layers compute K and V from what vLLM's configs hold, so the identity
takes vLLM's own digests of them rather than a list of fields kept here: each config's
`compute_hash`, which vLLM keeps complete for its compilation cache (a field that
changes the forward pass and is left out of it would serve stale compiled graphs):
- the model config: the model's whole Hugging Face config as resolved (rope
  parameters and their dynamic and long-context variants, sliding windows, attention
  sinks, soft-capping, head sizes; `hf_overrides` already applied), `max_model_len`
  (LongRoPE picks its long or short factors by it), dtype, quantization, model
  implementation and every other field vLLM does not rule out of the forward pass;
- the cache config: the KV-cache dtype, the layers it skips, the resolved KV cache
  layout (the byte order inside a block), block size, window settings;
- the attention config: the backend chosen and its numerics settings.
Around them: the weights actually loaded (the files the loader read at start,
`weight_reads`: the target's, its secondary sources' and a draft model's, whose
layers' KV is in the same blocks), the load format, the speculative
method and draft model,
`max_model_len` as the layers were built with it (vLLM builds them before it may shrink
the length to fit memory), the host block size and KV cache groups, each rank's share
(pipeline parallel size, and the tensor-parallel size only where a block's values in
the shared store depend on it: `kv_sharding`), the keys' hash and a digest of its
seed, the vLLM release. A few fields are repeated by name (dtype, rope, KV cache dtype
and layout) so that a tier that starts empty can say why in one line
(`persist.fingerprint.differences`).

vLLM's digests may also hold fields that change no byte (sampling defaults, sleep mode);
engines that differ in them share nothing: the safe way to be wrong.

Where nothing identifies the weights, `weights` is None: the shared tier shares nothing
and the persistent tier restores nothing, and `unshared_notice` says so in one line.
This module imports vLLM on use only (the flags import `persist` before vLLM loads).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

from vllm_cpu_offload.context_parallel import context_parallel_sizes
from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.weights_source import loaded_weights

# vLLM's seed for the cryptographic hashes when PYTHONHASHSEED is not set.
_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def kv_identity(
    vllm_config: Any, groups: Sequence[object], blocks_per_host_block: int
) -> dict[str, Any]:
    """Everything this engine's KV bytes depend on (JSON values); `weights` is None
    where nothing identifies the loaded weights."""
    import vllm

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    load = vllm_config.load_config
    speculative = vllm_config.speculative_config
    # vLLM's digests of what its layers read (see the module docstring).
    digests = {
        name: _config_digest(getattr(vllm_config, name)) for name in CONFIG_DIGESTS
    }
    return {
        "vllm": vllm.__version__.split("+")[0],
        "model": str(model.model),
        "weights": _weights_of(vllm_config) if all(digests.values()) else None,
        "load_format": str(load.load_format),
        # Digests only: a loader's settings may hold credentials.
        "loader_settings": _digest(_jsonable(load.model_loader_extra_config)),
        # How images and other media become placeholder tokens and embeddings: not
        # in vLLM's model config digest, nor in an item's hash where the engine
        # (not the request) sets it.
        "multimodal": _multimodal_settings(model),
        **digests,
        "max_model_len": _built_model_len(model),
        "dtype": str(model.dtype),
        "rope": _rope_of(model),
        "speculative": (
            None
            if speculative is None
            else _jsonable([speculative.method, speculative.model])
        ),
        "kv_cache_dtype": str(cache.cache_dtype),
        "kv_cache_layout": _layout_of(cache),
        "block_size": int(cache.block_size),
        "blocks_per_host_block": blocks_per_host_block,
        "kv_cache_groups": [repr(g) for g in groups],
        # Values per KV head, or replicated KV (MLA), are the same at any TP size:
        # engines of every size share them (kv_shards.py).
        "tensor_parallel_size": (
            "any"
            if kv_sharding(vllm_config) != RANKS
            else int(parallel.tensor_parallel_size)
        ),
        "pipeline_parallel_size": int(parallel.pipeline_parallel_size),
        "context_parallel_sizes": list(context_parallel_sizes(vllm_config)),
        "hash_algo": str(cache.prefix_caching_hash_algo),
        "hash_seed": _seed_digest(),
    }


# The configs whose vLLM digest is part of the identity (`kv_identity`).
CONFIG_DIGESTS = ("model_config", "cache_config", "attention_config")


def _weights_of(vllm_config: Any) -> str | list[str] | None:
    """The target's weights and, with a draft model (a draft model's, an EAGLE head's,
    MTP's layers, whose KV the blocks hold too), the drafter's; None where either is
    unproven (`weights_source`). The operator's `weights_id` names them all."""
    named = operator_weights_name(vllm_config)
    if named is not None:
        return "named:" + named
    load = vllm_config.load_config
    target = loaded_weights(vllm_config.model_config, load).identity
    draft = getattr(vllm_config.speculative_config, "draft_model_config", None)
    if draft is None or target is None:
        return target
    drafter = loaded_weights(draft, load).identity
    return None if drafter is None else [target, drafter]


def operator_weights_name(vllm_config: Any) -> str | None:
    """The operator's name for the weights (`weights_id`), or None."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    named = extra.get("weights_id")
    return str(named) if named else None


def _multimodal_settings(model: Any) -> str | None:
    mm = getattr(model, "multimodal_config", None)
    if mm is None:
        return None
    return _digest(
        _jsonable(
            {
                "mm_processor_kwargs": getattr(mm, "mm_processor_kwargs", None),
                "media_io_kwargs": getattr(mm, "media_io_kwargs", None),
            }
        )
    )


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _config_digest(config: Any) -> str | None:
    """The digest vLLM makes of `config`; None where it cannot make one (a remote-code
    Hugging Face config holding objects it cannot normalise): then nothing identifies
    the engine, as for weights nothing names."""
    try:
        return str(config.compute_hash())
    except (TypeError, ValueError):
        return None


# How a block's KV is spread over the tensor-parallel ranks (`kv_sharding`).
REPLICATED = "replicated"
HEADS = "heads"
RANKS = "ranks"


def kv_is_replicated(vllm_config: Any) -> bool:
    """Whether every tensor-parallel rank caches the same KV bytes: MLA's latent KV,
    made by replicated projections (`kv_shards.py`)."""
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def host_region_per_stage(vllm_config: Any, swap_space_path: str | None) -> bool:
    """Whether the tensor-parallel ranks of a pipeline stage map one host region
    (worker/shared_region.py) instead of a copy each: replicated KV on more than one
    rank, without a persistent tier (which keeps a file per rank)."""
    return (
        kv_sharding(vllm_config) == REPLICATED
        and int(vllm_config.parallel_config.tensor_parallel_size) > 1
        and swap_space_path is None
    )


def kv_sharding(vllm_config: Any) -> str:
    """How a block's KV is spread over the tensor-parallel ranks:
    - `REPLICATED`: every rank holds it whole (MLA);
    - `HEADS`: each rank holds a contiguous range of the KV heads (or, past one rank
      per head, one head several ranks hold alike), as vLLM's attention shards them at
      every TP size, so a head's bytes do not depend on the TP size;
    - `RANKS`: neither (context parallelism also splits the tokens), or the user
      chose values per rank (`remote_values`): a rank's bytes mean something only to
      a rank of the same TP size."""
    if max(context_parallel_sizes(vllm_config)) > 1:
        # Each rank holds its own tokens of a block: no rank's bytes are another's,
        # replicated (MLA) or not.
        return RANKS
    if kv_is_replicated(vllm_config):
        return REPLICATED
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    if extra.get("remote_values") == "per_rank":
        return RANKS
    heads = total_kv_heads(vllm_config)
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if heads < 1 or (heads % tp and tp % heads):
        return RANKS
    return HEADS


def total_kv_heads(vllm_config: Any) -> int:
    """The model's KV heads over all ranks; 0 where the config does not say."""
    count = getattr(vllm_config.model_config, "get_total_num_kv_heads", None)
    try:
        return int(count()) if count is not None else 0
    except (AttributeError, TypeError, ValueError):
        return 0


def unshared_notice(vllm_config: Any, *, persisted: bool, shared: bool) -> str | None:
    """The start-up line for an engine whose weights the tier cannot prove, or which
    the operator named, where a tier would otherwise share or restore blocks; None
    where there is nothing to say."""
    if not (persisted or shared):
        return None
    named = operator_weights_name(vllm_config)
    if named is not None:
        return (
            f"CPU offload: the weights are named {named!r} by weights_id: engines that "
            "give this name share and restore each other's KV as if their weights "
            "were proven equal"
        )
    load = vllm_config.load_config
    models = [vllm_config.model_config]
    draft = getattr(vllm_config.speculative_config, "draft_model_config", None)
    if draft is not None:
        models.append(draft)
    unproven = [w for m in models if (w := loaded_weights(m, load)).identity is None]
    if not unproven:
        return None
    effects = []
    if shared:
        effects.append("the shared tier is off")
    if persisted:
        effects.append("the persistent tier starts empty at every start")
    first = unproven[0]
    return (
        f"CPU offload: nothing proves what {first.unproven} are, so "
        f"{' and '.join(effects)}; {first.fix}, or name the weights with "
        "kv_connector_extra_config's weights_id if you know them equal on every "
        "engine that uses the name"
    )


def _built_model_len(model: Any) -> Any:
    # With `--max-model-len -1` vLLM builds the layers at the model's whole length and
    # then shrinks `max_model_len` to what fits in memory: the layers saw the former
    # (a function of the Hugging Face config, in `model_config`), not the latter.
    if getattr(model, "original_max_model_len", None) == -1:
        return "auto"
    return int(model.max_model_len)


def _rope_of(model: Any) -> Any:
    # Transformers 5 and vLLM fold rope_scaling and rope_theta into rope_parameters;
    # a config that predates it keeps them apart.
    text = model.hf_text_config
    params = getattr(text, "rope_parameters", None)
    if params is None:
        params = {
            "rope_scaling": getattr(text, "rope_scaling", None),
            "rope_theta": getattr(text, "rope_theta", None),
        }
    return _jsonable(params)


def _layout_of(cache: Any) -> str | None:
    # Resolved by the engine core before either half of the connector is made; the
    # variable is what resolution will honour where a test builds a config by hand.
    layout = cache.kv_cache_layout or os.getenv("VLLM_KV_CACHE_LAYOUT")
    return None if layout is None else str(layout)


def _seed_digest() -> str:
    # The seed itself stays out of files and keys: only whether two engines share it.
    seed = os.getenv("PYTHONHASHSEED", _DEFAULT_NONE_HASH_SEED)
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    """A JSON value that is the same in every process for equal configs (no object
    addresses: the scheduler and the workers must derive the same namespace)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=str)}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if callable(value):
        # A callable hf_overrides: named, since what it changes cannot be read off.
        module = getattr(value, "__module__", "")
        return f"{module}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    text = str(value)
    return type(value).__qualname__ if " at 0x" in text else text


# vLLM's non-cryptographic prefix-caching hashes: a random per-process NONE_HASH seed
# unless PYTHONHASHSEED is set.
_PER_PROCESS_SEEDED = ("xxhash", "xxhash_cbor")


def check_stable_block_hashes(hash_algo: str, flag: str) -> None:
    """Refuses a prefix-caching hash whose keys change from one process to the next
    (`flag` needs them stable)."""
    if hash_algo in _PER_PROCESS_SEEDED and os.getenv("PYTHONHASHSEED") is None:
        raise OffloadConfigError(
            f"{flag} needs block hashes that are the same in every process, "
            f"but --prefix-caching-hash-algo {hash_algo} seeds them at random per "
            "process; use sha256 or sha256_cbor, or set PYTHONHASHSEED"
        )
