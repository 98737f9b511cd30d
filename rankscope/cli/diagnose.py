"""``rankscope diagnose``: run every detector over one stored run and print its incidents.

The same detectors the collector runs live, read through the collector (default), a ClickHouse
server or an embedded store. ``--format json`` prints exactly one JSON array on stdout.
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

from rankscope.cli import source
from rankscope.cli.args import add_thresholds, thresholds

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
    from rankscope.collector.diagnosis.engine import diagnose
    from rankscope.collector.diagnosis.ledger import Ledger
    from rankscope.common.incidents import headline

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
            findings = diagnose(run_id, lambda sql, params: reader.query(sql, params), settings)
        finally:
            reader.close()
    except QueryFailed as e:
        print(f"rankscope diagnose: {e}", file=sys.stderr)
        return 1
    over = status[0]["status"] in ("finished", "failed")
    incidents, _ = Ledger(run_id).update(findings, final=over)
    if args.format == "json":
        print(json.dumps([i.as_json() for i in incidents], default=str))
        return 0
    if not incidents:
        print(f"run {run_id} ({status[0]['status']}): no incidents")
        return 0
    print(f"run {run_id} ({status[0]['status']}): {len(incidents)} incident{'s' if len(incidents) != 1 else ''}")
    for i in incidents:
        f = i.finding
        print(f"\n[{f.severity}] {headline(f.kind, f.summary)}")
        print(f"  ranks {', '.join(map(str, f.ranks))}; hosts {', '.join(f.hosts) or '?'}; "
              f"first seen {i.as_json()['first_seen']}, last seen {i.as_json()['last_seen']}")  # fmt: skip
        print(f"  evidence: rankscope sql {json.dumps(f.sql)}")
    return 0


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
