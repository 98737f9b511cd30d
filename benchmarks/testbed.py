"""Faults from outside the job on namespace hosts: is each diagnosed, and how long after the fault?

    sudo python benchmarks/testbed.py [--scenario NAME ...]

Runs every test-bed scenario (rankscope/harness/testbed_scenarios.py: four hosts of two ranks each, the bundled
trainer or a plain DDP script, the agent on, one real collector each) and prints one markdown row
per fault: what was done to which host or rank, the incident expected, whether the diagnosis named
exactly that (kind, ranks, host, nothing else), and the seconds from the fault to the incident as
the scorer first saw it (the collector diagnoses every second; the hang and silence thresholds are
the scenarios' 10 s and 8 s). Needs root; every namespace and process is removed afterwards.
"""

from __future__ import annotations

import argparse
import sys

from rankscope.harness import testbed_scenarios as scenarios
from rankscope.testbed.hosts import TestbedError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", action="append", choices=list(scenarios.SCENARIOS), help="only these (default: all)")
    args = parser.parse_args()
    names = args.scenario or list(scenarios.SCENARIOS)
    rows = ["| scenario | fault applied | expected | named | passed | seconds from fault to incident |", "|---|---|---|---|---|---|"]
    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            score = scenarios.run(scenarios.SCENARIOS[name], log=lambda line: print(f"   {line}", file=sys.stderr, flush=True))
        except TestbedError as e:
            print(f"benchmarks/testbed.py: {e}", file=sys.stderr)
            return 1
        s = score.scenario
        expected = f"{s.kind} {list(score.ranks)} on {', '.join(score.hosts)}" if s.kind else "no incident"
        named = "; ".join(f"{i['kind']} {sorted(i['ranks'])} on {', '.join(sorted(i['hosts']))}" for i in score.incidents) or "nothing"
        seconds = f"{score.seconds_to_detect:.1f}" if score.seconds_to_detect is not None else "-"
        rows.append(f"| {name} | {score.fault or '-'} | {expected} | {named} | {'yes' if score.passed else 'NO'} | {seconds} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
