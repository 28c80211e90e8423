"""What a persisted tier's blocks mean, so that a new engine serves only blocks it can
use.

Keys are vLLM's block hashes. They come from the tokens, the extra keys (LoRA,
multimodal inputs, `cache_salt`) and the parent's hash, rooted at `NONE_HASH`. vLLM
derives `NONE_HASH` from a fixed seed for sha256 and sha256_cbor, and from
PYTHONHASHSEED when it is set; for xxhash without PYTHONHASHSEED the seed is random per
process, and such keys would mean nothing after a restart: that combination is refused.
The fingerprint then pins everything else a block's bytes depend on (`kv_identity`, the
same description the shared tier's namespace is made from) and the tier's size. Where
nothing identifies the loaded weights, it holds a value of this start only: the tier
starts empty every time.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from typing import Any

from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.kv_identity import CONFIG_DIGESTS, kv_identity

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


def tier_fingerprint(
    vllm_config: Any,
    groups: Sequence[object],
    num_host_blocks: int,
    blocks_per_host_block: int,
) -> dict[str, Any]:
    """The configuration a tier's index and data files were written for (JSON
    values)."""
    fields = kv_identity(vllm_config, groups, blocks_per_host_block)
    if fields["weights"] is None:
        # Blocks of weights nobody can name again must not outlive this start.
        fields["weights"] = f"unidentified (start {secrets.token_hex(4)})"
    # The tier's files hold each rank's slots as that rank lays them out: pinned to
    # this TP size, though the shared store's values are not.
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    return {**fields, "tensor_parallel_size": tp, "num_host_blocks": num_host_blocks}


def differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The fields two fingerprints disagree on, for a one-line message: the named
    ones first, then vLLM's config digests (which hold the named ones too)."""
    keys = sorted(
        (k for k in set(old) | set(new) if old.get(k) != new.get(k)),
        key=lambda k: (k in CONFIG_DIGESTS, k),
    )
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:4]) + (
        ", ..." if len(keys) > 4 else ""
    )
