"""A property-based state machine for HostBlockPool under every policy.

Random lookups, store allocations, store completions (success and failure), loads
(pin/unpin), resets, and evictions under pressure, checked against a model after every
step: the pool holds exactly the keys the model holds, in the same states; a pinned or
storing block is never evicted; lookups return the longest READY prefix, and a block
held through a reset is never seen again; the capacity
bound holds; and `check_invariants` passes. For the chain-aware policy, every victim is
checked when it is chosen: an orphan goes before any other block, and a block with
children in the pool is never a victim unless it is an orphan itself, so eviction never
makes an orphan.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_cpu_offload.scheduler.block_pool import BlockKey, BlockState, HostBlockPool
from vllm_cpu_offload.scheduler.policies import HostBlock
from vllm_cpu_offload.scheduler.policies.registry import POLICY_NAMES, make_policy

# few keys: chains overlap and keys return
KEYS = st.integers(min_value=0, max_value=23)
CHAINS = st.lists(KEYS, min_size=1, max_size=6, unique=True)


class PoolMachine(RuleBasedStateMachine):
    policy_name = "lru"
    # whether victims must respect chains (orphans first, leaves only)
    chain_aware = False

    def __init__(self) -> None:
        super().__init__()
        self.num_blocks = 8
        policy = make_policy(self.policy_name, 8)
        self.pool = HostBlockPool(self.num_blocks, policy)
        self.state: dict[BlockKey, BlockState] = {}  # the model: key -> state
        # Keys held through a reset: never visible to lookups again (STORING to
        # `state_of`), whatever their state; a store of their key frees them once no
        # load or store uses them.
        self.stale: set[BlockKey] = set()
        self.pins: dict[BlockKey, int] = {}  # key -> loads in flight
        self.block_ids: dict[BlockKey, int] = {}
        self.victims = 0
        choose = policy.pop_victim

        def checked_pop_victim() -> HostBlock | None:
            victim = choose()
            if victim is not None:
                self._check_victim(victim)
            return victim

        policy.pop_victim = checked_pop_victim  # type: ignore[method-assign]

    def _check_victim(self, victim: HostBlock) -> None:
        """Runs when the policy has chosen, before the pool frees the victim."""
        self.victims += 1
        assert victim.evictable, f"victim {victim} is pinned or storing"
        if not self.chain_aware:
            return
        held = list(self.pool._by_key.values())
        if not victim.orphan:
            assert victim.num_children == 0, (
                f"evicting {victim} would orphan its children"
            )
            waiting = [b for b in held if b.orphan and b.evictable and b is not victim]
            assert not waiting, f"kept orphans {waiting} and evicted {victim}"

    # ----- helpers -----

    def _apply_events(self) -> None:
        for event in self.pool.take_events():
            for key in event.keys:
                if event.kind == "evicted":
                    assert self.state.get(key) is BlockState.READY, (
                        f"evicted {key} not READY"
                    )
                    assert self.pins.get(key, 0) == 0, f"evicted pinned {key}"
                    self._forget(key)
                else:
                    assert self.state.get(key) is BlockState.STORING
                    self.state[key] = BlockState.READY

    def _forget(self, key: BlockKey) -> None:
        del self.state[key]
        del self.block_ids[key]
        self.stale.discard(key)

    def _completed(self, keys: list[int], success: bool) -> None:
        """The model after `complete_store(keys, success)`: a failed store frees its
        blocks; a store begun before a reset makes them READY, invisible, untold; the
        others are READY (its event)."""
        for key in keys:
            if not success:
                self._forget(key)
            elif key in self.stale:
                self.state[key] = BlockState.READY
        self._apply_events()

    def _keys_in(self, state: BlockState) -> list[int]:
        return sorted(
            k for k, s in self.state.items() if s is state and isinstance(k, int)
        )

    # ----- rules -----

    @rule(chain=CHAINS, parent=st.one_of(st.none(), KEYS))
    def allocate(self, chain: list[int], parent: int | None) -> None:
        if parent in chain:
            parent = None
        # Blocks held through a reset that nothing uses are freed and stored anew.
        held_before = {
            k
            for k in chain
            if k in self.state
            and not (
                k in self.stale
                and self.state[k] is BlockState.READY
                and k not in self.pins
            )
        }
        allocated = self.pool.allocate_for_store(chain, parent)
        self._apply_events()
        got = [k for k, _ in allocated]
        assert set(got).isdisjoint(held_before), "allocated a key already held"
        assert got == [k for k in chain if k in got], "allocation out of chain order"
        for key, block_id in allocated:
            assert block_id not in self.block_ids.values(), "block id handed out twice"
            self.state[key] = BlockState.STORING
            self.block_ids[key] = block_id

    @precondition(lambda self: self._keys_in(BlockState.STORING))
    @rule(data=st.data(), success=st.booleans())
    def complete(self, data: st.DataObject, success: bool) -> None:
        storing = self._keys_in(BlockState.STORING)
        keys = data.draw(st.lists(st.sampled_from(storing), min_size=1, unique=True))
        self.pool.complete_store(keys, success)
        self._completed(keys, success)

    @rule(keys=CHAINS)
    def lookup(self, keys: list[int]) -> None:
        expected = 0
        for key in keys:
            if self.state.get(key) is not BlockState.READY or key in self.stale:
                break
            expected += 1
        assert self.pool.count_hits(keys) == expected

    @rule(keys=CHAINS)
    def touch(self, keys: list[int]) -> None:
        self.pool.touch(keys)

    @precondition(lambda self: self._keys_in(BlockState.READY))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        ready = self._keys_in(BlockState.READY)
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        assert self.pool.pin(keys) == [self.block_ids[k] for k in keys]
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pinned = sorted(k for k in self.pins if isinstance(k, int))
        keys = data.draw(st.lists(st.sampled_from(pinned), min_size=1, unique=True))
        self.pool.unpin(keys)
        for key in keys:
            self.pins[key] -= 1
            if not self.pins[key]:
                del self.pins[key]

    @rule()
    def reset(self) -> None:
        dropped = self.pool.reset()
        expected = [k for k in self._keys_in(BlockState.READY) if k not in self.pins]
        assert dropped == len(expected)
        self._apply_events()
        self.stale = set(self.state)

    @rule(chain=CHAINS)
    def store_under_pressure(self, chain: list[int]) -> None:
        """A whole store as the connector does it: allocate, then finish
        successfully."""
        self.allocate(chain, None)
        keys = [k for k in chain if self.state.get(k) is BlockState.STORING]
        mine = [k for k in keys if k not in self.pins]
        if mine:
            self.pool.complete_store(mine, True)
            self._completed(mine, True)

    # ----- invariants -----

    @invariant()
    def pool_matches_model(self) -> None:
        self.pool.check_invariants()
        assert len(self.pool) == len(self.state) <= self.num_blocks
        assert self.pool.num_free == self.num_blocks - len(self.state)
        for key in range(24):
            seen = BlockState.STORING if key in self.stale else self.state.get(key)
            assert self.pool.state_of(key) is seen, key
        for pinned in self.pins:
            assert self.state[pinned] is BlockState.READY, (
                "a pinned block lost its state"
            )
        assert self.pool.num_pinned == len(self.pins)
        assert self.pool.num_storing == len(self._keys_in(BlockState.STORING))


_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)

# One machine per built-in policy (`TestLruPool`, `TestPrefixAwarePool`, ...);
# `prefix_aware` evicts leaves before their ancestors.
for _name in POLICY_NAMES:
    _machine: Any = type(
        f"{_name}PoolMachine",
        (PoolMachine,),
        {"policy_name": _name, "chain_aware": _name == "prefix_aware"},
    )
    _test = _machine.TestCase
    _test.settings = _SETTINGS
    _title = "".join(part.title() for part in _name.split("_"))
    globals()[f"Test{_title}Pool"] = _test
