"""``rankscope diagnose``: run every detector over one stored run and print its incidents.

The same detectors the collector runs live, read through the collector (default), a ClickHouse
server or an embedded store, replayed over the run's steps (``postmortem.replay``: episodes that
closed are listed with their span), then set beside the incidents the live diagnosis stored: any
raised on one side only is printed as a disagreement. ``--format json`` prints exactly one JSON
array on stdout: the offline incidents, then those raised live only, each with ``seen`` (``live and
offline``, ``offline only``, ``live only``).
Exit status: 0 (incidents or not), 1 when the data cannot be reached, 2 for an unknown run.
Telemetry that ended processes left unsent in this host's spool (RANKSCOPE_SPOOL_DIR) is not in
the store yet: a line on stderr says so, and how to send it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from rankscope.cli import source
from rankscope.cli.args import add_thresholds, thresholds
from rankscope.common.incidents import Incident, headline

if TYPE_CHECKING:
    from rankscope.collector.diagnosis import postmortem

HELP = "name the rank and host behind the stragglers, hangs, crashes, NaNs and slow links of a run"
EXTRA = "collector"

LATEST_RUN_SQL = "SELECT run_id FROM runs GROUP BY run_id ORDER BY min(start_time) DESC LIMIT 1"
RUN_SQL = "SELECT argMax(status, updated) AS status FROM runs WHERE run_id = {run:String}"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", metavar="RUN", help="the run id (default: the latest run)")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    add_thresholds(parser)
    source.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from rankscope.collector.client import QueryFailed
    from rankscope.collector.diagnosis import postmortem

    _warn_unsent()
    try:
        reader = source.open_reader(args)
        try:
            run_id = args.run or _latest(reader)
            if run_id is None:
                print("rankscope diagnose: no runs stored yet", file=sys.stderr)
                return 2
            status = reader.query(RUN_SQL, {"run": run_id}).to_pylist()
            if not status or not status[0]["status"]:  # argMax over no rows is the empty string
                print(f"rankscope diagnose: no run {run_id!r} in the store (rankscope sql \"SELECT DISTINCT run_id FROM runs\" lists them)",
                      file=sys.stderr)  # fmt: skip
                return 2
            settings = thresholds(args)
            query = lambda sql, params: reader.query(sql, params)  # noqa: E731
            over = status[0]["status"] in ("finished", "failed")
            found = postmortem.compare(postmortem.replay(run_id, query, settings, over=over), postmortem.live(run_id, query))
        finally:
            reader.close()
    except QueryFailed as e:
        print(f"rankscope diagnose: {e}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps([{**i.as_json(), "seen": seen} for i, seen in _seen(found)], default=str))
        return 0
    incidents = found.offline
    if not incidents:
        print(f"run {run_id} ({status[0]['status']}): no incidents")
    else:
        print(f"run {run_id} ({status[0]['status']}): {len(incidents)} incident{'s' if len(incidents) != 1 else ''}")
    for i in incidents:
        _print(i)
    _print_comparison(found)
    return 0


def _seen(found: postmortem.Comparison) -> list[tuple[Incident, str]]:
    """Each incident with where it was raised: the offline ones, then those raised live only."""
    alone = {id(i) for i in found.offline_only}
    return [(i, "offline only" if id(i) in alone else "live and offline") for i in found.offline] + [(i, "live only") for i in found.live_only]


def _print(incident: Incident) -> None:
    f, shown = incident.finding, incident.as_json()
    print(f"\n[{f.severity}, {incident.status}] {headline(f.kind, f.summary)}")
    print(f"  ranks {', '.join(map(str, f.ranks))}; hosts {', '.join(f.hosts) or '?'}; first seen {shown['first_seen']}, last seen {shown['last_seen']}")
    print(f"  evidence: rankscope sql {json.dumps(f.sql)}")


def _print_comparison(found: postmortem.Comparison) -> None:
    """Where the live diagnosis said otherwise: what it raised that this pass did not find, and the reverse."""
    if found.agrees:
        print("\nthe live diagnosis raised the same incidents (kind, ranks, hosts)")
        return
    print(f"\ndisagreement with the live diagnosis: {len(found.live_only)} raised live only, {len(found.offline_only)} found offline only")
    for label, incidents in (("raised live only", found.live_only), ("found offline only", found.offline_only)):
        for i in incidents:
            print(f"  {label}: [{i.status}] {i.finding.kind} on ranks {list(i.finding.ranks)} hosts {list(i.finding.hosts)}: {i.finding.summary}")


def _latest(reader: object) -> str | None:
    rows = reader.query(LATEST_RUN_SQL, {}).to_pylist()  # type: ignore[attr-defined]
    return rows[0]["run_id"] if rows else None


def _warn_unsent() -> None:
    """One line on stderr when ended processes left telemetry in this host's spool (a collector that
    was away or too busy to acknowledge): the run may be missing it."""
    from rankscope.agent.config import default_spool_dir
    from rankscope.agent.spool import leftovers

    directory = Path(os.environ.get("RANKSCOPE_SPOOL_DIR") or default_spool_dir())
    try:
        left = leftovers(directory) if directory.is_dir() else []
    except OSError:
        return  # another user's directory, say: nothing to tell from here
    if left:
        print(f"rankscope diagnose: {len(left)} spool segment file(s) in {directory} hold telemetry not sent yet: "
              f"runs may be missing it (`rankscope spool replay {directory}` sends it)", file=sys.stderr)  # fmt: skip
