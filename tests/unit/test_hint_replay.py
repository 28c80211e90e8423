"""benchmarks/hint_replay.py: the hints it derives from a stream, and its hinted tier
(the real pool and `Retention`) replaying a stream with no hints exactly as
trace_replay.py's tier does."""

from __future__ import annotations

import random
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import hint_replay as hr  # noqa: E402
from trace_replay import OurTier, replay  # noqa: E402
from workloads import agent_loops  # noqa: E402


def _toy() -> hr.Stream:
    # Two conversations under a shared block 0: a (1, 2) -> (1, 2, 3); b (4) ends.
    trace = [[0, 1, 2], [0, 4], [0, 1, 2, 3], [0]]
    return hr.Stream("toy", trace, [0.0, 1.0, 5.0, 6.0], device_blocks=2)


def test_continuations_and_conversations() -> None:
    stream = _toy()
    nxt = hr.continuations(stream.trace)
    assert nxt == [2, None, None, None]
    conv = hr.conversations(stream.trace, nxt)
    assert conv[2] == conv[0] and len({conv[0], conv[1], conv[3]}) == 3


def test_right_hints() -> None:
    params = hr.variant_params(_toy(), "right")
    assert params[0] == {"retain": 5.0 * (1 + hr.SLACK) + hr.SLACK_S}
    assert params[1] == {"max_offload_tokens": 0}
    hints = hr.parsed(params)
    assert hints[0].retain_s is not None and hints[1].max_offload_tokens == 0
    done = hr.variant_params(_toy(), "right+done")
    assert done[1] == {"max_offload_tokens": 0, "done": True}


def test_a_fifth_wrong() -> None:
    right = [{"retain": float(i)} for i in range(50)] + [{"max_offload_tokens": 0}] * 50
    wrong = hr.wrong_params(right, random.Random(0))
    assert sum(a != b for a, b in zip(right, wrong, strict=True)) == 20


def _agent() -> hr.Stream:
    work = agent_loops(num_requests=300, concurrency=16)
    return hr.Stream("agent", work.requests, [float(i) for i in range(300)], 200)


def test_no_hints_replay_as_trace_replay() -> None:
    stream = _agent()
    for policy in ("lru", "prefix_aware"):
        ours = replay(stream.trace, 200, OurTier(policy, 800))["saved"]
        hints = hr.parsed(hr.variant_params(stream, "none"))
        tier = hr.HintedTier(policy, 800, stream, hints, 0.5)
        assert replay(stream.trace, 200, tier)["saved"] == ours
        tier.check()


def test_hinted_replay_keeps_invariants() -> None:
    stream = _agent()
    for variant in hr.VARIANTS:
        hints = hr.parsed(hr.variant_params(stream, variant))
        tier = hr.HintedTier("prefix_aware", 800, stream, hints, 0.5)
        replay(stream.trace, 200, tier)
        tier.check()
        assert tier.retention.num_blocks <= tier.retention.budget
