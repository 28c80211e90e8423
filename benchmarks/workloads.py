"""Workloads for the host tier's hit-rate table, generated with fixed seeds.

A workload is a stream of requests, each the keys of its full blocks in chain order, and
the device cache size that goes in front of the host tier for it. A key stands for its
whole prefix, as vLLM's block hashes do: two requests share a block only when they
share everything before it. Keys of the synthetic workloads are random 61-bit ints from
the workload's own seeded generator (an int's hash is itself, so every run and every
policy's hash sampling sees the same keys).

The synthetic workloads are sized so that the swept host capacities (1,000 to 32,000
blocks) run from a tier that thrashes to one that holds the whole working set, with
about 60,000 to 350,000 block uses each:

- `longdoc-N` (N = 16, 32, 64): PR 11532's long-document loop. N documents of 256
  blocks, each read once in order (warm-up), then re-read in `rounds` (3) passes, each
  in a fresh random order. Device cache: 8 documents (2,048 blocks); at 8,000 host
  blocks the host holds about 30 documents, the PR's shape (1,000-token documents,
  device for 8, host for 30) scaled up 8x in blocks.
- `zipf-qa`: document QA. 4,000 documents of 16-96 blocks (224k blocks); a request
  reads one, Zipf-popular (s = 1.0), and adds 1-4 blocks of question. 15% of requests
  are one-off scans instead: a new document of 64-512 blocks, never read again.
  3,200 requests; device 1,000 blocks.
- `agent`: agent loops. 128 sessions run at once, a random one takes each step. A
  session starts from one of 4 shared tool prompts (16-40 blocks) and a task (2-8
  blocks), and each turn re-reads its whole history and adds 2-12 blocks (tool output
  and reply); after 4-24 turns it ends and a new one starts. 4,000 requests; device
  1,000 blocks.
- `tenants`: four tenants, each with its own 8-block system prompt, with different
  working sets, mixed request by request: a hot tenant (50 documents of 40 blocks,
  Zipf 0.6, 35% of requests), a warm one (400 documents of 40 blocks, uniform, 25%), a
  looping one (120 documents of 200 blocks read in a cycle, 25%: larger than most
  tiers), and one with no reuse (unique prompts of 32-256 blocks, 15%). Halfway
  through, the hot and warm tenants swap rates. Every request adds 1-2 unique blocks.
  3,000 requests; device 1,000 blocks.
- `conversation`: the Mooncake conversation trace (benchmarks/trace_replay.py), device
  1,000 blocks.

Usage: python benchmarks/workloads.py    # prints each workload's shape
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

Request = list[int]


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[Request]
    device_blocks: int


class _Keys:
    """Fresh random block keys from a seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def new(self, count: int) -> list[int]:
        bits = self._rng.getrandbits
        return [bits(61) for _ in range(count)]


def _zipf_sampler(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    """Draws ranks 0..n-1 with P(k) proportional to 1 / (k + 1)^s."""
    cumulative = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))
    total = cumulative[-1]
    return lambda: min(n - 1, bisect.bisect_left(cumulative, rng.random() * total))


def long_document(num_docs: int, doc_blocks: int = 256, rounds: int = 3) -> Workload:
    rng = random.Random(11532 + num_docs)
    keys = _Keys(rng)
    docs = [keys.new(doc_blocks) for _ in range(num_docs)]
    requests = list(docs)
    for _ in range(rounds):
        order = list(range(num_docs))
        rng.shuffle(order)
        requests += [docs[i] for i in order]
    return Workload(f"longdoc-{num_docs}", requests, device_blocks=8 * doc_blocks)


def zipf_qa(num_requests: int = 3200, scan_share: float = 0.15) -> Workload:
    rng = random.Random(2201)
    keys = _Keys(rng)
    docs = [keys.new(rng.randint(16, 96)) for _ in range(4000)]
    popular = _zipf_sampler(rng, len(docs), 1.0)
    requests = []
    for _ in range(num_requests):
        if rng.random() < scan_share:
            requests.append(keys.new(rng.randint(64, 512)))
        else:
            requests.append(docs[popular()] + keys.new(rng.randint(1, 4)))
    return Workload("zipf-qa", requests, device_blocks=1000)


def agent_loops(num_requests: int = 6000, concurrency: int = 256) -> Workload:
    rng = random.Random(2202)
    keys = _Keys(rng)
    tool_prompts = [keys.new(rng.randint(16, 40)) for _ in range(4)]

    def new_session() -> tuple[list[int], int]:
        history = rng.choice(tool_prompts) + keys.new(rng.randint(2, 8))
        return history, rng.randint(4, 24)

    sessions = [new_session() for _ in range(concurrency)]
    requests = []
    for _ in range(num_requests):
        i = rng.randrange(concurrency)
        history, turns_left = sessions[i]
        requests.append(list(history))
        history = history + keys.new(rng.randint(2, 12))
        sessions[i] = (history, turns_left - 1) if turns_left > 1 else new_session()
    return Workload("agent", requests, device_blocks=1000)


def tenants(num_requests: int = 3000) -> Workload:
    rng = random.Random(2203)
    keys = _Keys(rng)
    system = [keys.new(8) for _ in range(4)]
    hot = [system[0] + keys.new(40) for _ in range(50)]
    warm = [system[1] + keys.new(40) for _ in range(400)]
    loop = [system[2] + keys.new(200) for _ in range(120)]
    hot_rank = _zipf_sampler(rng, len(hot), 0.6)
    loop_next = 0
    requests = []
    for i in range(num_requests):
        hot_share, warm_share = (0.35, 0.25) if i < num_requests // 2 else (0.25, 0.35)
        u = rng.random()
        if u < hot_share:
            prefix = hot[hot_rank()]
        elif u < hot_share + warm_share:
            prefix = rng.choice(warm)
        elif u < hot_share + warm_share + 0.25:
            prefix = loop[loop_next]
            loop_next = (loop_next + 1) % len(loop)
        else:
            prefix = system[3] + keys.new(rng.randint(32, 256))
        requests.append(prefix + keys.new(rng.randint(1, 2)))
    return Workload("tenants", requests, device_blocks=1000)


def conversation() -> Workload:
    from trace_replay import load_trace

    return Workload("conversation", load_trace(None), device_blocks=1000)


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "longdoc-16": lambda: long_document(16),
    "longdoc-32": lambda: long_document(32),
    "longdoc-64": lambda: long_document(64),
    "zipf-qa": zipf_qa,
    "agent": agent_loops,
    "tenants": tenants,
    "conversation": conversation,
}


def describe(workload: Workload) -> str:
    uses = sum(map(len, workload.requests))
    distinct = len({key for request in workload.requests for key in request})
    return (
        f"{workload.name:<13} {len(workload.requests):>6} requests {uses:>8} block "
        f"uses {distinct:>7} distinct blocks, device {workload.device_blocks}"
    )


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    for make in WORKLOADS.values():
        print(describe(make()))
