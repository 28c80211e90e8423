"""A seeded, replayable simulation of the whole tier under faults.

vLLM's real `Scheduler` runs with the connector's scheduler half; N worker halves (one
per TP rank, each with its own KV cache, host buffer, copiers and store client) run
every step; three engines share one in-process store (the real value format): A, its
twin A2, often at another TP size (a TP=1 engine reads a TP=4 engine's per-head values
and the reverse), and B with another fingerprint (or, on two seeds of seven, all
three alike until one of them has its weights replaced or its LoRA adapter rewritten
in place mid-run: `runtime_events.py`). Copies fail on one rank or all, part-way
through their layers; store calls fail, time out and finish later into the
caller's memory, or hang for steps; the store goes down and comes back; requests are
aborted in every state, preempted under a small device cache, and `reset_cache` runs
between them.

The oracle: "compute" writes every KV slot with a value derived from the token prefix
up to it, the KV head (each rank holds its heads' values) and the engine's
fingerprint, so any slot that a step reads as computed is checked against what it must
hold, however it got there (device hit, host load, fetch from the store, written by an
engine of another TP size). Checked after every step and at quiescence: see
`world.py`. A failing seed prints a one-line replay:

    python -m tests.simulation --seed S --steps M --tp K
"""
