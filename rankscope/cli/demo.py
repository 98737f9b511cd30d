"""``rankscope demo``: the collector on the embedded store, the dashboard and an 8-rank CPU training
run (TP2 x PP2 x DP2, two ranks per simulated host) that develops a straggler and later hangs.

It prints the dashboard's address and what to look at, a line every few steps and one per
incident. Once the hang is diagnosed the training run is stopped and the dashboard stays up until
Ctrl-C; Ctrl-C (or SIGTERM) stops every process the demo started and prints the follow-up
commands that read the store it leaves. The processes themselves are ``rankscope/harness/demo.py``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rankscope.cli.args import count, listen, port, seconds
from rankscope.cli.collector import DEFAULT_LISTEN, DEFAULT_STORE
from rankscope.cli.dashboard import DEFAULT_PORT

HELP = "run the demo: collector, dashboard and an 8-rank CPU training job with a straggler, then a hang"
EXTRA = "dashboard"

DEFAULT_STEPS = 40
DEFAULT_STRAGGLER_RANK = 5
DEFAULT_HANG_RANK = 2
DEFAULT_HANG_AFTER_S = 15.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", metavar="DIR", type=Path, default=Path(DEFAULT_STORE),
                        help=f"embedded chDB store, kept after the demo (default: ./{DEFAULT_STORE})")
    parser.add_argument("--steps", metavar="N", type=count(1), default=DEFAULT_STEPS,
                        help=f"training steps (default: {DEFAULT_STEPS}; the hang comes at three quarters of them)")
    parser.add_argument("--straggler-rank", metavar="R", type=int, default=DEFAULT_STRAGGLER_RANK,
                        help=f"the rank whose compute gets 1.5x slower from step 5 (default: {DEFAULT_STRAGGLER_RANK})")
    parser.add_argument("--hang-rank", metavar="R", type=int, default=DEFAULT_HANG_RANK,
                        help=f"the rank that later stops before a collective (default: {DEFAULT_HANG_RANK})")
    parser.add_argument("--inject", metavar="SPEC",
                        help="faults instead of the default straggler and hang, in `rankscope train --inject` grammar")
    parser.add_argument("--hang-after", metavar="SECONDS", type=seconds, default=DEFAULT_HANG_AFTER_S,
                        help=f"the collector calls a run hung when its steps stall this long (default: {DEFAULT_HANG_AFTER_S:.0f})")
    parser.add_argument("--listen", metavar="HOST:PORT", type=listen, default=DEFAULT_LISTEN,
                        help=f"the collector's gRPC address (default: {DEFAULT_LISTEN}; port 0 picks a free one)")
    parser.add_argument("--port", type=port(1), default=DEFAULT_PORT, help=f"the dashboard's HTTP port (default: {DEFAULT_PORT})")
    parser.add_argument("--no-dashboard", action="store_true",
                        help="no dashboard: the demo ends (stopping the collector) once the training run is over")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from rankscope.harness.demo import DemoError, DemoOptions, check_faults, default_faults
    from rankscope.harness.demo import run as run_demo

    try:
        inject = args.inject or default_faults(args.steps, args.straggler_rank, args.hang_rank)
        faults = check_faults(inject, args.steps)
    except ValueError as e:  # FaultSpecError included
        print(f"rankscope demo: {e}", file=sys.stderr)
        return 2
    from rankscope.agent.autoload import forbid

    forbid("demo", children=False)  # no training rank; the ranks of its training run must record
    options = DemoOptions(
        store=args.store, steps=args.steps, inject=inject, faults=faults, listen=args.listen,
        dashboard_port=None if args.no_dashboard else args.port, hang_after_s=args.hang_after, command=_command_name(),
    )  # fmt: skip
    try:
        return run_demo(options, lambda line: print(line, flush=True))
    except DemoError as e:
        print(f"rankscope demo: {e}", file=sys.stderr)
        return 1


def _command_name() -> str:
    """How the user ran us, for the follow-up commands (``.venv/bin/rankscope`` under ``make demo``)."""
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 if Path(argv0).name == "rankscope" else "rankscope"
