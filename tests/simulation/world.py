"""One simulated fleet: three engines (TP ranks each) on one store, driven by a seed.

Engine A, its twin A2 (same fingerprint: they read each other's blocks from the store)
and B, whose KV differs from theirs in one of the ways of `identities.py` (by seed: a
config override, the length a LongRoPE model runs at, a fine-tuned LayerNorm under the
same path, a config field no list names); or all three start alike and one's weights
or adapter files change mid-run (`runtime_events.py`). Each is vLLM's real
`Scheduler` (our scheduler half inside it) and one worker half per TP rank, whose
reports vLLM's own `KVOutputAggregator` joins. A and B run at the run's TP size
(`--tp`); A2 runs at another size of {1, 2, 4} on two seeds of every three
(`seed % 3 != 2`; of the two other sizes, the larger on seeds 0-2, 6-8, ..., the
smaller on seeds 3-5, 9-11, ...: seeds 0-5 at TP 1, 2 and 4 pair every size with
every other both ways, and seed 3, MLA-style, has A2 at TP=1), and at A's size on the
third (`World.twin_tp`). The shared store keeps one
value per KV head (`kv_shards.py`) under a namespace without the TP size, so a TP=1
engine reads a TP=2 or TP=4 engine's blocks and the reverse; the replay line needs no
more than the seed and A's TP size.

Each rank's KV cache per layer is vLLM's `[blocks, heads it holds, block size, 2]`:
the model's 2 KV heads are both on the rank at TP=1, one on each at TP=2, and each held
by two ranks at TP=4. A slot of KV head g holds the oracle's value for head g (for
replicated, MLA-style KV, every rank holds head 0's values), so a block joined from the
wrong heads is a wrong value.

On seeds 1, 4, 7, ... the engines run an EAGLE-style drafter whose two layers form a
KV cache group of their own, marked as vLLM marks a drafter's group (its device hits
drop their last block), beside the model's group: each group's blocks are looked up,
loaded, stored, written to the store and joined across TP sizes apart. A drafter slot
holds a value of the prefix through the next token (`oracle.py`); a block's last slot,
which its hash does not cover, must hold this block's value for some next token.

After every step the world checks: no slot read as computed holds a wrong value unless
vLLM was told to recompute its block; no store value holds another block's bytes; no
store call names unregistered memory, nor is memory unregistered under one; no host
block is rewritten while a store call uses it; vLLM's scheduler raised nothing; the
pool's invariants hold; no request finished twice. At quiescence (faults off, every
late call and copy run, requests done): no pins, jobs, held writes, worker bookkeeping
or store calls left, and every request finished exactly once; with a drafter group,
some of its blocks loaded where the model's were.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import shutil
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any, cast
from unittest import mock

import torch

from tests.simulation import kv_check
from tests.simulation.identities import (
    ADAPTER_ID,
    ADAPTER_NAME,
    MAX_MODEL_LEN,
    identities_of,
)
from tests.simulation.late_copies import CopyFaults, LateCopies
from tests.simulation.mooncake_client import SimMooncakeStore
from tests.simulation.oracle import Oracle, head_of, next_token
from tests.simulation.replicated import replicated_kv
from tests.simulation.runtime_events import (
    ADAPTER_MIX,
    ADAPTER_RELOADED,
    IN_FLIGHT_WAIT,
    WEIGHTS_MIX,
    EngineChange,
    Stale,
    event_of,
    resettable,
    rewrite_in_place,
    tell_workers,
    tell_workers_of_the_adapter,
)
from tests.simulation.store import BACKENDS, SimBackend, SimStore, StoreFaults
from vllm_cpu_offload import lora_identity
from vllm_cpu_offload.scheduler.drafter_layer import DrafterLayer
from vllm_cpu_offload.scheduler.shared_tier import SharedTier
from vllm_cpu_offload.worker import remote_io

# What a process reads of an adapter's files (the world gives each engine its own view).
_READ_ADAPTER = lora_identity._contents_of

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_cpu_offload.spec import OffloadSpec

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16
DEVICE_BLOCKS = 40
HOST_BLOCKS = 48
LAYERS = ("l0", "l1")
# An EAGLE-style drafter's layers (an MTP drafter of two layers), in a KV cache group
# of their own (group 1). As vLLM lays groups out, layer i of each group shares one
# tensor: a device block id belongs to one group.
DRAFTER_LAYERS = ("d0", "d1")
SLOT_BYTES = 2 * 4  # K and V of one head of size 1, float32
PAGE_BYTES = BLOCK_SIZE * SLOT_BYTES  # one KV head of one layer of a block
TP_SIZES = (1, 2, 4)  # what A2 picks its own TP size from
PREFIXES = 6  # shared document prefixes
SETTLE_S = 30.0
# Simulated seconds a step: about what a step of the three engines takes on wall time
# here, so that the store's back-off (1 s) and retains (0.02-600 s) span as many steps
# as they did on the wall clock.
STEP_S = 0.04
SIM_STORE = "tests.simulation.store:SimStore"
MOONCAKE_STORE = "tests.simulation.mooncake_client:SimMooncakeStore"
SLOW_STORE = StoreFaults(fail=0.02, timeout=0.05, hold=0.6)
# The bytes of a worker's fetch staging buffer: the product's (32 MiB, zeroed at each
# worker's start: a third of a run's time went there) holds more than a hundred
# thousand of the simulation's blocks; this one, over a thousand, more than a fetch
# of the simulation asks for (`World._engine` checks), so fetches are the same calls.
FETCH_BATCH_BYTES = 1 << 20
# The oracle's adapter of B's host's LoRA files (A's and A2's are adapter 1).
ADAPTER_B = 2


class Violation(AssertionError):
    """A broken invariant; the message says which, at which step."""


def vllm_test_utils() -> ModuleType:
    """vLLM's `tests/v1/kv_connector/unit/utils.py`, from its source distribution."""
    import vllm

    from tests.vllm_helpers.connector_test_utils import load_connector_test_utils

    version = vllm.__version__.split("+")[0]
    sdist = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch_vllm_sdist.sh"), version],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout.strip()
    return load_connector_test_utils(Path(sdist))


@dataclass
class _Rank:
    connector: Any
    kv: dict[str, torch.Tensor]
    faults: CopyFaults
    copies: LateCopies
    # The oracle's value index of each KV head in `kv` (dim 1): its global KV head,
    # 0 for replicated KV.
    heads: tuple[int, ...]


@dataclass
class Engine:
    """vLLM's Scheduler with our scheduler half, and one worker half per rank."""

    name: str
    scheduler: Any
    ranks: list[_Rank]
    salt: int
    aggregator: Any
    finished: dict[str, int] = field(default_factory=dict)  # request -> times
    added: list[str] = field(default_factory=list)
    # Each request's tokens as the workers know them: with async scheduling a token
    # is computed on in the step after it was sampled, before vLLM has appended it.
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # Async scheduling: the last step, executed, whose output vLLM has not taken yet.
    pending: tuple[Any, Any] | None = None
    # Whether the last schedule preempted a request.
    preempted: bool = False
    # What this engine's process worked out of the LoRA adapter (`lora_identity`):
    # each engine is a process of its own, with its own token, and sees the
    # adapter's files of its own host (what it first read of them).
    lora_keys: dict[Any, Any] = field(default_factory=dict)
    lora_contents: dict[str, str] = field(default_factory=dict)
    process_token: str = field(default_factory=lambda: secrets.token_hex(8))
    # `adapter-reloaded`: the adapter's folder on this engine's host, read as it is
    # at each look (its files may be rewritten in place).
    adapter_host: Path | None = None
    # What a runtime event changed of this engine's KV (`runtime_events.py`).
    change: EngineChange = field(default_factory=EngineChange)

    @property
    def tier(self) -> Any:
        return self.scheduler.connector.scheduler


class World:
    """See the module docstring. `run()` raises `Violation` at the first broken
    invariant."""

    def __init__(
        self, utils: ModuleType, model: str, seed: int, tp: int, steps: int
    ) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash

        init_none_hash(sha256)
        self.utils = utils
        self.seed, self.tp, self.steps = seed, tp, steps
        # A2's TP size: another one than A's on two seeds of three (module docstring).
        others = [t for t in TP_SIZES if t != tp]
        self.twin_tp = tp if seed % 3 == 2 else others[(seed // 3 + 1) % len(others)]
        # Odd seeds run vLLM's async scheduling: a step is scheduled (and its aborts
        # taken) before the last step's output, its reports included, is processed.
        self.async_scheduling = seed % 2 == 1
        # Every other pair of seeds at TP > 1 (A's) runs MLA-style KV: the same on every
        # rank, in one host region the ranks of an engine at TP > 1 share (the first
        # rank stores, all load) and one value per block in the store, named without
        # the rank (A2 may then run at TP=1: the namespace has no TP size).
        self.replicated = tp > 1 and (seed // 2) % 2 == 1
        # Seeds 1, 4, 7, ... run an EAGLE-style drafter with a KV cache group of its
        # own, whose KV at a block's last position depends on the next block's first
        # token (`oracle.py`); hits end a block before a prompt's end and drop their
        # volatile last block (looked up again, in the pool and in the store), as
        # vLLM's own prefix cache drops it, under every fault of the run.
        self.drafter = seed % 3 == 1
        # The layers of each KV cache group (the drafter's: group 1).
        self.groups = (LAYERS, DRAFTER_LAYERS) if self.drafter else (LAYERS,)
        self.layers = tuple(layer for group in self.groups for layer in group)
        self.rng = random.Random(seed)
        self.step_no = 0
        self.name = f"sim-{seed}-{tp}-{id(self)}"
        entries = {g: 2 * len(layers) for g, layers in enumerate(self.groups)}
        self.oracle = Oracle(
            BLOCK_SIZE, entries, frozenset({1} if self.drafter else ())
        )
        self.backend = SimBackend(seed, StoreFaults(), self.oracle.check_value)
        BACKENDS[self.name] = self.backend
        self._next_request = 0
        self._prefixes = [
            [self.rng.randrange(1, 5000) for _ in range(BLOCK_SIZE * (1 + i))]
            for i in range(PREFIXES)
        ]
        # Engine A2 is A's twin (same fingerprint, at `twin_tp`): it reads what A
        # wrote to the store and the reverse. Engine B differs in what its KV depends
        # on, in one of the ways of `identities.py`: it must never read their blocks,
        # nor they its. A2 reaches the store through the product's Mooncake adapter
        # (over a simulated Mooncake client): its call thread, timeouts, recoveries
        # and registrations run as they do against a real master.
        self._folder = Path(tempfile.mkdtemp(prefix="vco-sim-"))
        self.identities = identities_of(seed, model, self._folder)
        self.event = event_of(self.identities.kind, seed, steps)
        same = self.identities.model
        with replicated_kv(self.replicated):
            self.engines = [
                self._engine("A", same, None, tp, salt=0x000000),
                self._engine(
                    "A2", same, None, self.twin_tp, salt=0x000000, store=MOONCAKE_STORE
                ),
            ]
            for engine in self.engines:
                self._host_adapter(engine)
                self._learn_adapter(engine)
            with self.identities.as_b():
                self.engines.append(
                    self._engine(
                        "B",
                        same,
                        self.identities.b_overrides,
                        tp,
                        salt=0x5A5A5A if self.identities.b_kv_differs else 0x000000,
                        max_model_len=self.identities.b_max_model_len,
                    )
                )
                self._host_adapter(self.engines[-1])
                self._learn_adapter(self.engines[-1])

    # ---- building ----

    def _engine(
        self,
        name: str,
        model: str,
        overrides: dict[str, Any] | None,
        tp: int,
        salt: int,
        store: str = SIM_STORE,
        max_model_len: int = MAX_MODEL_LEN,
    ) -> Engine:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )

        import vllm_cpu_offload.remote.layer as shared_tier_layer
        import vllm_cpu_offload.worker.region_layer as region_layer
        from vllm_cpu_offload.connector import CPUOffloadConnector
        from vllm_cpu_offload.kv_shards import worker_shards

        config = self.utils.create_vllm_config(
            model=model,
            block_size=BLOCK_SIZE,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            max_model_len=max_model_len,
            dtype="float32",
            hf_overrides=overrides,
            kv_connector="CPUOffloadConnector",
            kv_connector_module_path="vllm_cpu_offload.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "remote_url": f"py://{store}?world={self.name}",
                # What a call held past it costs the simulation in wall time.
                "remote_timeout_s": 0.05,
                "async_load_tokens": 2 * BLOCK_SIZE,
            },
            kv_load_failure_policy="recompute",
        )
        # vLLM's helper gives the length to the scheduler only; the layers read the
        # model config's (`--max-model-len` sets both).
        config.model_config.max_model_len = max_model_len
        config.parallel_config.tensor_parallel_size = tp
        config.scheduler_config.async_scheduling = self.async_scheduling
        heads = [_heads_of(worker_shards(config, r, 0)) for r in range(tp)]
        local_heads = len(heads[0])
        # HOST_BLOCKS host blocks whatever the TP size: a block is the rank's heads.
        config.kv_transfer_config.kv_connector_extra_config["swap_space_gib"] = (
            HOST_BLOCKS * PAGE_BYTES * local_heads * len(LAYERS) / (1 << 30)
        )
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=local_heads,
            head_size=1,
            dtype=torch.float32,
        )
        groups = [KVCacheGroupSpec(list(LAYERS), spec)]
        tensors = []
        if self.drafter:
            # vLLM drops the last block of the drafter group's device hits.
            groups.append(
                KVCacheGroupSpec(list(DRAFTER_LAYERS), spec, is_eagle_group=True)
            )
            page = spec.page_size_bytes
            tensors = [
                KVCacheTensor(
                    size=DEVICE_BLOCKS * page,
                    layers=[t, d],
                    layer_stride=0,  # both layers view the same bytes
                    block_stride=page,
                )
                for t, d in zip(LAYERS, DRAFTER_LAYERS, strict=True)
            ]
        kv_config = KVCacheConfig(
            num_blocks=DEVICE_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups
        )
        ranks = []
        for r in range(tp):
            self.backend.next_client = f"{name}/tp{r}"
            ranks_of = lambda r=r: (r, 0)  # noqa: E731
            with (
                mock.patch.object(shared_tier_layer, "this_ranks", ranks_of),
                mock.patch.object(region_layer, "this_ranks", ranks_of),
            ):
                worker = CPUOffloadConnector(config, KVConnectorRole.WORKER, kv_config)
            # vLLM's CPU layout: [blocks, kv heads, block size, 2 * head size], the
            # heads this rank holds.
            kv = {
                n: torch.full((DEVICE_BLOCKS, local_heads, BLOCK_SIZE, 2), -1.0)
                for n in LAYERS
            }
            if self.drafter:
                kv |= dict(zip(DRAFTER_LAYERS, kv.values(), strict=True))
            with mock.patch.object(remote_io, "FETCH_BATCH_BYTES", FETCH_BATCH_BYTES):
                worker.register_kv_caches(kv)  # makes the worker's store traffic
            io = worker.worker.shared.remote_io if worker.worker else None
            # Every fetch of the simulation (a prompt's blocks of every group) is one
            # call, as with the product's own batch.
            assert io is None or io._fetch_batch >= 2 * max_model_len // BLOCK_SIZE
            faults = CopyFaults()
            assert worker.worker is not None and worker.worker.engine is not None
            copies = LateCopies(
                worker.worker.engine,
                random.Random(f"{self.seed}/{name}/copies/{r}"),
                faults,
                self.backend.spans_in_use,
                self._violation,
            )
            ranks.append(_Rank(worker, kv, faults, copies, heads[r]))
        self.backend.next_client = f"{name}/scheduler"
        scheduler = self.utils.create_scheduler(
            config, num_blocks=DEVICE_BLOCKS, kv_cache_config=kv_config
        )
        engine = Engine(name, scheduler, ranks, salt, KVOutputAggregator(tp))
        # The scheduler half's deadlines and windows (retains, the store's back-off,
        # blocks it failed to serve) run on the simulation's clock: they expire at
        # the same steps however fast the machine. (Replays are not yet identical on
        # busy cores: the store calls' timeouts still run on the wall clock.)
        tier = engine.tier
        if self.drafter:
            eagle = SimpleNamespace(
                method="eagle",
                draft_model_config=True,
                use_eagle_block_drop=lambda: True,
            )
            # The two fields of the spec the layer reads.
            drafter_spec = SimpleNamespace(
                vllm_config=SimpleNamespace(
                    speculative_config=eagle, model_config=config.model_config
                ),
                kv_cache_config=kv_config,
            )
            DrafterLayer(cast("OffloadSpec", drafter_spec)).attach_scheduler(tier)
        tier.retention.clock = self.now
        namespace = ""  # nothing identifies the weights: the engine shares nothing
        if isinstance(tier.shared, SharedTier):
            tier.shared.lookup.clock = self.now
            namespace = tier.shared.namespace
        problem = self.oracle.add_engine(namespace, salt)
        if problem is not None:
            self._violation(problem)
        return engine

    # ---- running ----

    def now(self) -> float:
        """The simulation's clock: STEP_S seconds a step."""
        return self.step_no * STEP_S

    def _violation(self, what: str) -> None:
        self.backend.violation(what)

    def _check_violations(self) -> None:
        if self.backend.violations:
            raise Violation(self.backend.violations[0])

    def run(self) -> None:
        try:
            for _ in range(self.steps):
                self._tick(faults=True)
                for engine in self.engines:
                    self._act(engine)
                    self._step(engine)
                    self._check_violations()
            self._quiesce()
        finally:
            self.close()

    def _tick(self, *, faults: bool) -> None:
        self.step_no += 1
        if faults:
            if self.backend.down:
                self.backend.down = self.rng.random() < 0.8
            else:
                self.backend.down = self.rng.random() < 0.02
            # Slow spells: most calls are held for ticks, so write-throughs, and the
            # store jobs that wait for them, span steps (a request is preempted,
            # resumes and is aborted while its stores are still unreported).
            slow = self.backend.faults == SLOW_STORE
            if self.rng.random() < (0.8 if slow else 0.03):
                self.backend.faults = SLOW_STORE
            else:
                self.backend.faults = StoreFaults()
        self.backend.advance(self.step_no, everything=not faults)
        for engine in self.engines:
            for rank in engine.ranks:
                if not faults:
                    rank.copies.max_delay = 0
                rank.copies.advance(self.step_no)

    def _act(self, engine: Engine) -> None:
        """Random arrivals, aborts, cache resets, and this step's copy faults."""
        self._in_its_process(engine, self._act_in_process)

    def _in_its_process(self, engine: Engine, work: Callable[[Engine], None]) -> None:
        """Runs `work` as `engine`'s process would; an exception is a violation of
        this step (with its traceback and replay line), not the end of the sweep."""
        try:
            with self._in_process(engine):
                work(engine)
        except Violation:
            raise
        except Exception as e:
            raise Violation(
                f"step {self.step_no}, engine {engine.name}: "
                f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            ) from e

    @staticmethod
    @contextmanager
    def _in_process(engine: Engine) -> Iterator[None]:
        """While open, block hashes are made as `engine`'s own process makes them,
        with the adapter files of its own host."""

        def contents(path: str) -> str:
            if engine.adapter_host is not None:
                return _READ_ADAPTER(str(engine.adapter_host))
            if path not in engine.lora_contents:
                engine.lora_contents[path] = _READ_ADAPTER(path)
            return engine.lora_contents[path]

        with (
            mock.patch.object(lora_identity, "_adapters", engine.lora_keys),
            mock.patch.object(lora_identity, "_contents_of", contents),
            mock.patch.object(lora_identity, "_PROCESS_TOKEN", engine.process_token),
        ):
            yield

    def _act_in_process(self, engine: Engine) -> None:
        rng = self.rng
        self._runtime_event(engine)
        live = [r for r in engine.scheduler.requests.values() if not r.is_finished()]
        if len(live) < 12 and rng.random() < 0.45:
            self._add_request(engine)
        if not self.async_scheduling:
            self._abort_some(engine)
        if rng.random() < 0.01:
            engine.scheduler.reset_prefix_cache()
        # Other traffic takes free device blocks now and then, and most often just
        # after a preemption (the device cache is full then): a preempted request
        # resumes with a load, and one that still has stores in flight resumes
        # waiting for it, the state with the most to undo.
        if rng.random() < (0.5 if engine.preempted else 0.1):
            self._evict_free_device_blocks(engine)
        mode = rng.random()
        failing = (
            set()
            if mode < 0.85
            else {rng.randrange(len(engine.ranks))}
            if mode < 0.93
            else set(range(len(engine.ranks)))
        )
        for r, rank in enumerate(engine.ranks):
            rank.faults.fail_loads = r in failing and rng.random() < 0.5
            rank.faults.fail_stores = r in failing and not rank.faults.fail_loads
            rank.faults.at_layer = rng.randrange(len(self.layers))

    @staticmethod
    def _evict_free_device_blocks(engine: Engine) -> None:
        """Other traffic takes every free device block: a request preempted or
        finished a step ago then finds its prefix on the host (or the store) alone."""
        pool = engine.scheduler.kv_cache_manager.block_pool
        free = [b for b in pool.blocks if b.ref_cnt == 0]
        pool.evict_blocks({b.block_id for b in free if b.block_hash is not None})

    def _abort_some(self, engine: Engine) -> None:
        """Now and then one request is aborted, whatever its state."""
        from vllm.v1.request import RequestStatus

        live = [r for r in engine.scheduler.requests.values() if not r.is_finished()]
        # Requests that wait for a load spanning steps are aborted more often: that
        # state has the most to undo.
        waiting = [r for r in live if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        roll = self.rng.random()
        if waiting and roll < 0.3:
            victim = self.rng.choice(waiting)
        elif live and roll > 0.95:
            victim = self.rng.choice(live)
        else:
            return
        for aborted in engine.scheduler.finish_requests(
            victim.request_id, RequestStatus.FINISHED_ABORTED
        ):
            self._finished(engine, aborted.request_id)

    def _add_request(self, engine: Engine) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        rng = self.rng
        self._next_request += 1
        prefix = rng.choice(self._prefixes)
        suffix = [
            rng.randrange(1, 5000) for _ in range(rng.randrange(1, 2 * BLOCK_SIZE))
        ]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 3 * BLOCK_SIZE),
            extra_args={"kv_transfer_params": self._hints()},
        )
        params.update_from_generation_config({}, self.utils.EOS_TOKEN_ID)
        request_id = f"{engine.name}-{self._next_request}"
        lora = self._adapter_of(engine, request_id)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prefix + suffix,
            sampling_params=params,
            pooling_params=None,
            cache_salt=self._salt(),
            lora_request=lora,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        engine.added.append(request.request_id)
        engine.scheduler.add_request(request)

    def _learn_adapter(self, engine: Engine) -> None:
        """What `engine`'s process works out of the LoRA adapter's files at its first
        block, worked out now, while the files of its host are in place (B's: in
        `Identities.as_b`; A's otherwise)."""
        from types import SimpleNamespace

        from vllm.lora.request import LoRARequest
        from vllm.v1.core import kv_cache_utils

        adapter = self.identities.adapter
        if adapter is None:
            return
        request = SimpleNamespace(
            lora_request=LoRARequest(ADAPTER_NAME, ADAPTER_ID, adapter)
        )
        with self._in_process(engine):
            kv_cache_utils._gen_lora_extra_hash_keys(cast("Request", request))

    def _host_adapter(self, engine: Engine) -> None:
        """`adapter-reloaded`: the engine's host gets its own copy of the adapter's
        files (alike on every host until one is rewritten in place)."""
        if self.identities.kind != "adapter-reloaded":
            return
        assert self.identities.adapter is not None
        engine.adapter_host = self._folder / "hosts" / engine.name
        shutil.copytree(self.identities.adapter, engine.adapter_host)

    def _runtime_event(self, engine: Engine) -> None:
        """The run's runtime event, on its engine from its step on, once
        (`runtime_events.py`)."""
        event = self.event
        if (
            event is None
            or event.engine != engine.name
            or engine.change.fired_at is not None
            or self.step_no < event.step
        ):
            return
        if (
            event.in_flight
            and self.step_no < event.step + IN_FLIGHT_WAIT
            and not any(rank.copies.num_late_loads for rank in engine.ranks)
        ):
            return  # it lands while a load's copy is still to run
        if event.kind == "adapter-reloaded":
            self._reload_adapter(engine)
        elif not self._update_weights(engine, event.mode):
            return  # vLLM's pause waits until the cache can be reset
        engine.change.fired_at = self.step_no

    def _update_weights(self, engine: Engine, mode: str) -> bool:
        """The engine's weights replaced (`reset`: after vLLM's cache reset, as an RL
        loop's pause does it; `prefix-reset`: after a reset of vLLM's prefix cache
        alone; `reload`: alone); False where the reset must wait."""
        stale = None
        if mode in ("reset", "prefix-reset"):
            if not resettable(engine):
                return False
            if engine.pending is not None:  # the pause drains vLLM's batch queue
                self._update(engine, *engine.pending)
                engine.pending = None
                if not resettable(engine):
                    return False
            if not engine.scheduler.reset_prefix_cache(
                reset_running_requests=True, reset_connector=mode == "reset"
            ):
                self._violation(f"engine {engine.name}: the cache reset failed")
        if mode != "reset":
            stale = Stale.at_change(engine, WEIGHTS_MIX, BLOCK_SIZE)
        tell_workers(engine)
        engine.salt ^= WEIGHTS_MIX
        engine.change.stale = stale
        engine.change.sealed_ok = True
        return True

    def _reload_adapter(self, engine: Engine) -> None:
        """The adapter's files rewritten in place on the engine's host, and loaded by
        its workers: the adapter requests in flight compute other values from now
        on, under the hashes they were made with."""
        assert engine.adapter_host is not None
        rewrite_in_place(engine.adapter_host / "adapter_model.safetensors")
        mixed = frozenset(
            req_id
            for req_id, r in engine.scheduler.requests.items()
            if r.lora_request is not None and not r.is_finished()
        )
        change = engine.change
        change.mixed = mixed
        change.reloaded_adapter = True
        change.stale = Stale.at_change(engine, ADAPTER_MIX, BLOCK_SIZE, mixed)
        tell_workers_of_the_adapter(engine)

    def _check_still_shared(self, engine: Engine) -> None:
        """An engine whose weights and files never changed still shares: its store
        is not sealed, its adapter's identity is the one its files give."""
        if not engine.change.sealed_ok:
            tier = engine.tier
            sealed = isinstance(tier.shared, SharedTier) and tier.shared.sealed
            for rank in engine.ranks:
                io = rank.connector.worker.shared.remote_io
                sealed = sealed or (io is not None and io._sealed)
            if sealed:
                self._violation(
                    f"engine {engine.name}: its store is sealed, its weights never "
                    "changed"
                )
        if not engine.change.reloaded_adapter:
            for adapter in engine.lora_keys.values():
                if adapter.identity != adapter.first_seen:
                    self._violation(
                        f"engine {engine.name}: its adapter's identity changed, its "
                        "files never did"
                    )

    def _salt(self) -> str | None:
        """A request's `cache_salt`: mostly none, two tenants, and a client that
        mints a new one for each request (as many tenants as requests, retains among
        them)."""
        salt = self.rng.choice([None, None, None, "tenant-1", "tenant-2", "minted"])
        return f"minted-{self._next_request}" if salt == "minted" else salt

    def _adapter_of(self, engine: Engine, request_id: str) -> Any:
        """The LoRA adapter of a new request (`lora-retrained`: half of them), told to
        the oracle: B's host holds other files under the adapter's path."""
        from vllm.lora.request import LoRARequest

        adapter = self.identities.adapter
        if adapter is None or self.rng.random() < 0.5:
            return None
        files = 1
        if engine.name == "B" and self.identities.kind == "lora-retrained":
            files = ADAPTER_B
        elif engine.change.reloaded_adapter:
            files = ADAPTER_RELOADED
        self.oracle.set_adapter(request_id, files)
        return LoRARequest(ADAPTER_NAME, ADAPTER_ID, adapter)

    def _hints(self) -> dict[str, Any]:
        """A request's hints: none mostly; retains that expire within the run or
        outlive it, sessions that end, caps on what is stored."""
        rng = self.rng
        draw = rng.random()
        if draw < 0.25:
            return {"retain": rng.choice([0.02, 0.2, 600])}
        if draw < 0.35:
            return {"done": True}
        if draw < 0.45:
            return {"max_offload_tokens": rng.choice([0, BLOCK_SIZE, 3 * BLOCK_SIZE])}
        return {}

    def _finished(self, engine: Engine, req_id: str) -> None:
        engine.finished[req_id] = engine.finished.get(req_id, 0) + 1
        if engine.finished[req_id] > 1:
            self._violation(f"{req_id} finished twice")

    def _step(self, engine: Engine) -> None:
        self._in_its_process(engine, self._step_or_raise)

    def _step_or_raise(self, engine: Engine) -> None:
        scheduler = engine.scheduler
        out = scheduler.schedule()
        engine.preempted = bool(out.preempted_req_ids)
        for req_id in out.num_scheduled_tokens:
            request = scheduler.requests[req_id]
            self.oracle.note_blocks(req_id, request.all_token_ids, request.block_hashes)
        model_output = self._execute(engine, out)
        if not self.async_scheduling:
            self._update(engine, out, model_output)
            return
        # vLLM's batch queue: this step is scheduled and executed before the last
        # one's output is taken, and aborts that came meanwhile go first.
        self._abort_some(engine)
        if engine.pending is not None:
            self._update(engine, *engine.pending)
        engine.pending = (out, model_output)
        if not out.total_num_scheduled_tokens:
            # Nothing ran: vLLM waits for this output rather than schedule more.
            engine.pending = None
            self._update(engine, out, model_output)

    def _execute(self, engine: Engine, out: Any) -> Any:
        """Every rank runs the step; returns the output vLLM's aggregator joins."""
        from vllm.v1.outputs import KVConnectorOutput

        meta = out.kv_connector_metadata
        wrong: list[set[int]] = []
        slots = self._step_slots(engine, out.num_scheduled_tokens)
        for rank in engine.ranks:
            w = rank.connector
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            for layer in self.layers:
                w.wait_for_layer_load(layer)
            # Checks every slot the step reads as computed; writes the computed ones.
            wrong.append(
                set()
                if slots is None
                else kv_check.forward(
                    self.oracle, rank.kv, self.groups, rank.heads, slots, BLOCK_SIZE
                )
            )
            for layer in self.layers:
                w.save_kv_layer(layer, rank.kv[layer], None)
            w.wait_for_save()
        self._settle(engine)
        sampled = self._sample(engine, out.num_scheduled_tokens)
        outputs = []
        invalid: set[int] = set()
        for rank in engine.ranks:
            w = rank.connector
            # As vLLM's model runner asks: a failed load of several KV cache groups
            # comes back as a whole request in `failed_recving`.
            results = w.get_transfer_results(set(out.finished_req_ids))
            errors = w.get_block_ids_with_load_errors()
            invalid |= errors
            report = w.build_connector_worker_meta()
            w.clear_connector_metadata()
            kv_output = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=errors,
                kv_connector_worker_meta=report,
            )
            outputs.append(self._model_output(sampled, kv_output))
        self._settle(engine)
        if engine.pending is not None:
            # Async scheduling: this step was scheduled before vLLM took the last
            # step's failed loads; their blocks are still to be recomputed.
            invalid |= engine.pending[1].kv_connector_output.invalid_block_ids
        for r, blocks in enumerate(wrong):
            if not blocks <= invalid:
                self._violation(
                    f"engine {engine.name} rank {r}: wrong KV in device blocks "
                    f"{sorted(blocks - invalid)} that vLLM was not told to recompute"
                )
        return engine.aggregator.aggregate(outputs)

    def _update(self, engine: Engine, out: Any, model_output: Any) -> None:
        results = engine.scheduler.update_from_output(out, model_output)
        for client_outputs in results.values():
            for o in client_outputs.outputs:
                if o.finish_reason is not None:
                    self._finished(engine, o.request_id)
        engine.tier.pool.check_invariants()
        engine.tier.retention.check_invariants()

    def _tokens(self, engine: Engine, request: Any) -> list[int]:
        """The request's tokens as the workers know them (see `Engine.tokens`)."""
        tokens = engine.tokens.setdefault(request.request_id, [])
        known = request.all_token_ids
        if len(known) > len(tokens):
            tokens.extend(known[len(tokens) :])
        return tokens

    def _sample(
        self, engine: Engine, scheduled: dict[str, int]
    ) -> dict[str, list[int]]:
        """A request that ends its prompt or decodes samples a token that its prefix
        determines, and the workers' view of its tokens grows by it; a prefill chunk
        samples nothing (vLLM's model runner discards it). A chunk is a prefill chunk
        as vLLM's scheduler marked it: a request recomputed after a preemption or a
        failed load is one until it passes its output tokens, not just its prompt."""
        sampled: dict[str, list[int]] = {}
        for req_id in scheduled:
            request = engine.scheduler.requests[req_id]
            tokens = self._tokens(engine, request)
            end = request.num_computed_tokens
            if request.is_prefill_chunk:
                sampled[req_id] = []
                continue
            values = self.oracle.prefix_values(req_id, tokens[:end])
            token = next_token(values, end)
            if end == len(tokens):
                tokens.append(token)
            sampled[req_id] = [token]
        return sampled

    @staticmethod
    def _model_output(sampled: dict[str, list[int]], kv_output: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(sampled)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv_output,
        )

    def _step_slots(
        self, engine: Engine, scheduled: dict[str, int]
    ) -> kv_check.StepSlots | None:
        """The slots the step reads and writes, for every rank (`kv_check.py`)."""
        manager = engine.scheduler.kv_cache_manager
        requests = []
        for req_id, count in scheduled.items():
            request = engine.scheduler.requests[req_id]
            salt = engine.salt ^ engine.change.mix_of(req_id)
            tokens = self._tokens(engine, request)
            blocks = manager.get_block_ids(req_id)
            requests.append((request, count, tokens, salt, blocks))
        return kv_check.StepSlots.of(
            self.oracle, BLOCK_SIZE, len(self.groups), requests, engine.change
        )

    def _settle(self, engine: Engine) -> None:
        """Waits until each rank's store thread is idle or held in a call: what the
        workers see next then depends on the seed alone."""
        for rank in engine.ranks:
            io = rank.connector.worker.shared.remote_io
            if io is None:
                continue
            store = io.store
            deadline = time.monotonic() + SETTLE_S
            while not _settled(io, store):
                if time.monotonic() > deadline:
                    raise Violation(
                        f"step {self.step_no}: a store thread never settled"
                    )
            if isinstance(store, SimMooncakeStore):
                problem = store.check_registrations(io.registered_spans())
                if problem is not None:
                    self._violation(problem)

    def _quiesce(self) -> None:
        """Faults off, every late call and copy run: requests finish, and nothing is
        left behind."""
        self.backend.down = False
        self.backend.faults = StoreFaults(0, 0, 0, 0, 0)
        for engine in self.engines:
            for rank in engine.ranks:
                rank.faults.fail_loads = rank.faults.fail_stores = False
        for _ in range(600):
            self._tick(faults=False)
            for engine in self.engines:
                # An event that waited for a reset.
                self._in_its_process(engine, self._runtime_event)
                self._step(engine)
                self._check_violations()
            if not any(self._busy(e) for e in self.engines) and self._event_done():
                break
        for engine in self.engines:
            self._check_empty(engine)
            self._check_still_shared(engine)
        self._check_violations()
        if self.backend.num_pending():
            raise Violation("store calls left at quiescence")

    def _event_done(self) -> bool:
        event = self.event
        return event is None or all(
            e.change.fired_at is not None
            for e in self.engines
            if e.name == event.engine
        )

    @property
    def shape(self) -> str:
        """The engines' TP sizes and the KV's kind, e.g. `A tp 2, A2 tp 4, B tp 2`."""
        sizes = ", ".join(f"{e.name} tp {len(e.ranks)}" for e in self.engines)
        kv = ", replicated KV" if self.replicated else ""
        event = self.event
        if event is not None:
            return (
                f"{sizes}{kv}, {event.kind} on {event.engine} ({event.mode}) at "
                f"step {event.step}"
            )
        return f"{sizes}{kv}, B differs by {self.identities.kind}"

    def summary(self) -> str:
        """What the run exercised, summed over the engines, and the store values each
        engine got from another's puts."""
        total: dict[str, int] = {}
        for engine in self.engines:
            stats = engine.tier.stats
            for name in (
                "hit_tokens",
                "async_hit_tokens",
                "remote_hit_tokens",
                "preempted_requests",
                "failed_loads",
                "failed_stores",
                "remote_missed_blocks",
                "retained_hit_blocks",
                "retains_expired_unread",
            ):
                total[name] = total.get(name, 0) + int(getattr(stats, name))
            total["requests"] = total.get("requests", 0) + len(engine.added)
        for engine in self.engines:
            if engine.change.fired_at is not None:
                total[f"{engine.name} changed at step"] = engine.change.fired_at
        reads = self.backend.cross_reads
        total |= {f"values {w}->{r}": n for (w, r), n in sorted(reads.items())}
        return ", ".join(f"{k} {v}" for k, v in total.items())

    def _busy(self, engine: Engine) -> bool:
        tier = engine.tier
        return bool(
            engine.pending is not None
            or engine.scheduler.requests
            # vLLM hands finished ids to the workers in its next step.
            or engine.scheduler.finished_req_ids
            or tier.num_jobs_in_flight
            or tier.shared.num_held_writes
            or any(rank.copies.num_late for rank in engine.ranks)
        )

    def _check_empty(self, engine: Engine) -> None:
        where = f"engine {engine.name} at quiescence"
        try:
            self.utils.assert_scheduler_empty(engine.scheduler)
        except AssertionError as e:
            raise Violation(f"{where}: vLLM's scheduler is not empty: {e}") from e
        tier = engine.tier
        left = {
            "jobs": tier.num_jobs_in_flight,
            # Retained blocks stay pinned by design until read or expired.
            "pinned": tier.pool.num_pinned - tier.retention.num_pinned,
            "storing": tier.pool.num_storing,
            "held writes": tier.shared.num_held_writes,
        }
        for r, rank in enumerate(engine.ranks):
            w = rank.connector.worker
            left[f"rank {r} worker books"] = w.shared.num_jobs_in_flight + sum(
                map(
                    len,
                    (
                        w._store_req,
                        +w._stores_in_flight,
                        w._awaiting_free,
                        w._async_req,
                    ),
                )
            )
            io = w.shared.remote_io
            if io is not None and not io.wait_idle(SETTLE_S):
                left[f"rank {r} store thread busy"] = 1
        # Once every retain ends, nothing pins a block.
        tier.retention.release_all()
        left["pinned once retains end"] = tier.pool.num_pinned
        if self.drafter:
            # A tier whose loads leave the drafter group out (vLLM then recomputes
            # it, or reads wrong drafter slots, which the oracle sees) shows here.
            # The counts may differ: the pool evicts each group's blocks apart, and
            # a load of several groups that misses one fails whole. A load planned
            # short of a group's block (no host block for it: no room, or the
            # admission policy refused it) loads nothing and counts nothing; one
            # that fails after its plan (a fetch that did not arrive, a copy fault)
            # counts every group's blocks.
            loaded = tier.stats.loaded_by_group
            left["model blocks loaded, no drafter block"] = (
                loaded[0] > 0 and loaded[1] == 0
            )
        leaks = {k: v for k, v in left.items() if v}
        if leaks:
            raise Violation(f"{where}: left behind {leaks}")
        never = [r for r in engine.added if engine.finished.get(r, 0) != 1]
        if never:
            raise Violation(f"{where}: requests not finished exactly once: {never[:5]}")

    def close(self) -> None:
        self.backend.down = False
        self.backend.advance(self.step_no + 1, everything=True)
        # Closing after a violation: whatever state it left, close the rest.
        for engine in self.engines:
            for rank in engine.ranks:
                with contextlib.suppress(Exception):
                    rank.connector.shutdown()
            with contextlib.suppress(Exception):
                engine.scheduler.connector.shutdown()
        self.backend.close()
        BACKENDS.pop(self.name, None)
        shutil.rmtree(self._folder, ignore_errors=True)


def _heads_of(shards: Any) -> tuple[int, ...]:
    """The oracle's value index of each KV head a worker holds (`Oracle.slot_value`):
    the global head of each per-head value, 0 for replicated KV (every rank computes
    the same), the TP rank for a per-rank value; as `oracle.head_of` reads its shard
    names."""
    return tuple(head_of(name) for name in shards.names)


def _settled(io: Any, store: Any) -> bool:
    """Whether a worker's store traffic waits for nothing but a later tick."""
    if isinstance(store, SimMooncakeStore):
        # Its worker waits out a held call's timeout, then the adapter's thread
        # holds it or is idle.
        return io.wait_idle(0.001) and store.settled()
    return io.wait_idle(0.001) or (isinstance(store, SimStore) and store.blocked)


def replay_line(seed: int, steps: int, tp: int) -> str:
    return f"python -m tests.simulation --seed {seed} --steps {steps} --tp {tp}"
