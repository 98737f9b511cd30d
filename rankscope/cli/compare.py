"""``rankscope compare``: which segments, ranks and process groups make one run, or one stretch of
steps, slower than another, largest first.

    rankscope compare RUN_A RUN_B                          B against A, each over its steps after the warm-up
    rankscope compare RUN_A RUN_B --steps 10-50            the same steps of both runs
    rankscope compare RUN --steps 100-200 --against 300-400  steps 300-400 of RUN against its steps 100-200

Differences are always the second side minus the first (the first is the baseline). Reads through the
collector (default), a ClickHouse server or an embedded store, like ``rankscope diagnose``.
``--format json`` prints exactly one JSON object on stdout. Exit status: 0, 1 when the data cannot be
reached, 2 for bad input (an unknown run, a range without completed steps).
"""

from __future__ import annotations

import argparse
import json
import sys

from rankscope.cli import source

HELP = "say which segments, ranks and groups make one run (or one range of steps) slower than another"
EXTRA = "collector"


def _steps(text: str) -> tuple[int, int]:
    from rankscope.collector.compare import parse_steps  # light: no store, no grpc

    try:
        return parse_steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", metavar="RUN_A", help="the baseline run")
    parser.add_argument("run_b", metavar="RUN_B", nargs="?", help="the run compared with it (default: RUN_A again, with --against)")
    parser.add_argument("--steps", metavar="FIRST-LAST", type=_steps,
                        help="the steps of RUN_A (and of RUN_B unless --against gives them); default: every completed step "
                             "after the first two (warm-up)")  # fmt: skip
    parser.add_argument("--against", metavar="FIRST-LAST", type=_steps,
                        help="the steps of the second side: of RUN_B, or of RUN_A itself when no RUN_B is given")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--top", metavar="N", type=_positive, default=12, help="rows per table (default 12; json has them all)")
    source.add_arguments(parser)


def _positive(text: str) -> int:
    from rankscope.cli.args import count

    return count(1)(text)


def run(args: argparse.Namespace) -> int:
    from rankscope.collector.client import QueryFailed
    from rankscope.collector.compare import CompareError, Side, compare

    if args.run_b is None and args.against is None:
        print("rankscope compare: give a second run (rankscope compare RUN_A RUN_B), or the steps to compare with "
              "(rankscope compare RUN --steps 100-200 --against 300-400)", file=sys.stderr)  # fmt: skip
        return 2
    first = Side(args.run_a, *(args.steps or (None, None)))
    second_steps = args.against or args.steps
    second = Side(args.run_b or args.run_a, *(second_steps or (None, None)))
    if first == second:
        print(f"rankscope compare: both sides are run {first.run_id} over the same steps: give another run or other steps (--against)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        reader = source.open_reader(args)
        try:
            result = compare(lambda sql, params: reader.query(sql, params), first, second)
        finally:
            reader.close()
    except CompareError as e:
        print(f"rankscope compare: {e}", file=sys.stderr)
        return 2
    except QueryFailed as e:
        print(f"rankscope compare: {e}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps(result.as_json(), default=str))
    else:
        print(result.table(rows=args.top))
    return 0
