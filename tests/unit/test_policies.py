"""Eviction policies: the registry, and each policy's choices on small scenarios."""

from __future__ import annotations

import pytest

from vllm_cpu_offload.scheduler.block_pool import HostBlockPool
from vllm_cpu_offload.scheduler.policies import BlockList, HostBlock, LRUPolicy
from vllm_cpu_offload.scheduler.policies.admission_duel import PROTECTING, AdmissionDuel
from vllm_cpu_offload.scheduler.policies.prefix_aware import PrefixAwarePolicy
from vllm_cpu_offload.scheduler.policies.registry import POLICY_NAMES, make_policy


def store(pool: HostBlockPool, keys: list[object], parent: object = None) -> int:
    allocated = pool.allocate_for_store(keys, parent)
    pool.complete_store([key for key, _ in allocated], True)
    return len(allocated)


# ----- registry -----


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_make_policy_builds_each_registered_policy(name: str) -> None:
    # Every registered name builds a policy that knows its own name.
    policy = make_policy(name, 16)
    assert policy.name == name and policy.num_blocks == 16


def test_make_policy_rejects_unknown_names_listing_the_allowed() -> None:
    # A typo in the config names the allowed policies.
    with pytest.raises(ValueError, match=f"choose one of: {', '.join(POLICY_NAMES)}"):
        make_policy("lfu", 16)


@pytest.mark.parametrize("bad", [-0.1, 1.0])
def test_prefix_aware_rejects_bad_protected_fraction(bad: float) -> None:
    # The protected share must leave room for probation.
    with pytest.raises(ValueError, match="protected_fraction"):
        PrefixAwarePolicy(8, protected_fraction=bad)


# ----- the intrusive list -----


def test_block_list_orders_and_unlinks_in_place() -> None:
    # append/appendleft/remove/move_to_end/popleft keep order and ownership.
    blocks = [HostBlock(i) for i in range(4)]
    lst = BlockList()
    for block in blocks[1:]:
        lst.append(block)
    lst.appendleft(blocks[0])
    lst.move_to_end(blocks[1])
    lst.remove(blocks[2])
    assert [b.block_id for b in lst] == [0, 3, 1] and len(lst) == 3
    assert blocks[2].owner is None and blocks[0] in lst
    assert lst.popleft() is blocks[0] and lst.head is blocks[3]
    lst.clear()
    assert lst.head is None and len(lst) == 0


# ----- LRU -----


def test_lru_evicts_least_recently_used() -> None:
    # Three blocks, the middle one used last but one: the oldest-used goes.
    pool = HostBlockPool(3, LRUPolicy(3))
    for key in "abc":
        store(pool, [key])
    pool.count_hits(["a"])
    pool.count_hits(["b"])
    store(pool, ["x"])
    assert "c" not in pool and {"a", "b", "x"} <= {k for k in "abcx" if k in pool}


def test_lru_returns_unpinned_blocks_as_most_recent() -> None:
    # A block whose load just ended was just used: it outlives older blocks.
    pool = HostBlockPool(2, LRUPolicy(2))
    store(pool, ["a"])
    store(pool, ["b"])
    pool.pin(["a"])
    pool.unpin(["a"])
    store(pool, ["x"])
    assert "a" in pool and "b" not in pool


# ----- prefix-aware -----


def test_prefix_aware_evicts_leaves_before_ancestors() -> None:
    # One chain, pool full, its root used least recently: the tail goes, not the root.
    pool = HostBlockPool(4, PrefixAwarePolicy(4))
    store(pool, ["a", "b", "c"])
    store(pool, ["z"])
    pool.touch(["b", "c"])  # the root is now the least recent block
    pool.count_hits(["z"])
    store(pool, ["y"])
    assert "a" in pool and "b" in pool and "c" not in pool


def test_lru_by_contrast_evicts_the_stale_root() -> None:
    # Same scenario under LRU: it evicts the root and leaves an orphaned chain.
    pool = HostBlockPool(4, LRUPolicy(4))
    store(pool, ["a", "b", "c"])
    store(pool, ["z"])
    pool.touch(["b", "c"])
    pool.count_hits(["z"])
    store(pool, ["y"])
    assert "a" not in pool and pool.count_hits(["a", "b", "c"]) == 0


def test_prefix_aware_evicts_orphans_first() -> None:
    # A block whose parent's store failed goes before any recently stored block.
    pool = HostBlockPool(4, PrefixAwarePolicy(4))
    pool.allocate_for_store(["a", "b"], None)
    pool.complete_store(["b"], True)
    pool.complete_store(["a"], False)
    store(pool, ["x", "y", "z"])
    store(pool, ["w"])
    assert "b" not in pool and all(k in pool for k in "xyzw")


def test_prefix_aware_never_evicts_an_ancestor_of_a_store_in_flight() -> None:
    # The chain's tail is still being stored: its ancestors are not victims.
    pool = HostBlockPool(3, PrefixAwarePolicy(3))
    store(pool, ["a", "b"])
    pool.allocate_for_store(["c"], "b")
    assert pool.allocate_for_store(["x"], None) == []
    assert "a" in pool and "b" in pool


def test_prefix_aware_admitting_all_evicts_like_lru() -> None:
    # While admitting everything (no thrash seen) the policy keeps LRU's recency order.
    def survivors(policy_name: str) -> set[str]:
        pool = HostBlockPool(10, make_policy(policy_name, 10))
        keys = [f"k{i}" for i in range(10)]
        for key in keys:
            store(pool, [key])
        pool.count_hits(["k3"])
        pool.touch(["k0", "k7"])
        for i in range(4):
            store(pool, [f"new{i}"])
        return {key for key in keys if key in pool}

    assert (
        survivors("prefix_aware")
        == survivors("lru")
        == {"k0", "k3", "k6", "k7", "k8", "k9"}
    )


def test_prefix_aware_remembers_evicted_keys_as_reused() -> None:
    # A key evicted and stored again has proven a reuse: it starts in
    # the protected segment.
    pool = HostBlockPool(4, PrefixAwarePolicy(4))
    store(pool, ["r"])
    for key in ["p", "q", "s", "t"]:
        store(pool, [key])  # evicts r, which is remembered
    assert "r" not in pool
    store(pool, ["r"])
    store(pool, ["u"])
    assert pool._by_key["r"].segment == 1 and pool._by_key["u"].segment == 0


def test_prefix_aware_sample_flag_follows_the_key_not_the_block() -> None:
    # A block freed from a sampled key and reused for an unsampled one feeds no shadow.
    # samples the keys whose hash is even
    policy = PrefixAwarePolicy(2, shadow_blocks=1)
    pool = HostBlockPool(2, policy)
    store(pool, [0])
    sampled_block = pool._by_key[0]
    assert sampled_block.in_duel_sample
    store(pool, [1])
    store(pool, [3])  # evicts 0; its block now holds 3
    assert pool._by_key[3] is sampled_block and not sampled_block.in_duel_sample
    uses = policy._duel._uses
    assert pool.count_hits([3]) == 1 and pool.count_hits([1]) == 1
    assert policy._duel._uses == uses
    store(pool, [4])  # a sampled key is fed at its store and at each hit
    assert policy._duel._uses == uses + 1
    assert pool.count_hits([4]) == 1 and policy._duel._uses == uses + 2


def test_prefix_aware_counts_what_the_pool_holds_through_a_reset() -> None:
    # The duel sizes its shadows by the blocks the pool holds: a reset drops the
    # unpinned ones and a pinned block stays, counted, until it leaves.
    policy = PrefixAwarePolicy(4)
    pool = HostBlockPool(4, policy)
    store(pool, ["a", "b", "c"])
    assert policy._duel.pool_blocks == policy._duel.pool_sampled == 3
    pool.pin(["a"])
    pool.reset()
    assert policy._duel.pool_blocks == policy._duel.pool_sampled == 1
    pool.unpin(["a"])
    for key in "defgh":
        store(pool, [key])
    assert policy._duel.pool_blocks == policy._duel.pool_sampled == 4


def _hot_and_one_offs(pool: HostBlockPool, laps: int) -> tuple[int, int]:
    """12 hot keys in a loop, 3 never-reused keys after each: reuse distance 48 > 16.

    Returns (hits on hot keys in the second half of the laps, the lap where the policy
    first refused a key, or -1).
    """
    hits, refused_at, fresh = 0, -1, 0
    for lap in range(laps):
        for hot in range(12):
            hit = pool.count_hits([f"hot{hot}"])
            hits += hit * (lap >= laps // 2)
            if not hit:
                store(pool, [f"hot{hot}"])
            for _ in range(3):
                fresh += 1
                if not store(pool, [f"once{fresh}"]) and refused_at < 0:
                    refused_at = lap
    return hits, refused_at


def test_prefix_aware_keeps_a_hot_set_that_lru_thrashes() -> None:
    # Reused keys interleaved with one-off keys: LRU hits nothing, prefix_aware hits.
    lru_hits, _ = _hot_and_one_offs(HostBlockPool(16, LRUPolicy(16)), laps=20)
    ours_hits, _ = _hot_and_one_offs(HostBlockPool(16, PrefixAwarePolicy(16)), laps=20)
    assert lru_hits == 0
    assert ours_hits > 12 * 10 // 2


def test_prefix_aware_turns_doorkeeper_and_admits_on_second_sight() -> None:
    # On that workload the doorkeeper rule wins: a new chain is refused whole while the
    # pool is full, then admitted whole on its second sight.
    policy = PrefixAwarePolicy(16)
    pool = HostBlockPool(16, policy)
    _, refused_at = _hot_and_one_offs(pool, laps=20)
    assert policy.doorkeeper and refused_at >= 0
    assert pool.num_free == 0
    assert pool.allocate_for_store(["new0", "new1"], None) == []
    assert store(pool, ["new0", "new1"]) == 2
    assert pool.count_hits(["new0", "new1"]) == 2


def _document_loop(pool: HostBlockPool, docs: list[list[object]], passes: int) -> int:
    """Reads the chains `docs` in the same order `passes` times, storing what misses;
    returns the hits of the last pass."""
    hits = 0
    for _ in range(passes):
        hits = 0
        for keys in docs:
            hit = pool.count_hits(keys)
            hits += hit
            store(pool, keys[hit:], keys[hit - 1] if hit else None)
    return hits


def _documents(docs: int, blocks: int) -> list[list[object]]:
    return [[f"doc{doc}.{i}" for i in range(blocks)] for doc in range(docs)]


def test_prefix_aware_keeps_part_of_a_loop_larger_than_the_pool() -> None:
    # 8 documents of 16 blocks read in a loop through a pool of 64 blocks: LRU evicts
    # each document just before its next read; keeping what the pool holds serves
    # about half of every pass.
    assert (
        _document_loop(HostBlockPool(64, LRUPolicy(64)), _documents(8, 16), passes=6)
        == 0
    )
    policy = PrefixAwarePolicy(64)
    hits = _document_loop(HostBlockPool(64, policy), _documents(8, 16), passes=6)
    assert policy.keeping and not policy.doorkeeper
    assert hits >= 3 * 16


def test_prefix_aware_keeping_lets_in_one_refused_key_in_keep_every() -> None:
    # While keeping, new keys are refused, but every keep_every-th refusal earns one
    # key its way in (bimodal insertion), so the pool still follows a changed workload.
    policy = PrefixAwarePolicy(64, keep_every=4)
    pool = HostBlockPool(64, policy)
    _document_loop(pool, _documents(8, 16), passes=6)
    assert policy.keeping
    admitted = [i for i in range(20) if store(pool, [f"new{i}"])]
    # The first may use credit left from the loop; from then on, one in five.
    assert len(admitted) >= 3
    assert all(b - a == 5 for a, b in zip(admitted, admitted[1:], strict=False))


def test_prefix_aware_rejects_a_bad_keep_every() -> None:
    with pytest.raises(ValueError, match="keep_every must be >= 1"):
        PrefixAwarePolicy(64, keep_every=0)


def test_prefix_aware_device_hits_move_recency_but_are_no_shadow_hits() -> None:
    # The shadows rank the admission rules by what the host tier serves: a block the
    # device cache served is kept warm, but is not a hit for any rule.
    policy = PrefixAwarePolicy(4)
    pool = HostBlockPool(4, policy)
    for key in "abcd":
        store(pool, [key])
    shadow = policy._duel._admit_all
    hits = shadow.hits
    pool.touch(["a"], by_device=True)
    assert shadow.hits == hits
    assert pool.count_hits(["b"]) == 1 and shadow.hits == hits + 1
    store(pool, ["e"])  # evicts the least recent: c, since a and b were used
    assert "a" in pool and "b" in pool and "c" not in pool


def test_prefix_aware_keeps_a_loop_that_nearly_fits_its_sample() -> None:
    # 272 keys looped through 256 blocks; one key in 4 is sampled (hash(int) == int),
    # and the loop holds 60 sampled keys: a shadow sized num_blocks / 4 = 64 would
    # hold all of them and see every rule hit everything. Sized to the sampled keys
    # the pool holds (about 56), its admit-all misses the loop as the pool does.
    keys = list(range(240)) + [1001 + 4 * i for i in range(32)]
    assert sum(key % 4 == 0 for key in keys) == 60
    docs: list[list[object]] = [list(keys[i : i + 16]) for i in range(0, 272, 16)]
    assert _document_loop(HostBlockPool(256, LRUPolicy(256)), docs, passes=8) == 0
    policy = PrefixAwarePolicy(256, shadow_blocks=64)
    assert policy._duel.modulus == 4
    hits = _document_loop(HostBlockPool(256, policy), docs, passes=8)
    assert policy._duel._admit_all.capacity < 60
    assert policy.keeping and hits >= 128


def test_admission_duel_guards_with_a_short_window_against_late_returns() -> None:
    # 12 hot keys and 8 new keys a lap in a pool of 16; each new key comes back once,
    # 3 laps later. A doorkeeper that recalls that far back lets the returns in, and
    # they flush the hot keys; one that recalls a pool's worth of keys refuses them.
    duel = AdmissionDuel(num_blocks=16, history_factor=4.0, shadow_blocks=16)
    for lap in range(60):
        for i in range(8):
            duel.observe(hash(i))
            duel.observe(hash(1000 + lap * 8 + i))
            if lap >= 3:
                duel.observe(hash(1000 + (lap - 3) * 8 + i))
        for i in range(8, 12):
            duel.observe(hash(i))
    assert duel.doorkeeper and duel.window == 16
    short, _, longest = duel._rules[:3]
    assert short.shadow.hits > 10 * longest.shadow.hits


def test_admission_duel_protects_when_new_keys_are_reused_at_once() -> None:
    # 6 hot keys, each read twice a visit; a new key a step, read again the next step;
    # 2 one-off keys a step. Admitting everything into probation and evicting there
    # first serves the hot set and every new key's reuse; a doorkeeper refuses each new
    # key's first sight, and plain LRU flushes the hot set.
    duel = AdmissionDuel(num_blocks=16, history_factor=4.0, shadow_blocks=16)
    one_off = 10**6
    for step in range(2000):
        duel.observe(hash(step % 6))
        duel.observe(hash(step % 6))
        duel.observe(hash(1000 + step))
        if step:
            duel.observe(hash(1000 + step - 1))
        for _ in range(2):
            one_off += 1
            duel.observe(hash(one_off))
    assert duel.mode == PROTECTING
    protecting = duel._rules[-1]
    assert protecting.mode == PROTECTING
    assert protecting.shadow.hits > 1.4 * duel._admit_all.hits
    assert all(protecting.shadow.hits > rule.shadow.hits for rule in duel._rules[:-1])


def test_admission_duel_prefers_admit_all_on_a_small_working_set() -> None:
    # Keys that fit in the pool: admitting everything hits at least as often.
    duel = AdmissionDuel(num_blocks=64, history_factor=4.0, shadow_blocks=64)
    for _ in range(10):
        for key in range(32):
            duel.observe(hash(key))
    assert not duel.doorkeeper


def test_admission_duel_samples_large_pools() -> None:
    # A pool 16x the shadow size samples one key in 16 (by hash): others are ignored.
    duel = AdmissionDuel(num_blocks=16 * 64, history_factor=4.0, shadow_blocks=64)
    for _ in range(3):
        for key in range(1, 16):
            duel.observe(hash(key))  # hash(int) == int: none divisible by 16
    assert duel._admit_all.hits == 0
    assert all(rule.shadow.hits == 0 for rule in duel._rules)
    duel.observe(hash(16))
    duel.observe(hash(16))
    assert duel._admit_all.hits == 1
