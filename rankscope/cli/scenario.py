"""``rankscope scenario``: inject a fault into a real run and score what the diagnosis says.

Two families: the trainer's own faults (``--inject``) in an 8-rank run on this machine, and the
``testbed-*`` scenarios, whose faults come from outside the job (throttled, frozen, killed hosts and
ranks, slow links) on namespace hosts (``rankscope testbed``; root only).
``rankscope scenario list`` shows them; ``rankscope scenario run NAME [NAME ...]`` or ``--all``
runs them one after another and prints a score line each. Exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys

HELP = "run built-in fault scenarios (straggler, hang, crash, NaN, slow link; faults from outside on the test bed) and score the diagnosis"
EXTRA = "collector"  # `scenario run` starts a collector; `scenario list` needs none


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="list the scenarios")
    run = sub.add_parser("run", help="run scenarios and print a score line each")
    run.add_argument("names", nargs="*", metavar="NAME", help="scenario names (see `rankscope scenario list`)")
    run.add_argument("--all", action="store_true", help="every scenario, the benchmark-only and test-bed ones included")


def run(args: argparse.Namespace) -> int:
    from rankscope.harness import local_scenarios
    from rankscope.harness import testbed_scenarios

    known = {**local_scenarios.SCENARIOS, **testbed_scenarios.SCENARIOS}
    if args.action == "list":
        for s in known.values():
            tag = " [test bed, root]" if s.name in testbed_scenarios.SCENARIOS else "" if s.in_tests else " [benchmark]"
            print(f"{s.name:28} {s.doc}{tag}")
        return 0
    names = list(known) if args.all else args.names
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        print(f"rankscope scenario: {'unknown ' + ', '.join(unknown) if unknown else 'name a scenario or --all'}; "
              f"known: {', '.join(known)}", file=sys.stderr)  # fmt: skip
        return 2
    from rankscope.testbed.hosts import TestbedError

    scores = []
    for name in names:
        play = testbed_scenarios.run if name in testbed_scenarios.SCENARIOS else local_scenarios.run
        try:
            scores.append(play(known[name], log=lambda line: print(f"  {line}", flush=True)))  # type: ignore[arg-type]
        except TestbedError as e:
            print(f"rankscope scenario: {name}: {e}", file=sys.stderr)
            return 1
    print()
    for score in scores:
        print(score.line())
    return 0 if all(s.passed for s in scores) else 1
