"""What changes, while the fleet runs, the KV one engine computes (`identities.py`'s
runtime kinds): at a seeded step mid-run, on one seeded engine (A, A2 or B),
- `weights-updated`: its weights are replaced as vLLM replaces them, in one of three
  ways: `reset`, an RL loop's `pause_generation(clear_cache=True)` then
  `update_weights` (vLLM's scheduler resets its prefix cache, preempting every running
  request, and the connector's cache; then each worker's weights change);
  `prefix-reset`, a caller's `reset_prefix_cache()` without `reset_connector`, then
  `collective_rpc("reload_weights")` (vLLM's prefix cache holds nothing of before, the
  connector was not told); or `reload`, `collective_rpc("reload_weights")` alone (no
  reset: vLLM's own prefix cache keeps what the old weights computed). Each worker is
  told through vLLM's own
  `Worker.reload_weights`, as the product wraps it, in a process of its own (the
  product's list of this process's worker halves holds that rank's alone). From then
  on the engine's KV has other values (the oracle's salt of the engine changes);
- `adapter-reloaded`: the LoRA adapter's files are rewritten in place on its host and
  its workers load them (vLLM's `load_inplace`): its adapter requests from then on
  compute other KV (requests made after it: another adapter of the oracle; requests
  hashed before it and still in flight: other values at every position computed after
  it, under their old hashes).

On half of the seeds whose change comes without a reset (`reload`, `in-place`), the
change waits until a load of its engine runs across steps (started, its copy still
to run, as CUDA's background stream runs it: `late_copies.py`) and lands in that
window: the load must end refused, and its request recompute what it would have read.

What stays allowed after the change, as vLLM's own prefix cache allows it (`Stale`):
reads of what vLLM's prefix cache of the engine held then, or of what a request still
in flight had computed (not what a load of the tier was still bringing it), may hold
the values of before. Nothing else may: a block of
the engine's host tier, of the store, or of another engine, computed with the old
weights or files, read after the change, is a wrong value; and a block the changed
engine writes
to the store under a name the others compute holds other bytes than the name stands
for (`Oracle.check_value`). The engines whose weights and files did not change keep
sharing: at the end, none of them is sealed or holds a changed adapter identity.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch

from vllm_cpu_offload import adapter_reloads, runtime_weights

if TYPE_CHECKING:
    from tests.simulation.world import Engine

ENGINES = ("A", "A2", "B")
# What the engine's KV values become (XOR with what they were).
WEIGHTS_MIX = 0x0F1E2D
ADAPTER_MIX = 0x2D1E0F
# The oracle's adapter of the files rewritten in place.
ADAPTER_RELOADED = 3
# How many steps past its own an `in_flight` event waits for a load in flight.
IN_FLIGHT_WAIT = 20


@dataclass(frozen=True)
class RuntimeEvent:
    """One runtime change: of what, on which engine, at which step, how."""

    kind: str  # "weights-updated" or "adapter-reloaded"
    engine: str
    step: int
    mode: str  # weights: "reset", "prefix-reset" or "reload"; adapter: "in-place"
    # It waits (up to `IN_FLIGHT_WAIT` steps) until a load of its engine runs
    # across steps (started, its copy not run yet), and lands in that window.
    in_flight: bool = False


def event_of(kind: str, seed: int, steps: int) -> RuntimeEvent | None:
    """The run's event (None for a static kind), drawn from a generator of its own:
    the rest of the run draws as it would without one."""
    if kind not in ("weights-updated", "adapter-reloaded"):
        return None
    rng = random.Random(f"{seed}/runtime-event")
    engine = rng.choice(ENGINES)
    mode = rng.choice(("reset", "reload")) if kind == "weights-updated" else "in-place"
    step = rng.randrange(max(1, steps // 4), max(2, steps // 2 + 1))
    if mode == "reload" and rng.random() < 0.5:  # drawn last: the rest draw as before
        mode = "prefix-reset"
    # Drawn after those: the earlier draws stay what they were.
    in_flight = mode in ("reload", "in-place") and rng.random() < 0.5
    return RuntimeEvent(kind, engine, step, mode, in_flight)


@dataclass
class Stale:
    """What an engine's reads may still hold after its KV changed: the values of before
    (today's XOR `mix`), in blocks whose hash vLLM's prefix cache held then, or that a
    request in flight then had computed part of (a block it completes after the
    change holds values of both, and vLLM's prefix cache, like the engine's host
    tier, serves it by its hash), or at positions a request in flight had computed
    then. The host tier's blocks of then are not among them: it drops them."""

    mix: int
    hashes: set[bytes]
    computed: dict[str, int]  # request -> tokens computed at the change
    # The requests it applies to (None: every request of the engine).
    requests: frozenset[str] | None = None
    # Requests in flight at the change, and how many of their first blocks hold
    # positions computed then, until those blocks are all hashed.
    partial: dict[str, tuple[Any, int]] = field(default_factory=dict)

    @classmethod
    def at_change(
        cls,
        engine: Engine,
        mix: int,
        block_size: int,
        requests: frozenset[str] | None = None,
    ) -> Stale:
        computed = computed_tokens(engine)
        # A request waiting for a load that spans steps has the load's tokens
        # counted as computed (vLLM sets them ahead: scheduler.py:1324-1326), but
        # the tier loads them: a load that ends after the change must be refused.
        # Only its device hits (in vLLM's prefix cache) may hold values of before.
        for rank in engine.ranks:
            for req_id in rank.connector.worker._async_req.values():
                computed[req_id] = 0
        stale = cls(mix, set(held_hashes(engine)), computed, requests)
        for req_id, tokens in computed.items():
            if tokens and (requests is None or req_id in requests):
                request = engine.scheduler.requests[req_id]
                stale.partial[req_id] = (request, -(-tokens // block_size))
        return stale

    def _hash_partial(self) -> None:
        """Takes in the hashes of in-flight requests' blocks completed since."""
        for req_id, (request, blocks) in list(self.partial.items()):
            hashes = request.block_hashes
            self.hashes.update(bytes(h) for h in hashes[:blocks])
            if len(hashes) >= blocks:
                del self.partial[req_id]

    def allowed(
        self, req_id: str, block_hashes: Any, done: int, block_size: int
    ) -> torch.Tensor | None:
        """[done]: at which of positions [0, done) `req_id` may read the values of
        before; None where at none."""
        if self.requests is not None and req_id not in self.requests:
            return None
        if self.partial:
            self._hash_partial()
        upto = self.computed.get(req_id, 0)
        blocks = (done + block_size - 1) // block_size
        held = [bytes(h) in self.hashes for h in block_hashes[:blocks]]
        held += [False] * (blocks - len(held))
        if not upto and not any(held):
            return None
        pos = torch.arange(done)
        return (pos < upto) | torch.tensor(held, dtype=torch.bool)[pos // block_size]


@dataclass
class EngineChange:
    """What one engine's KV is after its event: a mix of the values of some requests
    (the adapter's in flight), which requests' KV the oracle computes with the new
    adapter, and what may still be read of before."""

    stale: Stale | None = None
    # Requests hashed before the adapter changed: their new positions, mixed.
    mixed: frozenset[str] = frozenset()
    reloaded_adapter: bool = False
    sealed_ok: bool = False  # the engine's store may be sealed
    fired_at: int | None = None  # the step the event took place at

    def mix_of(self, req_id: str) -> int:
        return ADAPTER_MIX if req_id in self.mixed else 0


def held_hashes(engine: Engine) -> frozenset[bytes]:
    """The block hashes vLLM's prefix cache of the engine holds now."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    pool = engine.scheduler.kv_cache_manager.block_pool
    return frozenset(
        bytes(get_block_hash(b.block_hash))
        for b in pool.blocks
        if b.block_hash is not None
    )


def computed_tokens(engine: Engine) -> dict[str, int]:
    return {
        req_id: r.num_computed_tokens
        for req_id, r in engine.scheduler.requests.items()
        if not r.is_finished()
    }


def resettable(engine: Engine) -> bool:
    """Whether vLLM's `reset_prefix_cache(reset_running_requests=True)` frees every
    device block now: only running requests (which it preempts) hold blocks; none
    waits for a load spanning steps, is back in the queue with the blocks a load
    filled, or holds its blocks past its end (stores in flight). vLLM's pause waits
    for that too."""
    from vllm.v1.request import RequestStatus

    manager = engine.scheduler.kv_cache_manager
    queued = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for req_id, request in engine.scheduler.requests.items():
        if request.status == RequestStatus.RUNNING:
            continue
        if request.status not in queued or any(manager.get_block_ids(req_id)):
            return False
    return True


def tell_workers(engine: Engine) -> None:
    """Each rank's worker changes its weights through vLLM's `Worker.reload_weights`
    (the product's wrapper tells the tier first), in a process of its own: the
    product's list of this process's worker halves holds that rank's alone."""
    from vllm.v1.worker.gpu_worker import Worker

    config = engine.scheduler.vllm_config
    for rank in engine.ranks:
        worker = SimpleNamespace(
            vllm_config=config,
            model_runner=SimpleNamespace(reload_weights=lambda *a, **k: None),
        )
        this_process = [weakref.WeakMethod(rank.connector.worker.weights_changed)]
        with mock.patch.object(runtime_weights, "_workers", this_process):
            Worker.reload_weights(worker)  # type: ignore[arg-type]


def tell_workers_of_the_adapter(engine: Engine) -> None:
    """Each rank's worker has loaded the rewritten adapter: the product's hook on
    vLLM's worker LoRA manager tells the rank's worker half
    (`adapter_reloads.py`; the hook's comparison is `test_adapter_reloads.py`'s)."""
    for rank in engine.ranks:
        this_process = [weakref.WeakMethod(rank.connector.worker.adapter_changed)]
        with mock.patch.object(adapter_reloads, "_workers", this_process):
            adapter_reloads.adapter_changed()


def rewrite_in_place(weights: Path) -> None:
    """The adapter retrained and written over its files (same size, other bytes)."""
    data = bytearray(weights.read_bytes())
    data[len(data) // 3] ^= 0xA5
    weights.write_bytes(bytes(data))
