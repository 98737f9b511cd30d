"""``rankscope selfcheck``: short, bounded tests on suspect hosts, each figure judged against its peers.

With ``--testbed`` (or ``--host``) it checks hosts of a test bed, each test run inside its host;
without, it checks this machine alone (no peer: the figures are printed, not judged). Prints one
table and one verdict line per host (``--json``: one JSON object). ``--collector ADDRESS --run
RUN`` also stores each host's result. Exit status: 0 when every host checked passes, 1 when one
fails (or the results cannot be stored), 2 on bad input. The work is ``rankscope.healing.selfcheck``
(the verdict: ``rankscope.healing.verdict``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING

from rankscope.cli.args import above, count, seconds

if TYPE_CHECKING:
    from rankscope.healing.verdict import Report

HELP = "test suspect hosts (matmul, memory, loopback all-reduce, links) against their peers and name the bad ones"
EXTRA = "collector"  # to store the results (--collector) only

PROG = "rankscope selfcheck"
#: rankscope.healing.selfcheck's TIMEOUT_S and rankscope.healing.verdict's FACTOR (not imported here: a command module imports
#: nothing at load; a test keeps them equal)
TIMEOUT_S = 60.0
FACTOR = 2.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--testbed", nargs="?", const="", default=None, metavar="NAME",
                        help="check hosts of this test bed (with no NAME: the only one up); without --testbed or --host: this machine alone")
    parser.add_argument("--host", action="append", default=[], metavar="HOST",
                        help="a test bed host to check, by name or index (repeatable; default: every host of the test bed)")
    parser.add_argument("--ranks-per-host", type=count(2), metavar="N",
                        help="processes of the loopback all-reduce (default: the test bed's ranks per host, at least 2; "
                             "on this machine one per GPU, else 2)")
    parser.add_argument("--timeout", type=seconds, default=TIMEOUT_S, metavar="SECONDS",
                        help=f"the most each test may take on a host: one that gives no answer in time fails (default: {TIMEOUT_S:g})")
    parser.add_argument("--factor", type=above(1), default=FACTOR,
                        help=f"a figure fails when it is worse than its peers' median by more than this factor (default: {FACTOR:g})")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where matmul and the all-reduce run (default: auto, CUDA where there is one)")
    parser.add_argument("--no-links", action="store_true", help="skip the link tests between the hosts")
    parser.add_argument("--collector", metavar="ADDRESS", help="store each host's result at this collector (HOST:PORT or unix:PATH); needs --run")
    parser.add_argument("--run", metavar="RUN", help="the run the stored results belong to (with --collector)")
    parser.add_argument("--token", default=os.environ.get("RANKSCOPE_TOKEN") or None,
                        help="the collector's token (default: $RANKSCOPE_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")  # fmt: skip


def _bad(message: str) -> int:
    print(f"{PROG}: error: {message} (see {PROG} --help)", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if bool(args.collector) != bool(args.run):
        return _bad("--collector and --run go together")
    from rankscope.healing import selfcheck
    from rankscope.testbed.healing_fleet import TestbedRunner

    if args.testbed is None and not args.host:
        report = selfcheck.check_local(ranks=args.ranks_per_host or 0, timeout_s=args.timeout, device=args.device)
    else:
        from rankscope.testbed import hosts

        try:
            bed = hosts.load(args.testbed or None)
        except hosts.TestbedError as e:
            return _bad(str(e))
        try:
            names = list(dict.fromkeys(bed.host(int(h) if h.isdigit() else h).name for h in args.host)) or [h.name for h in bed.hosts]
        except KeyError as e:
            return _bad(str(e.args[0]))
        missing = [h.namespace for h in bed.hosts if h.name in names and not h.cgroup("freezer").is_dir()]
        if missing:
            return _bad(f"test bed {bed.name} is not up ({', '.join(missing)} is gone): rankscope testbed up makes one")
        ranks = args.ranks_per_host or max(2, bed.ranks_per_host)
        report = selfcheck.check_hosts(names, TestbedRunner(bed), ranks=ranks, timeout_s=args.timeout, factor=args.factor,
                                       links=not args.no_links, device=args.device)  # fmt: skip
    if args.json:
        print(json.dumps(report.as_json()))
    else:
        print(table(report))
    if args.collector:
        stored = _store(report, args)
        if stored:
            return stored
    return 0 if report.passed else 1


def _store(report: Report, args: argparse.Namespace) -> int:
    from rankscope.collector.client import Client, QueryFailed

    try:
        with Client(args.collector, token=args.token) as client:
            for host in report.hosts:
                client.send(host.batch(args.run))
    except QueryFailed as e:
        print(f"{PROG}: cannot store the results: {e}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"stored {len(report.hosts)} host result{'s' if len(report.hosts) != 1 else ''} for run {args.run} at {args.collector}")
    return 0


def table(report: Report) -> str:
    """One row per figure (host, check, value, unit, peers' median, ok), then one verdict line per host."""
    from rankscope.healing.verdict import figure_text

    rows = [("host", "check", "value", "unit", "peers' median", "ok")]
    for h in report.hosts:
        for f in h.figures:
            ok = "FAIL" if not f.passed else "-" if math.isnan(f.reference) else "yes"  # -: not judged
            rows.append((h.host, f.check, figure_text(f.value), f.unit, figure_text(f.reference), ok))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {2, 4}
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    for h in report.hosts:
        verdict = "FAIL" if not h.passed else "PASS" if h.judged else "not judged"
        lines.append(f"{h.host} {verdict}: {h.summary}")
    return "\n".join(lines)
