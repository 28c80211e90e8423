"""Can one default hold on every workload? A study of a policy that follows the best of
the anchors, measured against them in the hit-rate table.

`DuelPolicy` runs one of LRU, ARC, LIRS and S3-FIFO on the pool, and beside it one
small shadow pool per candidate, each fed the same spatial hash sample of the keys (1 in
`modulus`, at 1/`modulus` of the capacity, as SHARDS does), counting per-key hits with
exponential decay. When another candidate's shadow leads the one in charge by more than
sampling noise (two standard deviations) after a dwell of 2x the capacity in block
uses, the pool switches: the blocks move to a fresh policy of the leader in the old
one's victim order, oldest first (O(C) per switch, O(1) per block amortised over the
dwell). A study, not a built-in: the study runs it through an import path.

`RequestDuelPolicy` is the same duel between LIRS and LRU with shadows that count prefix
hits; the harness hands it each request (`request-duel`, `request-duel-lru`,
`request-duel-fast`, `request-duel3` in `--policies`). The other candidates (LIRS with
other HIR shares, adapted as CLOCK-Pro does or balanced as ARC does) run by import
path, `default_study:LIRS10Policy` and so on.

Usage: python benchmarks/default_study.py [hit_rate_table.py arguments]
           # runs the table with `default_study:DuelPolicy` added
       python benchmarks/default_study.py --shortfalls RESULT.json ...
           # each policy's shortfall against the best anchor, cell by cell
"""

from __future__ import annotations

import json
import math
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from hit_rate_table import ANCHORS  # noqa: E402

from vllm_cpu_offload.scheduler.block_pool import HostBlockPool  # noqa: E402
from vllm_cpu_offload.scheduler.policies import (  # noqa: E402
    BlockKey,
    BlockState,
    EvictionPolicy,
    HostBlock,
)
from vllm_cpu_offload.scheduler.policies.lirs import _HIR, _LIR, LIRSPolicy  # noqa: E402
from vllm_cpu_offload.scheduler.policies.registry import make_policy  # noqa: E402

CANDIDATES = ANCHORS  # the duel follows the anchors


class DuelPolicy(EvictionPolicy):
    """Follows the candidate whose sampled shadow hits most (module docstring)."""

    name = "duel"
    candidates: tuple[str, ...] = CANDIDATES
    shadow_blocks = 1024
    start = "lru"
    dwell = 2.0  # block uses between switches, in pool capacities

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        modulus = 1
        while num_blocks // (modulus * 2) >= self.shadow_blocks:
            modulus *= 2
        self.modulus = modulus
        cap = max(1, num_blocks // modulus)
        self._shadows = [
            HostBlockPool(cap, make_policy(name, cap), record_events=False)
            for name in self.candidates
        ]
        self._hits = [0.0] * len(self.candidates)
        self._current = self.candidates.index(self.start)
        self.inner = make_policy(self.start, num_blocks)
        self._resident: set[HostBlock] = set()
        self._uses = 0
        self._since_switch = 0
        self._half_life = 4 * cap
        self.switches = 0

    # ----- the sample -----

    def _observe(self, key: BlockKey) -> None:
        h = hash(key)
        if h & (self.modulus - 1):
            return
        keys = [h]
        for i, shadow in enumerate(self._shadows):
            if shadow.count_hits(keys):
                self._hits[i] += 1
            else:
                allocated = shadow.allocate_for_store(keys, None)
                if allocated:
                    shadow.complete_store(keys, True)
        self._uses += 1
        if self._uses % self._half_life == 0:
            self._hits = [hits / 2 for hits in self._hits]

    def _maybe_switch(self) -> None:
        if self._since_switch < self.dwell * self.num_blocks:
            return
        hits = self._hits
        best = max(range(len(hits)), key=hits.__getitem__)
        lead = hits[best] - hits[self._current]
        if best == self._current or lead <= 2.0 * math.sqrt(
            hits[best] + hits[self._current]
        ):
            return
        self._switch(best)

    def _switch(self, to: int) -> None:
        old = self.inner
        order = []
        while (victim := old.pop_victim()) is not None:
            order.append(victim)
        # Pinned, storing or parked blocks: not in the victim order, so the newest.
        listed = set(order)
        order += [b for b in self._resident if b not in listed]
        new = make_policy(self.candidates[to], self.num_blocks)
        for block in order:
            block.segment = block.stamp = 0
            if block.owner is not None:
                block.owner.remove(block)
            new.on_insert([block])
            if block.state is BlockState.READY:
                new.on_ready([block])
                if block.pin_count:
                    new.on_pin(block)
        self.inner = new
        self._current = to
        self._since_switch = 0
        self.switches += 1

    # ----- hooks: the sample, then the policy in charge -----

    def admit(self, key: BlockKey) -> bool:
        admitted = self.inner.admit(key)
        if not admitted:
            self._observe(key)
        return admitted

    def on_declined(self, key: BlockKey) -> None:
        self._observe(key)
        self.inner.on_declined(key)

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        for block in blocks:
            self._observe(block.key)
        self._resident.update(blocks)
        self._since_switch += len(blocks)
        self.inner.on_insert(blocks)

    def on_ready(self, blocks: Sequence[HostBlock]) -> None:
        self.inner.on_ready(blocks)

    def on_access(self, blocks: Sequence[HostBlock]) -> None:
        for block in blocks:
            self._observe(block.key)
        self._since_switch += len(blocks)
        self.inner.on_access(blocks)
        self._maybe_switch()

    def on_pin(self, block: HostBlock) -> None:
        self.inner.on_pin(block)

    def on_unpin(self, block: HostBlock) -> None:
        self.inner.on_unpin(block)

    def on_remove(self, block: HostBlock) -> None:
        self._resident.discard(block)
        self.inner.on_remove(block)

    def pop_victim(self) -> HostBlock | None:
        victim = self.inner.pop_victim()
        if victim is not None:
            self._resident.discard(victim)
        return victim

    def on_orphaned(self, block: HostBlock) -> None:
        self.inner.on_orphaned(block)

    def on_leaf(self, block: HostBlock) -> None:
        self.inner.on_leaf(block)

    def reset(self) -> None:
        self.inner.reset()


class DuelFromLIRSPolicy(DuelPolicy):
    """The duel, starting from LIRS (the best anchor in most cells of the table) and
    switching after a dwell of one capacity."""

    name = "duel_lirs"
    start = "lirs"
    dwell = 1.0


class LIRSOrLRUPolicy(DuelFromLIRSPolicy):
    """The LIRS-started duel with only LRU beside it: the anchors that are best in 44
    of the table's 56 cells."""

    name = "lirs_or_lru"
    candidates = ("lirs", "lru")


class RequestDuelPolicy(DuelPolicy):
    """The LIRS/LRU duel with shadows that count prefix hits. Each request's keys are
    sampled by hash (1 in M), and the sampled keys, in chain order, are a request to
    each shadow: a host tier of C/M blocks that serves it as the pool does, given how
    many of them the device holds. A prefix that hits in the pool has its sampled keys
    hit in the shadow, so the shadow's prefix hits estimate the pool's, 1 in M. The
    pool's interface does not show a policy its lookups, so `RequestDuelTier` hands
    each request over; a built-in would need a pool hook for that (the keys and the
    device hit count, O(1) per block)."""

    name = "request_duel"
    candidates = ("lirs", "lru")
    start = "lirs"
    dwell = 0.5

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        from trace_replay import OurTier

        cap = max(1, num_blocks // self.modulus)
        self._tiers = [OurTier(name, cap) for name in self.candidates]
        self._shadows = []
        self._half_life = 4 * cap

    def _observe(self, key: BlockKey) -> None:
        pass

    def observe_request(
        self, index: int, keys: Sequence[int], device_hits: int
    ) -> None:
        mask = self.modulus - 1
        sampled = [key for key in keys if not hash(key) & mask]
        if not sampled:
            return
        on_device = sum(1 for key in keys[:device_hits] if not hash(key) & mask)
        for i, tier in enumerate(self._tiers):
            self._hits[i] += tier.serve(index, sampled, on_device)
        before = self._uses
        self._uses += len(sampled) - on_device
        if self._uses // self._half_life > before // self._half_life:
            self._hits = [hits / 2 for hits in self._hits]


class FastRequestDuelPolicy(RequestDuelPolicy):
    """The prefix-hit duel from LIRS, deciding faster: a dwell of a quarter of the
    capacity, and hit counts halved every 2 shadow capacities of sampled uses."""

    name = "request_duel_fast"
    dwell = 0.25

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._half_life = max(1, 2 * (num_blocks // self.modulus))


class RequestDuelFromLRUPolicy(RequestDuelPolicy):
    """The prefix-hit duel, starting from LRU."""

    name = "request_duel_lru"
    start = "lru"


class ThreeWayRequestDuelPolicy(RequestDuelPolicy):
    """The prefix-hit duel with S3-FIFO as a third candidate, from LRU."""

    name = "request_duel3"
    candidates = ("lirs", "lru", "s3fifo")
    start = "lru"


class AdaptiveLIRSPolicy(LIRSPolicy):
    """LIRS whose share of resident HIR blocks adapts as CLOCK-Pro's does.

    A HIR block's test period is its time in S. A new key recalled from the history
    (a non-resident HIR block reused within its test period: a larger HIR share would
    have kept it) raises the HIR target by one block; a HIR block whose test period
    ends unused (evicted outside S, or its history entry dropped) lowers it by one.
    The target stays between `min_hir_fraction` of the pool and all but one block.
    O(1) per event: a change of one block demotes at most one LIR block.
    """

    name = "lirs_adaptive"

    def __init__(self, num_blocks: int, min_hir_fraction: float = 0.01) -> None:
        super().__init__(num_blocks, hir_fraction=min_hir_fraction)
        self._min_hir = max(1, int(num_blocks * min_hir_fraction))
        self.hir_target = self._min_hir

    def _move_target(self, delta: int) -> None:
        target = min(max(self.hir_target + delta, self._min_hir), self.num_blocks - 1)
        self.hir_target = target
        self.lir_cap = max(1, self.num_blocks - target)

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        bottom, history = self._bottom(), self._history
        recalled = 0
        for block in blocks:
            last = history.get(hash(block.key))
            if last is not None and last > bottom:
                recalled += 1
        if recalled:
            self._move_target(recalled)
        super().on_insert(blocks)

    def pop_victim(self) -> HostBlock | None:
        head = self._queue.head
        expired = head is not None and head.stamp <= self._bottom()
        victim = super().pop_victim()
        if expired:
            self._move_target(-1)
        return victim

    def _remember(self, key_hash: int, stamp: int) -> None:
        before = len(self._history) + (key_hash not in self._history)
        super()._remember(key_hash, stamp)
        dropped = before - len(self._history)
        if dropped:
            self._move_target(-dropped)


class LIRS10Policy(LIRSPolicy):
    """LIRS with 10% of the pool for resident HIR blocks (the anchor keeps 1%)."""

    name = "lirs10"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, hir_fraction=0.10)


class LIRS25Policy(LIRSPolicy):
    """LIRS with 25% of the pool for resident HIR blocks."""

    name = "lirs25"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, hir_fraction=0.25)


class LIRS50Policy(LIRSPolicy):
    """LIRS with half the pool for resident HIR blocks."""

    name = "lirs50"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, hir_fraction=0.5)


_DEMOTED = 3  # a resident HIR block that was LIR (LIRSPolicy treats it as HIR)


class BalancedLIRSPolicy(LIRSPolicy):
    """LIRS whose HIR share moves as ARC's target does, between two ghost lists.

    H1 is LIRS's own history of non-resident HIR blocks in S: a new key found there
    would have hit with more room for HIR blocks, so the HIR target grows by
    max(1, |H2| / |H1|). H2 remembers blocks that were LIR, were demoted and then
    evicted: a new key found there would have hit with a larger LIR set, so the
    target shrinks by max(1, |H1| / |H2|). H2 is bounded at the pool's capacity. New
    blocks enter as LIR only while the pool fills for the first time. O(1) per block.
    """

    name = "lirs_balanced"

    def __init__(self, num_blocks: int, min_hir_fraction: float = 0.01) -> None:
        super().__init__(num_blocks, hir_fraction=min_hir_fraction)
        self._min_hir = max(1, int(num_blocks * min_hir_fraction))
        self.hir_target = float(self._min_hir)
        self._demoted: OrderedDict[int, None] = OrderedDict()
        self._filled = False

    def _move_target(self, delta: float) -> None:
        top = self.num_blocks - 1
        self.hir_target = min(max(self.hir_target + delta, self._min_hir), top)
        self.lir_cap = max(1, self.num_blocks - int(self.hir_target))

    def on_insert(self, blocks: Sequence[HostBlock]) -> None:
        history, demoted = self._history, self._demoted
        bottom = self._bottom()
        clock = self._clock
        for block in reversed(blocks):
            clock += 1
            h = hash(block.key)
            last = history.pop(h, None)
            block.stamp = clock
            if last is not None and last > bottom:
                self._move_target(max(1.0, len(demoted) / max(1, len(history))))
                block.segment = _LIR
                self.num_lir += 1
                continue
            if h in demoted:
                del demoted[h]
                self._move_target(-max(1.0, len(history) / max(1, len(demoted))))
            if not self._filled and self.num_lir < self.lir_cap:
                block.segment = _LIR
                self.num_lir += 1
            else:
                block.segment = _HIR
                self._hir_storing += 1
        self._clock = clock
        self._demote()

    def _demote(self) -> None:
        lir, queue = self._lir, self._queue
        while self.num_lir > self.lir_cap:
            oldest = lir.popleft()
            if oldest is None:
                return
            oldest.segment = _DEMOTED
            self.num_lir -= 1
            queue.append(oldest)

    def pop_victim(self) -> HostBlock | None:
        self._filled = True
        head = self._queue.head
        was_lir = head is not None and head.segment == _DEMOTED
        victim = super().pop_victim()
        if was_lir and victim is not None:
            demoted = self._demoted
            demoted[hash(victim.key)] = None
            if len(demoted) > self.num_blocks:
                demoted.popitem(last=False)
        return victim

    def reset(self) -> None:
        super().reset()
        self._demoted.clear()


def shortfalls(paths: list[Path]) -> None:
    """From hit-rate table JSON files: for each policy, in how many cells (workload x
    capacity with a gap to close) it is within 1 point of the best anchor, its worst
    and mean shortfall in points of the gap, and on the conversation trace from 8,000
    blocks up, the share of oracle-admit's gain it reaches."""
    cells: dict[tuple[str, int], dict[str, float]] = {}
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            if row["gap_closed"] is not None:
                key = (row["workload"], row["host_blocks"])
                cells.setdefault(key, {})[row["policy"]] = 100 * row["gap_closed"]
    policies = list(dict.fromkeys(p for cell in cells.values() for p in cell))
    print(f"{len(cells)} cells with a gap; shortfall = best anchor - policy, points")
    print("below LRU: cells where the policy closes under -1% of the gap")
    print(
        f"{'policy':<36} {'within 1':>9} {'worst':>7} {'mean':>6} {'below LRU':>9} "
        f"{'mean gap':>8}  worst cell"
    )
    for name in policies:
        falls = []
        for key, cell in cells.items():
            best = max(cell[a] for a in ANCHORS if a in cell)
            if name in cell:
                falls.append((best - cell[name], key))
        within = sum(fall <= 1.0 for fall, _ in falls)
        worst = max(falls)
        mean = sum(fall for fall, _ in falls) / len(falls)
        closed = [cell[name] for cell in cells.values() if name in cell]
        below = sum(gap < -1.0 for gap in closed)
        print(
            f"{name:<36} {within:>4}/{len(falls):<4} {worst[0]:>7.1f} {mean:>6.1f} "
            f"{below:>9} {sum(closed) / len(closed):>8.1f}  {worst[1][0]} "
            f"{worst[1][1]}"
        )
    print("conversation, 8,000 blocks and up: gap closed / oracle-admit's")
    for key, cell in sorted(cells.items()):
        if key[0] == "conversation" and key[1] >= 8000 and "oracle-admit" in cell:
            shares = "  ".join(
                f"{name}={cell[name] / cell['oracle-admit']:.2f}"
                for name in policies
                if name in cell and name not in ("belady", "oracle-admit")
            )
            print(f"  {key[1]:>6}: {shares}")


def _request_duel_tiers() -> None:
    """Makes hit_rate_table build `RequestDuelTier`s for "request-duel"."""
    import hit_rate_table
    from trace_replay import OurTier

    class RequestDuelTier(OurTier):
        policy_class: type[RequestDuelPolicy] = RequestDuelPolicy

        def __init__(self, capacity: int) -> None:
            self.policy = self.policy_class(capacity)
            self.pool = HostBlockPool(capacity, self.policy, record_events=False)

        def serve(self, index: int, keys: Sequence[int], gpu_hits: int) -> int:
            self.policy.observe_request(index, keys, gpu_hits)
            return super().serve(index, keys, gpu_hits)

    class RequestDuelFromLRUTier(RequestDuelTier):
        policy_class = RequestDuelFromLRUPolicy

    class FastRequestDuelTier(RequestDuelTier):
        policy_class = FastRequestDuelPolicy

    class ThreeWayRequestDuelTier(RequestDuelTier):
        policy_class = ThreeWayRequestDuelPolicy

    make_tier = hit_rate_table.tier_factory

    def tier_factory(name: str, upcoming: list[list[int]]):  # type: ignore[no-untyped-def]
        if name == "request-duel":
            return RequestDuelTier
        if name == "request-duel-lru":
            return RequestDuelFromLRUTier
        if name == "request-duel-fast":
            return FastRequestDuelTier
        if name == "request-duel3":
            return ThreeWayRequestDuelTier
        return make_tier(name, upcoming)

    hit_rate_table.tier_factory = tier_factory


if __name__ == "__main__":
    import hit_rate_table

    _request_duel_tiers()

    if sys.argv[1:2] == ["--shortfalls"]:
        shortfalls([Path(arg) for arg in sys.argv[2:]])
        sys.exit()
    if "--policies" not in sys.argv:
        sys.argv += ["--policies", *hit_rate_table.POLICIES, "default_study:DuelPolicy"]
    hit_rate_table.main()
