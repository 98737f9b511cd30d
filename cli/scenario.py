"""``rankscope scenario``: inject a fault into a real 8-rank run and score what the diagnosis says.

``rankscope scenario list`` shows the built-in scenarios; ``rankscope scenario run NAME [NAME ...]``
or ``--all`` runs them one after another and prints a score line each. Exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys

HELP = "run built-in fault scenarios (straggler, hang, crash, NaN, slow link) and score the diagnosis"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="list the scenarios")
    run = sub.add_parser("run", help="run scenarios and print a score line each")
    run.add_argument("names", nargs="*", metavar="NAME", help="scenario names (see `rankscope scenario list`)")
    run.add_argument("--all", action="store_true", help="every scenario, the benchmark-only ones included")


def run(args: argparse.Namespace) -> int:
    from rankscope.collector.diagnosis import scenarios

    if args.action == "list":
        for s in scenarios.SCENARIOS.values():
            print(f"{s.name:16} {s.doc}{'' if s.in_tests else ' [benchmark]'}")
        return 0
    names = list(scenarios.SCENARIOS) if args.all else args.names
    unknown = [n for n in names if n not in scenarios.SCENARIOS]
    if unknown or not names:
        print(f"rankscope scenario: {'unknown ' + ', '.join(unknown) if unknown else 'name a scenario or --all'}; "
              f"known: {', '.join(scenarios.SCENARIOS)}", file=sys.stderr)  # fmt: skip
        return 2
    scores = [scenarios.run(scenarios.SCENARIOS[n], log=lambda line: print(f"  {line}", flush=True)) for n in names]
    print()
    for score in scores:
        print(score.line())
    return 0 if all(s.passed for s in scores) else 1
