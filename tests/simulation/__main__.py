"""`python -m tests.simulation --seeds N --steps M --tp K`: runs seeds until one breaks
an invariant; prints its replay line. `--seed S` runs one seed."""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.simulation")
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, help="run this seed alone")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()

    from tests.simulation.runner import run_seeds

    seeds = (
        [args.seed]
        if args.seed is not None
        else range(args.first_seed, args.first_seed + args.seeds)
    )
    start = time.monotonic()
    failures = run_seeds(
        list(seeds), args.steps, args.tp, log=print, verbose=args.verbose
    )
    print(
        f"{len(failures)} failing of {len(seeds) * len(args.tp)} runs in "
        f"{time.monotonic() - start:.0f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
