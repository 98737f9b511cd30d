"""``rankscope anatomy``: where a run's step time goes, the critical path of a step, and the waterfall.

Reads through the collector (default), a ClickHouse server or an embedded store, as ``rankscope
diagnose`` does. ``--step N`` or ``--steps A-B`` (default: every step of the run, but the one in
progress while it runs); the critical path is that of ``--step``, or of the range's median step.
``--format json`` prints exactly one JSON object on stdout.
Exit status: 0, 1 when the data cannot be reached, 2 for an unknown run or steps without data.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from rankscope.cli import source

if TYPE_CHECKING:
    from rankscope.collector.anatomy import Anatomy

HELP = "where a run's step time goes (compute, exposed communication, bubble, ...), the critical path of a step, the MFU waterfall"
EXTRA = "collector"

LATEST_RUN_SQL = "SELECT run_id FROM runs GROUP BY run_id ORDER BY min(start_time) DESC LIMIT 1"
RUN_SQL = "SELECT argMax(status, updated) AS status FROM runs WHERE run_id = {run:String}"
HOSTS_SQL = "SELECT rank, argMax(host, registered) AS host FROM ranks WHERE run_id = {run:String} AND rank IN {ranks:Array(UInt32)} GROUP BY rank"
#: the per-rank table prints at most this many ranks (``--format json`` has them all)
RANK_ROWS = 16
STEP_ROWS = 40


def steps(text: str) -> tuple[int, int]:
    """``A-B``: steps A to B (A <= B), numbered from 1."""
    first, sep, last = text.partition("-")
    try:
        a, b = int(first), int(last if sep else first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected steps as A-B (such as 10-20), got {text!r}") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected steps A-B with 1 <= A <= B, got {text!r}")
    return a, b


def step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"steps are numbered from 1, got {value}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", metavar="RUN", help="the run id (default: the latest run)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", metavar="N", type=step, help="one step (its breakdown and critical path)")
    which.add_argument("--steps", metavar="A-B", type=steps,
                       help="a range of steps (default: the whole run); the critical path is its median step's")  # fmt: skip
    parser.add_argument("--format", choices=("table", "json"), default="table")
    source.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from rankscope.collector.anatomy import anatomy, step_range
    from rankscope.collector.client import QueryFailed

    try:
        reader = source.open_reader(args)
        try:
            query = lambda sql, params: reader.query(sql, params)
            run_id = args.run or _latest(reader)
            if run_id is None:
                return _fail("no runs stored yet")
            status = query(RUN_SQL, {"run": run_id}).to_pylist()
            if not status or not status[0]["status"]:  # argMax over no rows is the empty string
                return _fail(f"no run {run_id!r} in the store (rankscope sql \"SELECT DISTINCT run_id FROM runs\" lists them)")
            stored = step_range(query, run_id)
            if stored is None:
                return _fail(f"run {run_id!r} has no steps recorded")
            if args.step is not None:
                first, last = args.step, args.step
            elif args.steps is not None:
                first, last = args.steps
            else:
                first, last = stored
                if status[0]["status"] == "running" and last > first:
                    last -= 1  # the newest step is still in progress
            if last < stored[0] or first > stored[1]:
                return _fail(f"run {run_id!r} has steps {stored[0]}-{stored[1]} recorded, none of {first}-{last}")
            found = anatomy(query, run_id, first, last, path_step=args.step)
            if found.breakdown.total is None:
                return _fail(f"run {run_id!r}: no segments recorded in steps {first}-{last}")
            hosts = _hosts(query, run_id, found)
        finally:
            reader.close()
    except QueryFailed as e:
        print(f"rankscope anatomy: {e}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps({**found.as_json(), "status": status[0]["status"], "hosts": {str(r): h for r, h in hosts.items()}}))
        return 0
    print("\n".join(render(found, status[0]["status"], hosts)))
    return 0


def _fail(message: str) -> int:
    print(f"rankscope anatomy: {message}", file=sys.stderr)
    return 2


def _latest(reader: object) -> str | None:
    rows = reader.query(LATEST_RUN_SQL, {}).to_pylist()  # type: ignore[attr-defined]
    return rows[0]["run_id"] if rows else None


def _hosts(query: object, run_id: str, found: Anatomy) -> dict[int, str]:
    ranks = sorted({link.rank for link in found.path.links} if found.path else set())
    if not ranks:
        return {}
    rows = query(HOSTS_SQL, {"run": run_id, "ranks": ranks}).to_pylist()  # type: ignore[operator]
    return {int(r["rank"]): r["host"] for r in rows}


def render(found: Anatomy, status: str, hosts: dict[int, str]) -> list[str]:
    """The table format's lines."""
    from rankscope.collector.anatomy import CATEGORIES

    b = found.breakdown
    assert b.total is not None
    span = f"step {found.first_step}" if found.first_step == found.last_step else f"steps {found.first_step}-{found.last_step}"
    lines = [f"run {found.run_id} ({status}), {span}: {len(b.by_rank)} ranks", ""]
    header = ["step", "wall_ms", *CATEGORIES]
    lines.append("where the time goes, ms per rank and step (mean over ranks; wall_ms: mean, and the slowest rank's)")
    rows = [[str(s), f"{x.wall_ns / 1e6:.1f} ({x.max_wall_ns / 1e6:.1f})", *(f"{x.ns[c] / 1e6:.1f}" for c in CATEGORIES)]
            for s, x in sorted(b.by_step.items())]  # fmt: skip
    if len(rows) > STEP_ROWS:
        rows = rows[: STEP_ROWS // 2] + [["...", *[""] * (len(header) - 1)]] + rows[-STEP_ROWS // 2 :]
    t = b.total
    rows.append(["all", f"{t.wall_ns / 1e6:.1f} ({t.max_wall_ns / 1e6:.1f})", *(f"{t.ns[c] / 1e6:.1f} ({100 * t.share(c):.0f}%)" for c in CATEGORIES)])
    lines += _table(header, rows)
    lines += ["", "per rank, ms per step (mean over the steps)"]
    ranked = sorted(b.by_rank.items())
    rank_rows = [[str(r), f"{x.wall_ns / 1e6:.1f}", *(f"{x.ns[c] / 1e6:.1f}" for c in CATEGORIES)] for r, x in ranked[:RANK_ROWS]]
    lines += _table(["rank", "wall_ms", *CATEGORIES], rank_rows)
    if len(ranked) > RANK_ROWS:
        lines.append(f"({len(ranked) - RANK_ROWS} more ranks: --format json has them all)")
    lines.append("")
    path = found.path
    if path is None or not path.links:
        lines.append(f"critical path of step {found.path_step}: no timeline recorded")
    else:
        lines.append(f"critical path of step {path.step}{' (the median step)' if found.first_step != found.last_step else ''}: "
                     f"{path.step_ns / 1e6:.1f} ms, {len(path.links)} links across {len({link.rank for link in path.links})} ranks")  # fmt: skip
        path_rows = [[_who(link.rank, hosts), link.what, link.kind, f"{(link.start_ns - path.start_ns) / 1e6:.2f}",
                      f"{link.duration_ns / 1e6:.2f}", "" if link.waited_on is None else _who(link.waited_on, hosts)]
                     for link in path.links]  # fmt: skip
        lines += _table(["rank", "what", "kind", "at_ms", "ms", "waited_on"], path_rows)
        costly = [c for c in path.costs if c.cost_ns > 0][:5]
        if costly:
            lines += ["", "what the links cost the step (their excess over their peers' median)"]
            lines += _table(["rank", "link", "kind", "on_path_ms", "cost_ms", "share"],
                            [[_who(c.rank, hosts), c.key, c.kind, f"{c.on_path_ns / 1e6:.2f}", f"{c.cost_ns / 1e6:.2f}",
                              f"{100 * c.share:.1f}%"] for c in costly])  # fmt: skip
        slowest = path.slowest
        if slowest is not None:
            lines.append(f"slowest link: {path.describe_cost(slowest[0], _who(slowest[0], hosts))}; without it the step would take "
                         f"about {path.without_slowest_ns / 1e6:.1f} ms instead of {path.step_ns / 1e6:.1f} ms")  # fmt: skip
    lines.append("")
    if found.waterfall and found.waterfall[0].unit == "mfu":
        lines.append("MFU waterfall (from the peak, what each category takes away)")
        lines += _table(["", "mfu"], [[bar.label, f"{'' if bar.total else '-'}{100 * bar.value:.2f}%"] for bar in found.waterfall])
    elif found.waterfall:
        lines.append("time waterfall (no MFU reported: the step's time, largest first)")
        lines += _table(["", "ms", "share"], [[bar.label, f"{bar.value:.2f}", f"{100 * (bar.share or 0):.1f}%"] for bar in found.waterfall])
    return lines


def _who(rank: int, hosts: dict[int, str]) -> str:
    return f"{rank} ({hosts[rank]})" if rank in hosts else str(rank)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    fmt = lambda row: "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths))).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]
