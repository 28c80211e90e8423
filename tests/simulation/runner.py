"""Runs seeds of the simulation; one failing seed's replay line per violation."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

from tests.simulation.world import Violation, World, replay_line, vllm_test_utils


def run_seeds(
    seeds: list[int],
    steps: int,
    tps: list[int],
    log: Callable[[str], None],
    verbose: bool = False,
) -> list[str]:
    """Each seed at each TP size; returns one line per failing run (its violation and
    replay command)."""
    # Injected faults log as real ones do: thousands of lines a run. The levels are
    # put back after: a later test in the same process may read those logs.
    loggers = [
        logging.getLogger(n) for n in ("vllm_cpu_offload", "vllm", "tests.simulation")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        return _run_seeds(seeds, steps, tps, log, verbose)
    finally:
        gc.unfreeze()  # what `_run_seeds` froze is the process's to collect again
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _run_seeds(
    seeds: list[int],
    steps: int,
    tps: list[int],
    log: Callable[[str], None],
    verbose: bool,
) -> list[str]:
    from vllm_cpu_offload.testing.tiny_model import ensure_tiny_llama

    utils = vllm_test_utils()
    model = str(ensure_tiny_llama())
    failures = []
    for tp in tps:
        for seed in seeds:
            world = World(utils, model, seed, tp, steps)
            try:
                world.run()
                if verbose:
                    log(f"seed {seed} tp {tp} ({world.shape}): {world.summary()}")
            except Violation as e:
                first = str(e).splitlines()[0]
                replay = replay_line(seed, steps, tp)
                line = (
                    f"seed {seed} tp {tp} ({world.shape}): {first}\n  replay: {replay}"
                )
                log(line)
                failures.append(line)
            # A world's buffers (MiB a rank) hang in reference cycles, which
            # Python's collector, counting objects not bytes, reaches only rarely.
            del world
            gc.collect()
            # What is left lives on (modules, vLLM's caches): the next collection
            # looks at the next world's objects alone (a full one took 1.5 s).
            gc.freeze()
    return failures
