"""The admission duel of `prefix_aware`: which of its four modes the pool is in, chosen
online by replaying a hash sample of the keys through one small shadow cache per rule.

Each shadow is a key-only cache (an LRU one; a segmented LRU one for protecting) that
applies its rule's admission to the sampled keys: admit-all, guarding at three history
windows, keeping, protecting. Rules are scored against admit-all by a sign test on the
uses where exactly one of the two shadows hits (`AdmissionDuel`). Also here: keeping's
one-in-`keep_every` credit (`KeepCredit`), which the pool and the keeping shadow share.

Every use costs O(1) per shadow, amortized; each shadow holds a bounded number of keys
(from `shadow_blocks` to about twice that, however large the pool; the guarding ones
also remember 1x, 2x and 4x that many).
"""

from __future__ import annotations

import math
from collections import OrderedDict

# The admission modes (`AdmissionDuel.mode`).
ADMITTING = 0
GUARDING = 1
KEEPING = 2
PROTECTING = 3


class KeepCredit:
    """Keeping's one-in-`keep_every` rule: every refused key adds a credit, and a key is
    let in when `keep_every` credits are there (they are spent). Counting refusals, not
    requests, lets a long refused chain pay for the head of a later one."""

    __slots__ = ("_every", "_credit")

    def __init__(self, keep_every: int) -> None:
        self._every = keep_every
        self._credit = 0

    def lets_in(self) -> bool:
        """A key asks to get in: True (spending the credits) or False (refused)."""
        if self._credit >= self._every:
            self._credit -= self._every
            return True
        self._credit += 1
        return False

    def refused(self) -> None:
        """A key was refused without asking (the rest of a refused chain)."""
        self._credit += 1


class AdmissionDuel:
    """Chooses admitting, guarding (at three history windows), keeping or protecting by
    replaying a key sample through one shadow of each rule and one of admit-all.

    Keys whose hash is divisible by `modulus` (a power of two) are sampled; each shadow
    is an LRU cache of key hashes, sized to hold as many sampled keys as the pool
    holds: num_blocks / modulus at first, then, once the pool is nine-tenths full, the
    sampled keys the pool actually holds scaled to a full pool (recounted every
    shadow-capacity of sampled uses), because a hash sample of a few thousand keys is
    off by tens of keys and a loop that nearly fits the pool falls on either side of
    that line. O(1) per use, amortized.

    Each rule is scored against admit-all on the uses where exactly one of the two
    shadows hits (a sign test: the uses both hit or both miss say nothing about which
    is better). A rule qualifies while its wins exceed its losses by more than 1.5
    standard deviations of their sum; `mode` and `window` are those of the qualified
    rule with the largest lead, ADMITTING if none qualifies. Counts are halved every 8
    shadow-capacities of sampled uses, so the choice follows phases of the workload.
    `mode` and `window` are plain attributes, updated at each use, because the pool
    reads them at every admission and eviction.
    """

    __slots__ = (
        "shadow_blocks",
        "modulus",
        "mode",
        "window",
        "pool_blocks",
        "pool_sampled",
        "_num_blocks",
        "_admit_all",
        "_rules",
        "_longest_window",
        "_uses",
        "_recount_every",
        "_half_life",
    )

    def __init__(
        self,
        num_blocks: int,
        history_factor: float,
        shadow_blocks: int,
        keep_every: int = 32,
    ) -> None:
        if shadow_blocks < 1:
            raise ValueError(f"shadow_blocks must be >= 1, got {shadow_blocks}")
        self.shadow_blocks = shadow_blocks
        modulus = 1
        while num_blocks // (modulus * 2) >= shadow_blocks:
            modulus *= 2
        self.modulus = modulus
        capacity = max(1, num_blocks // modulus)
        self._num_blocks = num_blocks
        self._admit_all = _ShadowCache(capacity, ADMITTING)
        self._rules = [
            _Rule(
                GUARDING,
                max(1, int(num_blocks * factor)),
                _ShadowCache(capacity, GUARDING, history_factor=factor),
            )
            for factor in (history_factor / 4, history_factor / 2, history_factor)
        ]
        self._longest_window = self._rules[-1].window
        self._rules.append(
            _Rule(
                KEEPING,
                self._longest_window,
                _ShadowCache(capacity, KEEPING, keep_every=keep_every),
            )
        )
        self._rules.append(
            _Rule(PROTECTING, self._longest_window, _SegmentedShadowCache(capacity))
        )
        # Blocks the pool holds, and how many of them are sampled: the policy counts.
        self.pool_blocks = 0
        self.pool_sampled = 0
        self._uses = 0
        self._recount_every = capacity
        self._half_life = 8 * capacity
        self.mode = ADMITTING
        self.window = self._longest_window

    @property
    def doorkeeper(self) -> bool:
        """Whether the mode is GUARDING."""
        return self.mode == GUARDING

    def observe(self, key_hash: int) -> bool:
        """Feeds a use of the key with this hash to the shadows if it is sampled.

        Returns whether it is.
        """
        if key_hash & (self.modulus - 1):
            return False
        self.use(key_hash)
        return True

    def use(self, key_hash: int) -> None:
        """Feeds a use of a key known to be sampled (by its hash) to every shadow."""
        self._feed(key_hash, True)

    def touch(self, key_hash: int) -> None:
        """Feeds a use of a sampled key that the device cache served: the shadows
        update their recency (and admit it if they lack it) but count no hit."""
        self._feed(key_hash, False)

    def _feed(self, key_hash: int, hit: bool) -> None:
        admit_all_hit = self._admit_all.use(key_hash, hit)
        rules = self._rules
        scored = False
        for rule in rules:
            if rule.shadow.use(key_hash, hit) != admit_all_hit:
                scored = True
                if admit_all_hit:
                    rule.losses += 1
                else:
                    rule.wins += 1
        uses = self._uses = self._uses + 1
        if uses % self._recount_every == 0:
            self._resize_shadows()
        if uses % self._half_life == 0:
            scored = True
            for rule in rules:
                rule.wins /= 2
                rule.losses /= 2
        if scored:
            self._choose()

    def _choose(self) -> None:
        best: _Rule | None = None
        best_lead = 0.0
        for rule in self._rules:
            lead = rule.wins - rule.losses
            if lead > best_lead and lead > 1.5 * math.sqrt(rule.wins + rule.losses):
                best, best_lead = rule, lead
        if best is None:
            self.mode = ADMITTING
            self.window = self._longest_window
        else:
            self.mode = best.mode
            self.window = best.window

    def _resize_shadows(self) -> None:
        held = self.pool_blocks
        if held * 10 < self._num_blocks * 9:
            return
        capacity = max(1, round(self.pool_sampled * self._num_blocks / held))
        self._admit_all.resize(capacity)
        for rule in self._rules:
            rule.shadow.resize(capacity)


class _Rule:
    """An admission rule in the duel: its mode, its history window (in keys
    remembered), its shadow, and its wins and losses against admit-all."""

    __slots__ = ("mode", "window", "shadow", "wins", "losses")

    def __init__(
        self, mode: int, window: int, shadow: _ShadowCache | _SegmentedShadowCache
    ) -> None:
        self.mode = mode
        self.window = window
        self.shadow = shadow
        self.wins = 0.0
        self.losses = 0.0


class _ShadowCache:
    """A key-only LRU cache that counts its hits, under one admission `mode`: once
    full, GUARDING refuses keys it does not remember (it remembers `history_factor`
    times its capacity of keys that left or were refused) and KEEPING lets in one
    refused key in `keep_every`."""

    __slots__ = (
        "capacity",
        "hits",
        "_mode",
        "_keep_credit",
        "_keys",
        "_history",
        "_history_factor",
    )

    def __init__(
        self,
        capacity: int,
        mode: int,
        history_factor: float = 0.0,
        keep_every: int = 32,
    ) -> None:
        self.capacity = capacity
        self.hits = 0.0
        self._mode = mode
        self._keep_credit = KeepCredit(keep_every)
        self._keys: OrderedDict[int, None] = OrderedDict()
        # Only guarding reads the history; the other rules keep none.
        self._history: OrderedDict[int, None] = OrderedDict()
        self._history_factor = history_factor if mode == GUARDING else 0.0

    def use(self, key: int, hit: bool = True) -> bool:
        """A use of `key`; a held key counts as a hit only if `hit`. Returns whether
        it counted as one."""
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
            if hit:
                self.hits += 1
            return hit
        full = len(keys) >= self.capacity
        if full and self._mode == GUARDING and key not in self._history:
            self._remember(key)
            return False
        if full and self._mode == KEEPING and not self._keep_credit.lets_in():
            return False
        self._history.pop(key, None)
        keys[key] = None
        if full:
            self._evict()
        return False

    def resize(self, capacity: int) -> None:
        """Holds at most `capacity` keys from now on; evicts the least recent."""
        self.capacity = capacity
        while len(self._keys) > capacity:
            self._evict()

    def _evict(self) -> None:
        self._remember(self._keys.popitem(last=False)[0])

    def _remember(self, key: int) -> None:
        history = self._history
        cap = int(self.capacity * self._history_factor)
        if cap < 1:
            return
        history[key] = None
        while len(history) > cap:
            history.popitem(last=False)


class _SegmentedShadowCache:
    """A key-only segmented LRU cache that counts its hits: the protecting rule. New
    keys enter probation; a key used again while held moves to the protected segment
    (at most `protected_fraction` of the capacity; its least recent key goes back to
    probation); victims come from probation first."""

    __slots__ = ("capacity", "hits", "_protected_fraction", "_probation", "_protected")

    def __init__(self, capacity: int, protected_fraction: float = 0.65) -> None:
        self.capacity = capacity
        self.hits = 0.0
        self._protected_fraction = protected_fraction
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()

    def use(self, key: int, hit: bool = True) -> bool:
        """A use of `key`; a held key counts as a hit only if `hit`. Returns whether
        it counted as one."""
        protected = self._protected
        if key in protected:
            protected.move_to_end(key)
        elif key in self._probation:
            del self._probation[key]
            protected[key] = None
            self._shrink_protected()
        else:
            self._probation[key] = None
            self.resize(self.capacity)
            return False
        if hit:
            self.hits += 1
        return hit

    def resize(self, capacity: int) -> None:
        """Holds at most `capacity` keys from now on; evicts probation first."""
        self.capacity = capacity
        probation, protected = self._probation, self._protected
        while len(probation) + len(protected) > capacity:
            (probation or protected).popitem(last=False)
        self._shrink_protected()

    def _shrink_protected(self) -> None:
        protected = self._protected
        cap = int(self.capacity * self._protected_fraction)
        while len(protected) > cap:
            self._probation[protected.popitem(last=False)[0]] = None
