"""Exactly once across kill -9: a collector killed at random moments of runs, rows sent against stored.

    python benchmarks/collector_kills.py [--job simulate|train] [--kills 10] [--runs 1] [--seed 30] [--ranks 8] [--steps N] [--keep DIR]

Each run is an 8-rank ``rankscope simulate`` (its ranks send through the agent's real Transport and
spool, and count what they sent), or with ``--job train`` a real 8-rank ``rankscope train`` of a
tiny model (each rank's agent says at its end what it sent; the launcher replays what the ranks
left in their spools), against a collector on a fresh embedded store, killed with SIGKILL
``--kills`` times at seeded random moments and restarted each time on the same store
(``rankscope.harness.collector_kills``). Printed: each run's kill times and incidents, then per
table the rows sent, stored, duplicated and lost over all runs.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from rankscope.harness import collector_kills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=collector_kills.JOBS, default="simulate", help="what runs (default: simulate)")
    parser.add_argument("--kills", type=int, default=10, help="kills per run (default: 10)")
    parser.add_argument("--runs", type=int, default=1, help="runs, each with its own seed and store (default: 1)")
    parser.add_argument("--seed", type=int, default=30, help="seed of the first run's kill moments (default: 30)")
    parser.add_argument("--ranks", type=int, default=8, help="simulated ranks, a multiple of 4 (default: 8; a trained run has 8)")
    parser.add_argument("--steps", type=int, help="steps, enough for the kills (default: 150 simulated of 0.5 s, 5000 trained of about 0.1 s)")
    parser.add_argument("--keep", type=Path, help="keep each run's logs and store under this folder (the evidence of an incident)")
    args = parser.parse_args()
    steps = args.steps or (5000 if args.job == "train" else 150)
    outcomes = []
    for seed in range(args.seed, args.seed + args.runs):
        if args.keep:
            workdir = args.keep / f"seed-{seed}"
            workdir.mkdir(parents=True)
        else:
            workdir = Path(tempfile.mkdtemp(prefix="rankscope-kills-"))
        try:
            outcome = collector_kills.run_with_kills(workdir, kills=args.kills, seed=seed, job=args.job, ranks=args.ranks, steps=steps)
        finally:
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
        outcomes.append(outcome)
        print(f"run {outcome.run_id}: killed at {', '.join(f'{s:.1f}' for s in outcome.kills_s)} s; "
              f"{args.job} exit {outcome.rc}; events the agents dropped: {outcome.dropped}; spool segments the launcher left, replayed"
              f" by hand: {outcome.left}; incidents: {outcome.incidents or 'none'}",
              flush=True)  # fmt: skip
    ranks = 8 if args.job == "train" else args.ranks
    print(f"\n{args.runs} {args.job} run(s) of {ranks} ranks, {steps} steps, {args.kills} kills each:\n")
    print(collector_kills.table(outcomes))


if __name__ == "__main__":
    main()
