"""Self-healing drills: how long from a fault to the incident, the eviction and the first step after the restart?

    sudo python benchmarks/healing.py [--slurm] [--drill NAME ...]

Runs each drill of rankscope/harness/healing_drills.py: 3 namespace hosts of 2 ranks, the bundled trainer (TP2
inside a host, dp 3 over the hosts, a DCP checkpoint every 2 steps) under `rankscope launch`'s
driver, a fault from outside at step 5 (a host killed, frozen, or its CPU cut to a fifth). It
prints one markdown row per fault: the seconds from the fault to the incident the driver acted on,
to the eviction and to the first step after the restart, the steps lost, and the run's effective
training time ratio (the time of each completed step once, over the wall time from launch to the
end). A clean run of the same job is measured first, in the same run of this script, for the
ratio to compare with. Needs root; every namespace and process is removed afterwards.

With ``--slurm`` the drills of rankscope/harness/slurm_drills.py: the same job as a Slurm batch job
(``rankscope launch --slurm``) on a Slurm test bed of 4 nodes, node1 killed (node3 a spare), frozen,
throttled, or killed when the job may not shrink and has no spare (requeued); one more column says
what ``sinfo -R`` keeps as node1's reason.
"""

from __future__ import annotations

import argparse
import json
import sys

from rankscope.harness import healing_drills as scenarios
from rankscope.harness import slurm_drills
from rankscope.testbed.hosts import TestbedError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slurm", action="store_true", help="the Slurm drills: the job as a batch job on a Slurm test bed")
    parser.add_argument("--drill", action="append", choices=[*scenarios.DRILLS, *slurm_drills.DRILLS], help="only these (default: all)")
    args = parser.parse_args()
    drills, harness = (slurm_drills.DRILLS, slurm_drills) if args.slurm else (scenarios.DRILLS, scenarios)
    if unknown := [d for d in args.drill or [] if d not in drills]:
        parser.error(f"{', '.join(unknown)}: not a {'Slurm ' if args.slurm else 'test-bed '}drill (those are {', '.join(drills)})")
    names = ["clean", *(args.drill or list(drills))]
    rows = [
        "| fault | healed | s to incident | s to eviction | s to first step after restart | steps lost | attempts | effective ratio |"
        + (" node1 in `sinfo -R` |" if args.slurm else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if args.slurm else ""),
    ]
    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        drill = scenarios.CLEAN if name == "clean" else drills[name]
        try:
            outcome = harness.run(drill, log=lambda line: print(f"   {line}", file=sys.stderr, flush=True))
        except TestbedError as e:
            print(f"benchmarks/healing.py: {e}", file=sys.stderr)
            return 1
        end = outcome.summary
        cells = [outcome.seconds_to(a) for a in ("incident", "evict", "resumed")]
        healed = "clean" if drill is scenarios.CLEAN else "yes" if outcome.healed else "NO"
        rows.append(
            f"| {drill.doc} | {healed} | " + " | ".join(f"{c:.1f}" if c is not None else "-" for c in cells)
            + f" | {end.get('steps_lost') if end.get('steps_lost') is not None else '-'} | {end.get('attempts', '-')}"
            f" | {end.get('effective_ratio', 0):.3f} ({end.get('productive_s', 0):.1f} s of {end.get('wall_s', 0):.1f} s) |"
            + (f" {outcome.fenced_as[:90] or '-'} |" if args.slurm else "")
        )
        print(json.dumps({"drill": name, "actions": [(a["action"], a["hosts"], a["reason"][:160]) for a in outcome.actions]}), file=sys.stderr)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
