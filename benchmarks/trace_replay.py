"""Replays the Mooncake conversation trace through a GPU prefix cache and a host tier.

Model: a GPU tier of G blocks with vLLM-like LRU prefix caching in front of a host tier
of C blocks. Per request, in timestamp order:
  1. GPU hit: the longest prefix of the request's blocks cached on the GPU (g blocks).
  2. Host hit: the longest run of READY host blocks right after it (h blocks); they are
     loaded (pinned, then unpinned), so they become GPU-cached too.
  3. The GPU-hit blocks are touched on the host tier (its copies were just used).
  4. Every block of the request the host does not hold is stored there (write-through);
     held blocks are skipped. Then all the request's blocks become the GPU's most
     recent, its first block last, so GPU eviction takes chain tails first.
Only full blocks are cached, as in vLLM (the trace's last block of a request is
partial). Blocks saved from prefill = g + h. Host tiers compared at equal capacity: our
pool with `lru` and `prefix_aware`, vLLM 0.32's `CPUOffloadingManager` with `lru` and
`arc` (driven through its own
lookup/prepare_load/complete_load/touch/prepare_store/complete_store API), and two
offline references: LRU that admits only blocks that will be used again ("oracle-admit
lru": perfect admission, no knowledge of when), and Belady's optimum for the host tier
(evict the block used farthest in the future, decline to admit one used later than every
held block; ties evict the deeper block) as the limit. Belady here knows every future
use, including uses the GPU tier will serve, so it is a limit for the host tier, not an
exact optimum of the two tiers together.

Usage: /work/venv/bin/python benchmarks/trace_replay.py [--gpu-blocks G]
           [--host-blocks C ...] [--limit N] [--no-vllm]
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from vllm_cpu_offload.scheduler.block_pool import HostBlockPool  # noqa: E402
from vllm_cpu_offload.scheduler.policies import LRUPolicy  # noqa: E402
from vllm_cpu_offload.scheduler.policies.registry import make_policy  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
RESULTS = REPO / "benchmarks" / "results"
NEVER = 1 << 62
BLOCK_TOKENS = 512


class HostTier(Protocol):
    def serve(self, index: int, keys: Sequence[int], gpu_hits: int) -> int:
        """Steps 2-4 for request `index`; returns the host hit h."""
        ...


class GpuPrefixCache:
    """LRU prefix cache of `capacity` blocks, as vLLM's GPU block pool behaves for one
    request at a time: a request's blocks are freed tail first, so evicted tail
    first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def hit(self, keys: Sequence[int]) -> int:
        n = 0
        for key in keys:
            if key not in self._lru:
                break
            n += 1
        return n

    def finish(self, keys: Sequence[int]) -> list[int]:
        """Makes `keys` the most recent; returns the keys evicted for them, oldest
        first."""
        lru = self._lru
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
        evicted = []
        while len(lru) > self.capacity:
            evicted.append(lru.popitem(last=False)[0])
        return evicted


class OurTier:
    def __init__(self, policy: str, capacity: int) -> None:
        self.pool = HostBlockPool(
            capacity, make_policy(policy, capacity), record_events=False
        )

    def serve(self, index: int, keys: Sequence[int], gpu_hits: int) -> int:
        pool = self.pool
        after = keys[gpu_hits:]
        h = pool.count_hits(after)
        if h:
            loaded = after[:h]
            pool.pin(loaded)
            pool.unpin(loaded)
        pool.touch(keys[:gpu_hits], by_device=True)
        allocated = pool.allocate_for_store(keys, None)
        pool.complete_store([key for key, _ in allocated], True)
        return h


class OracleAdmitLru(LRUPolicy):
    """Reference, not a real policy: LRU that admits (when full) only blocks used
    again."""

    reused: set[int] = set()

    def admit(self, key: object) -> bool:
        return key in self.reused


class OracleAdmitTier(OurTier):
    def __init__(self, capacity: int, next_use: list[list[int]]) -> None:
        self.policy = OracleAdmitLru(capacity)
        self.pool = HostBlockPool(capacity, self.policy, record_events=False)
        self.next_use = next_use

    def serve(self, index: int, keys: Sequence[int], gpu_hits: int) -> int:
        nxt = self.next_use[index]
        self.policy.reused = {
            key for key, use in zip(keys, nxt, strict=True) if use != NEVER
        }
        return super().serve(index, keys, gpu_hits)


class VllmTier:
    """vLLM's CPUOffloadingManager (0.32, 0.33), as its OffloadingConnector drives
    it; `module_path` loads `policy` from outside vLLM (`cache_policy_module_path`)."""

    def __init__(
        self,
        policy: str,
        capacity: int,
        module_path: str | None = None,
        **manager_kwargs: object,
    ) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        # `manager_kwargs`: the manager's other settings, e.g. `store_threshold`, or
        # (the series' [3/8]) `cache_policy_kwargs`.
        self.manager = CPUOffloadingManager(
            capacity,
            cache_policy=policy,
            cache_policy_module_path=module_path,
            **manager_kwargs,  # type: ignore[arg-type]
        )
        self._hit = LookupResult.HIT
        self._ctx = ReqContext
        self._key = make_offload_key
        self._keys: dict[int, bytes] = {}

    def _offload_keys(self, keys: Sequence[int]) -> list:
        cache, make = self._keys, self._key
        out = []
        for key in keys:
            okey = cache.get(key)
            if okey is None:
                okey = cache[key] = make(key.to_bytes(8, "big"), 0)
            out.append(okey)
        return out

    def serve(self, index: int, keys: Sequence[int], gpu_hits: int) -> int:
        mgr = self.manager
        okeys = self._offload_keys(keys)
        ctx = self._ctx(req_id=str(index))
        for pos, okey in enumerate(okeys):
            ctx.set_offload_key_position(okey, (pos + 1) * 512)
        mgr.on_new_request(ctx)
        h = 0
        for okey in okeys[gpu_hits:]:
            if mgr.lookup(okey, ctx) is not self._hit:
                break
            h += 1
        if h:
            loaded = okeys[gpu_hits : gpu_hits + h]
            mgr.prepare_load(loaded, ctx)
            mgr.complete_load(loaded, ctx)
        # As vLLM 0.33.0's connector drives the manager: it never calls `touch`
        # (`CPUOffloadingManager.touch`, v1/kv_offload/cpu/manager.py:244, has no
        # caller in offloading/scheduler.py), so a policy hears of device hits only as
        # existing keys of a store offer. After a host load the offer starts past the
        # loaded chunks (`next_stored_chunk_idx = num_chunks`, scheduler.py:1469-1472);
        # without one, at chunk 0 (the field's default, scheduler.py:339).
        offer = okeys[gpu_hits + h :] if h else okeys
        out = mgr.prepare_store(offer, ctx) if offer else None
        if out is not None and out.keys_to_store:
            mgr.complete_store(out.keys_to_store, ctx)
        mgr.on_request_finished(ctx)
        return h


class BeladyTier:
    """Offline optimum for the host tier alone: knows each block's next request."""

    def __init__(self, capacity: int, next_use: list[list[int]]) -> None:
        self.capacity = capacity
        self.next_use = next_use
        self._held: dict[int, int] = {}  # key -> next use
        self._heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key), lazy

    def serve(self, index: int, keys: Sequence[int], gpu_hits: int) -> int:
        held, heap, nxt = self._held, self._heap, self.next_use[index]
        h = 0
        for key in keys[gpu_hits:]:
            if key not in held:
                break
            h += 1
        for depth, key in enumerate(keys):
            use = nxt[depth]
            if key in held or use != NEVER and self._make_room(use, depth):
                held[key] = use
                heapq.heappush(heap, (-use, -depth, key))
        return h

    def _make_room(self, use: int, depth: int) -> bool:
        held, heap = self._held, self._heap
        if len(held) < self.capacity:
            return True
        while heap:
            neg_use, neg_depth, key = heap[0]
            if held.get(key) != -neg_use:
                heapq.heappop(heap)  # stale entry
                continue
            if (-neg_use, -neg_depth) <= (use, depth):
                return False  # every held block is needed sooner: decline
            heapq.heappop(heap)
            del held[key]
            return True
        return False


def load_requests(limit: int | None = None) -> list[dict]:
    """The trace's records in arrival order."""
    with TRACE.open() as f:
        requests = [json.loads(line) for line in f]
    requests.sort(key=lambda r: r["timestamp"])  # stable: ties keep file order
    return requests if limit is None else requests[:limit]


def cached_keys(request: dict) -> list[int]:
    # vLLM hashes only full blocks: a request's last, partial block is never cached.
    return request["hash_ids"][: request["input_length"] // BLOCK_TOKENS]


def load_trace(limit: int | None) -> list[list[int]]:
    return [cached_keys(r) for r in load_requests(limit)]


def next_uses(
    trace: list[list[int]], device_hits: Sequence[int] | None = None
) -> list[list[int]]:
    """next_use[i][j]: index of the next request after i that holds trace[i][j]; with
    `device_hits`, only requests that hold it past their device hit count."""
    upcoming: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        out[i] = [upcoming.get(key, NEVER) for key in trace[i]]
        first = device_hits[i] if device_hits is not None else 0
        for key in trace[i][first:]:
            upcoming[key] = i
    return out


def replay(trace: list[list[int]], gpu_blocks: int, tier: HostTier) -> dict[str, float]:
    gpu = GpuPrefixCache(gpu_blocks)
    gpu_hits = host_hits = 0
    start = time.perf_counter()
    for index, keys in enumerate(trace):
        g = gpu.hit(keys)
        h = tier.serve(index, keys, g)
        gpu.finish(keys)
        gpu_hits += g
        host_hits += h
    return {
        "gpu_hits": gpu_hits,
        "host_hits": host_hits,
        "saved": gpu_hits + host_hits,
        "seconds": time.perf_counter() - start,
    }


def pool_costs() -> dict[str, dict[str, float]]:
    """The pool's cost per block (pool_microbench.py at a smaller size), printed."""
    from pool_microbench import bench_policy

    columns = ["lookup", "store", "store+evict", "evict"]
    print("pool cost, microseconds per block (65536 blocks, chains of 32, best of 3):")
    print(f"{'policy':<14}" + "".join(f"{c:>13}" for c in columns))
    costs = {}
    for name in ("lru", "prefix_aware"):
        runs = [bench_policy(name, 65536, 32, 1000) for _ in range(3)]
        costs[name] = {c: min(r[c] for r in runs) for c in columns}
        print(f"{name:<14}" + "".join(f"{costs[name][c]:>13.3f}" for c in columns))
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-blocks", type=int, default=1000)
    parser.add_argument(
        "--host-blocks",
        type=int,
        nargs="+",
        default=[1000, 2000, 3000, 4000, 6000, 8000, 12000, 16000, 24000, 32000],
    )
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's manager")
    parser.add_argument(
        "--policies", nargs="+", default=None, help="subset of tiers to run"
    )
    args = parser.parse_args()

    trace = load_trace(args.limit)
    total = sum(map(len, trace))
    upcoming = next_uses(trace)
    tiers: dict[str, Callable[[int], HostTier]] = {}
    if not args.no_vllm:
        tiers["vllm lru"] = lambda c: VllmTier("lru", c)
        tiers["vllm arc"] = lambda c: VllmTier("arc", c)
    tiers["ours lru"] = lambda c: OurTier("lru", c)
    tiers["ours prefix_aware"] = lambda c: OurTier("prefix_aware", c)
    tiers["oracle-admit lru"] = lambda c: OracleAdmitTier(c, upcoming)
    tiers["belady"] = lambda c: BeladyTier(c, upcoming)
    if args.policies:
        tiers = {name: make for name, make in tiers.items() if name in args.policies}
    baseline = "vllm lru" if "vllm lru" in tiers else "ours lru"

    print(
        f"{len(trace)} requests, {total} blocks of 512 tokens, GPU tier "
        f"{args.gpu_blocks} blocks"
    )
    print(f"gap closed: share of the ({baseline} -> belady) gap in blocks saved")
    print(
        f"{'host C':>7} {'tier':<18} {'host hits':>9} {'saved':>7} {'saved %':>8} "
        f"{'gap closed':>10} {'s':>6}"
    )
    rows = []
    for capacity in args.host_blocks:
        batch = {}
        for name, make in tiers.items():
            batch[name] = replay(trace, args.gpu_blocks, make(capacity))
        low = batch.get(baseline, {}).get("saved")
        high = batch.get("belady", {}).get("saved")
        for name, result in batch.items():
            gap = None
            if low is not None and high is not None and high != low:
                gap = (result["saved"] - low) / (high - low)
            rows.append(
                {"host_blocks": capacity, "tier": name, "gap_closed": gap, **result}
            )
            shown = f"{100 * gap:>9.1f}%" if gap is not None else f"{'-':>10}"
            print(
                f"{capacity:>7} {name:<18} {result['host_hits']:>9} "
                f"{result['saved']:>7} {100 * result['saved'] / total:>7.2f}% {shown} "
                f"{result['seconds']:>6.1f}",
                flush=True,
            )
    costs = pool_costs()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "trace_replay.json"
    meta = {
        "requests": len(trace),
        "blocks": total,
        "gpu_blocks": args.gpu_blocks,
        "machine": platform.platform(),
        "python": platform.python_version(),
    }
    out.write_text(
        json.dumps({"meta": meta, "rows": rows, "pool_costs_us": costs}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
