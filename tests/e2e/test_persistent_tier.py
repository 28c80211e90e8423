"""`--swap-space-path`: the host tier outlives the server, through SIGTERM and SIGKILL.

Real `vllm serve` processes (the API server module) on loopback, one after another on
one tier directory, fp32 (the tier keeps bytes whatever their dtype; bf16's exactness is
test_bf16_exact's), one request at a time. The first server reads documents; after
a SIGTERM (with a grace period, so the tier is closed in order), a second server's first
reads of them are host hits with the same answers, and `cache_salt` still keeps tenants
apart. It is killed (SIGKILL) while it stores new documents; a third server starts,
answers the documents exactly from the host tier and counts no failed transfer. An
engine of another configuration then starts empty.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import BLOCK_SIZE
from tests.e2e.conftest import long_documents
from tests.e2e.servers import RunningServer, metrics, running_server
from tests.e2e.test_serving_load import OFFLOAD, complete, idle, settled_metrics
from vllm_cpu_offload.errors import OffloadConfigError
from vllm_cpu_offload.persist.directory import check_tier_directory
from vllm_cpu_offload.testing.tiny_model import random_words

pytestmark = pytest.mark.e2e

DOCS, BLOCKS = 4, 6
# At least this much of each re-read comes from the tier.
HITS = (BLOCKS - 1) * BLOCK_SIZE


def server_flags(tier: Path) -> list[str]:
    return [
        "--dtype", "float32",
        "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", "24",
        "--max-model-len", "640",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--enable-cpu-offload", "--swap-space", "0.05", "--swap-space-path", str(tier),
    ]  # fmt: skip


def cached_tokens(reply: dict) -> int:
    return int(
        (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    )


def text(reply: dict) -> str:
    return str(reply["choices"][0]["text"])


def kill_while_storing(server: RunningServer, prompts: list[str]) -> None:
    """Sends `prompts` one after another and SIGKILLs the server's processes once the
    tier has stored some of them, in the middle of the stream."""
    start = metrics(server.url)[OFFLOAD + "stored_blocks_total"]
    sender = threading.Thread(
        target=lambda: [_ignore_errors(complete, server, p, 64) for p in prompts],
        daemon=True,
    )
    sender.start()
    deadline = time.monotonic() + 120
    while metrics(server.url)[OFFLOAD + "stored_blocks_total"] <= start:
        assert time.monotonic() < deadline, "the server stored nothing"
        time.sleep(0.05)
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    sender.join(timeout=150)


def _ignore_errors(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return fn(*args)
    except Exception:  # the server dies under it on purpose
        return None


def test_the_tier_survives_restarts_and_a_kill_with_exact_answers(
    tiny_model: str, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    flags = server_flags(tier)
    rng = random.Random(23)
    docs = [random_words(rng, BLOCKS * BLOCK_SIZE + 3) for _ in range(DOCS)]
    salted = random_words(rng, BLOCKS * BLOCK_SIZE + 3)

    # vLLM's default --shutdown-timeout 0 kills the engine at once on SIGTERM (the tier
    # then stays valid in this boot); with a grace period it shuts down in order.
    with running_server(
        tiny_model, [*flags, "--shutdown-timeout", "30"]
    ) as first_server:
        for d in docs:
            complete(first_server, d)
        cold_salted = complete(first_server, salted, cache_salt="tenant-a")
        # The references for the reads from the tier: the same reads from this
        # engine's cache. A cold answer is not one: on some CPUs (AMX) vLLM's prefill
        # of a prompt whose prefix is cached differs in the last bits from a whole
        # prefill, and greedy tokens of a random model can flip, with or without this
        # plugin.
        first = [complete(first_server, d) for d in docs]
        first_salted = complete(first_server, salted, cache_salt="tenant-a")
        settled_metrics(first_server.url, until=idle)
    # The engine core and the worker flushed and closed their files: a disk-backed tier
    # is now safe across a reboot too.
    for meta in ("tier.json", "kv-tp0-pp0.json"):
        assert json.loads((tier / meta).read_text())["state"] == "closed", meta

    with running_server(tiny_model, flags) as second:
        before = settled_metrics(second.url, until=idle)
        again = [complete(second, d) for d in docs]
        assert [cached_tokens(r) for r in again] == [cached_tokens(r) for r in first]
        assert [text(r) for r in again] == [text(r) for r in first]
        assert all(cached_tokens(r) >= HITS for r in again), [r["usage"] for r in again]
        # Another tenant's salt reaches none of tenant A's blocks, restart or not.
        as_b = complete(second, salted, cache_salt="tenant-b")
        assert cached_tokens(as_b) < BLOCK_SIZE and text(as_b) == text(cold_salted)
        as_a = complete(second, salted, cache_salt="tenant-a")
        assert cached_tokens(as_a) == cached_tokens(first_salted) >= HITS
        assert text(as_a) == text(first_salted)
        after = settled_metrics(second.url, until=idle)
        hit = after[OFFLOAD + "hit_tokens_total"] - before[OFFLOAD + "hit_tokens_total"]
        assert hit >= (DOCS + 1) * HITS
        assert after[OFFLOAD + "failed_transfers_total"] == 0
        with pytest.raises(
            OffloadConfigError, match="in use by another running engine"
        ):
            check_tier_directory(str(tier))
        new_docs = [random_words(rng, BLOCKS * BLOCK_SIZE + 3) for _ in range(8)]
        kill_while_storing(second, new_docs)

    with running_server(tiny_model, flags) as third:
        after_kill = [complete(third, d) for d in docs]
        assert [cached_tokens(r) for r in after_kill] == [
            cached_tokens(r) for r in first
        ]
        assert [text(r) for r in after_kill] == [text(r) for r in first]
        assert all(cached_tokens(r) >= HITS for r in after_kill)
        assert (
            settled_metrics(third.url, until=idle)[OFFLOAD + "failed_transfers_total"]
            == 0
        )

    # Another dtype is another configuration: the engine starts with an empty tier
    # (bf16 here: two short documents, seconds even where bf16 is slow).
    other = long_documents(
        tiny_model, "--offload", "--swap-space-path", str(tier), "--dtype", "bfloat16",
        "--docs", "2", "--doc-tokens", str(2 * BLOCK_SIZE + 3), "--reads", "1",
    )  # fmt: skip
    assert all(r["cached"] == 0 for r in other["requests"])
    fingerprint = json.loads((tier / "tier.json").read_text())["fingerprint"]
    assert fingerprint["dtype"] == "torch.bfloat16"
