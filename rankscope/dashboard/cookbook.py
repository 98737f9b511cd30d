"""Example queries for post mortems: the dashboard's SQL page offers them and docs/sql.md prints them.

This is their one source: ``python -m rankscope.dashboard.cookbook`` prints the Markdown that
docs/sql.md carries between its cookbook markers (a test keeps the two equal), and every query
runs on a real recorded run in the test suite.

``{name:Type}`` placeholders are bound by the engine: ``run`` is the run the page shows, the
others get an input field pre-filled from that run (``Example.defaults`` names which value).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    title: str
    why: str
    sql: str
    #: placeholder -> which value of the run fills it at first ("host", "group", "seq")
    defaults: dict[str, str] = field(default_factory=dict)


EXAMPLES: tuple[Example, ...] = (
    Example(
        "Slowest ranks per step",
        "The three ranks per step whose compute took longest against the median of their pipeline stage "
        "(CPU time where every piece had it measured, else wall time): a straggler tops many steps.",
        """WITH per_rank AS (
    SELECT step, rank, if(sum(cpu_pieces) = sum(pieces), sum(total_cpu_ns), sum(total_ns)) AS ns
    FROM step_segments WHERE run_id = {run:String} AND kind = 'compute' GROUP BY step, rank
), who AS (
    SELECT rank, argMax(host, registered) AS host, argMax(pp_rank, registered) AS stage
    FROM ranks WHERE run_id = {run:String} GROUP BY rank
)
SELECT p.step AS step, p.rank AS rank, w.host AS host, w.stage AS stage, round(p.ns / 1e6, 1) AS compute_ms,
       round(p.ns / median(p.ns) OVER (PARTITION BY p.step, w.stage), 3) AS vs_stage_median
FROM per_rank AS p INNER JOIN who AS w ON w.rank = p.rank
ORDER BY step, vs_stage_median DESC
LIMIT 3 BY step""",
    ),
    Example(
        "Collective arrival skew for one group and sequence",
        "Every member of one collective (a group and its sequence number): when each arrived and how long after "
        "the first; the last to arrive is the one the others waited for.",
        """SELECT rank, op, issue_time, end_time,
       round((toUnixTimestamp64Nano(issue_time) - min(toUnixTimestamp64Nano(issue_time)) OVER ()) / 1e6, 3) AS arrived_after_first_ms,
       round((toUnixTimestamp64Nano(end_time) - toUnixTimestamp64Nano(issue_time)) / 1e6, 3) AS inside_ms
FROM collectives
WHERE run_id = {run:String} AND group_name = {group:String} AND seq = {seq:Int64}
ORDER BY issue_time""",
        {"group": "group", "seq": "seq"},
    ),
    Example(
        "The last heartbeat of every rank",
        "Who went quiet first, and what each rank was doing then: its step, phase and the operations in flight.",
        """SELECT rank, argMax(host, time) AS host, max(time) AS last_heartbeat, argMax(step, time) AS step,
       argMax(phase, time) AS phase, argMax(status, time) AS status,
       argMax(arrayZip(inflight_op, inflight_group, inflight_seq, inflight_waiting), time) AS in_flight
FROM heartbeats WHERE run_id = {run:String}
GROUP BY rank ORDER BY last_heartbeat""",
    ),
    Example(
        "GPU temperature of one host",
        "Each GPU of a host, minute by minute: the mean and the peak temperature (thermal throttling starts near the peak).",
        """SELECT device, toStartOfMinute(time) AS minute, round(avg(value), 1) AS mean_c, max(value) AS peak_c
FROM metrics
WHERE run_id = {run:String} AND host = {host:String} AND name = 'hw.temperature'
GROUP BY device, minute ORDER BY device, minute""",
        {"host": "host"},
    ),
    Example(
        "Incidents of the run",
        "Every incident as the diagnosis last wrote it (the table keeps versions: FINAL reads the newest).",
        """SELECT kind, status, ranks, hosts, first_seen, last_seen, summary
FROM incidents FINAL WHERE run_id = {run:String} ORDER BY first_seen""",
    ),
    Example(
        "How every rank ended",
        "Each rank's end as its agent reported it: normally, with an exit code, an exception or a signal. "
        "The first abnormal end is usually the culprit, the ranks the launcher then stopped its victims.",
        """SELECT rank, host, time, reason, exit_code, signal, message
FROM exits WHERE run_id = {run:String} ORDER BY time""",
    ),
)

PLACEHOLDER = re.compile(r"\{(\w+):([^}]+)\}")


def placeholders(sql: str) -> dict[str, str]:
    """name -> ClickHouse type of each ``{name:Type}`` in ``sql``, in order of appearance."""
    return {name: kind.strip() for name, kind in PLACEHOLDER.findall(sql)}


def value(text: str, kind: str) -> object:
    """The Python value for a placeholder of type ``kind`` typed as ``text``; ValueError if it is none."""
    if re.match(r"(Nullable\()?U?Int\d+", kind):
        return int(text)
    if re.match(r"(Nullable\()?(Float|Decimal)", kind):
        return float(text)
    if kind.startswith("Array"):
        parsed = json.loads(text)
        if not isinstance(parsed, list):
            raise ValueError(f"expected a JSON list such as [1, 2], got {text!r}")
        return parsed
    return text


#: the lines between which docs/sql.md carries ``markdown()``
MARKERS = ("<!-- cookbook: generated by python -m rankscope.dashboard.cookbook -->", "<!-- end of cookbook -->")


def markdown() -> str:
    """The cookbook as docs/sql.md prints it: a heading, the reason and the query of each example."""
    parts = [MARKERS[0]]
    for example in EXAMPLES:
        parts.append(f"### {example.title}\n\n{example.why}\n\n```sql\n{example.sql}\n```")
    parts.append(MARKERS[1])
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
