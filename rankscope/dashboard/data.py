"""The dashboard's queries: one function per figure or table, each aggregating in SQL.

Every function returns what its figure draws and nothing more (a heat map gets one value per
cell, a timeline only the window it shows), so a page never pulls a whole run across the wire.

Caching: each function is cached twice by Streamlit (``per_run``): briefly (``LIVE_TTL_S``) for a
run that is still going, and for ``SETTLED_TTL_S`` once it is over. The ``Run`` passed in is part
of the cache key, and a live run's ``Run`` changes with every new heartbeat (``last_ns``,
``steps``), so cached answers for a live run also go stale as soon as the run moves on.

Attempts: a run restarted by torchrun's elastic agent (``rankscope launch``) keeps its id, every
per-rank row carries its ``attempt``, and the steps after the last checkpoint are run again, maybe
by fewer ranks numbered anew. What a page shows per step comes from the latest attempt that ran
that step (``_latest``): a step run twice is counted once, as it was last run. Who a rank is comes
from its newest registration (the latest attempt's); a rank only an earlier, larger world had
keeps its last one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import pandas as pd
import streamlit as st

from rankscope.common.incidents import INCIDENTS_SQL, Incident, from_rows
from rankscope.common.node_states import NODES_SQL
from rankscope.dashboard.connection import query

#: seconds a live run's answers are kept (live pages redraw every ui.REFRESH_S)
LIVE_TTL_S = 2.0
#: seconds a finished run's answers are kept (they do not change; this only bounds memory)
SETTLED_TTL_S = 3600.0
#: a run silent this long that never ended (its collector was stopped) is no longer refreshed
STALE_S = 600.0
#: the newest runs listed (older ones stay reachable with ?run=)
RUNS_LISTED = 200

P = ParamSpec("P")
R = TypeVar("R")


def _latest(table: str, where: str, key: str = "step") -> str:
    """A condition keeping, of each ``key`` (a step; or "name, step"), only the rows of the latest
    attempt that ran it: ``where`` filters the rows of ``table`` the same way as the outer query."""
    return f"({key}, attempt) IN (SELECT {key}, max(attempt) FROM {table} WHERE {where} GROUP BY {key})"


@dataclass(frozen=True)
class Run:
    """One run as the pages see it; ``status`` is ``hung`` while a hang incident is open, whatever
    the collector recorded (a hung run killed by its launcher is stored as failed)."""

    id: str
    name: str
    status: str  # running, hung, finished, failed
    start_ns: int
    end_ns: int  # 0 while the run is not over
    last_ns: int  # the newest heartbeat, 0 when none arrived
    world_size: int
    tp: int
    pp: int
    dp: int
    steps: int  # the highest step any rank reached
    open_incidents: int
    incidents: int
    #: the run's latest attempt: how many times it was restarted (torchrun's elastic agent, ``rankscope launch``)
    attempt: int = 0

    @property
    def live(self) -> bool:
        """Whether data may still arrive (not ended, heard from lately): pages refresh only then."""
        return self.end_ns == 0 and time.time_ns() - max(self.last_ns, self.start_ns) < STALE_S * 1e9

    @property
    def duration_s(self) -> float:
        end = self.end_ns or self.last_ns or self.start_ns
        return max(0.0, (end - self.start_ns) / 1e9)


def per_run(fn: Callable[Concatenate[Run, P], R]) -> Callable[Concatenate[Run, P], R]:
    """Cache ``fn(run, ...)`` for a short time while ``run`` is live, for long once it is over."""

    def cache(ttl: float, kind: str) -> Callable[Concatenate[Run, P], R]:
        def call(run: Run, *args: P.args, **kwargs: P.kwargs) -> R:
            return fn(run, *args, **kwargs)

        # Streamlit keys a cache by the function's name and source, and replaces a cache asked for
        # with another TTL: each of the two needs a name of its own.
        call.__module__, call.__qualname__ = fn.__module__, f"{fn.__qualname__}.{kind}"
        return st.cache_data(ttl=ttl, max_entries=256, show_spinner=False)(call)

    live, settled = cache(LIVE_TTL_S, "live"), cache(SETTLED_TTL_S, "settled")

    @functools.wraps(fn)
    def call(run: Run, *args: P.args, **kwargs: P.kwargs) -> R:
        return (live if run.live else settled)(run, *args, **kwargs)

    return call


# --- runs -------------------------------------------------------------------------------------

RUNS_SQL = """
SELECT r.run_id AS id, r.name AS name, r.status AS stored_status,
       toUnixTimestamp64Nano(r.start_time) AS start_ns, toUnixTimestamp64Nano(r.end_time) AS end_ns,
       r.world_size AS world_size, r.tp AS tp, r.pp AS pp, r.dp AS dp,
       h.steps AS steps, h.last_ns AS last_ns,
       i.open_incidents AS open_incidents, i.open_hangs AS open_hangs, i.incidents AS incidents, a.attempt AS attempt
FROM (SELECT * FROM runs FINAL ORDER BY start_time DESC LIMIT {limit:UInt32}) AS r
LEFT JOIN (
    SELECT run_id, max(step) AS steps, toUnixTimestamp64Nano(max(time)) AS last_ns FROM heartbeats
    WHERE run_id IN (SELECT run_id FROM runs FINAL ORDER BY start_time DESC LIMIT {limit:UInt32}) GROUP BY run_id
) AS h ON h.run_id = r.run_id
LEFT JOIN (
    SELECT run_id, countIf(status = 'open') AS open_incidents, countIf(status = 'open' AND kind = 'hang') AS open_hangs,
           count() AS incidents
    FROM incidents FINAL GROUP BY run_id
) AS i ON i.run_id = r.run_id
LEFT JOIN (
    SELECT run_id, max(attempt) AS attempt FROM ranks
    WHERE run_id IN (SELECT run_id FROM runs FINAL ORDER BY start_time DESC LIMIT {limit:UInt32}) GROUP BY run_id
) AS a ON a.run_id = r.run_id
ORDER BY r.start_time DESC
"""


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def runs() -> list[Run]:
    """The newest runs, newest first (the list every page's run picker shows)."""
    rows = query(RUNS_SQL, {"limit": RUNS_LISTED})
    return [_run(r) for r in rows.to_dict("records")]


def _run(r: dict[str, Any]) -> Run:
    status = "hung" if r["open_hangs"] else r["stored_status"]
    world, tp, pp, dp = int(r["world_size"]), max(int(r["tp"]), 1), max(int(r["pp"]), 1), max(int(r["dp"]), 1)
    if tp * pp * dp != world and world % (tp * pp) == 0:  # no 3D layout declared (plain DDP, 1 x 1 x 1): the rest is data parallel
        dp = world // (tp * pp)
    return Run(
        id=r["id"], name=r["name"], status=status, start_ns=int(r["start_ns"]), end_ns=max(int(r["end_ns"]), 0),
        last_ns=int(r["last_ns"]), world_size=world, tp=tp, pp=pp, dp=dp,
        steps=int(r["steps"]), open_incidents=int(r["open_incidents"]), incidents=int(r["incidents"]), attempt=int(r["attempt"]),
    )  # fmt: skip


# --- incidents --------------------------------------------------------------------------------


@per_run
def incidents(run: Run) -> list[Incident]:
    """Every incident of the run, open ones first, then by first sighting."""
    found = from_rows(query(INCIDENTS_SQL, {"run": run.id}).to_dict("records"))
    return sorted(found, key=lambda i: (i.status != "open", i.finding.first_seen_ns))


STACKS_SQL = (
    "SELECT rank, host, toUnixTimestamp64Nano(time) AS time_ns, reason, method, text FROM stacks "
    "WHERE run_id = {run:String} AND rank IN {ranks:Array(UInt32)} ORDER BY time DESC LIMIT 8"
)


@per_run
def stacks(run: Run, ranks: tuple[int, ...]) -> pd.DataFrame:
    """The newest stack dumps of ``ranks`` (py-spy or Python's own frames)."""
    return query(STACKS_SQL, {"run": run.id, "ranks": list(ranks)})


LATEST_COLLECTIVE_SQL = (
    "SELECT group_name, seq FROM collectives WHERE run_id = {run:String} AND rank = 0 AND peer = -1 "
    "ORDER BY issue_time DESC LIMIT 1"
)


@per_run
def latest_collective(run: Run) -> tuple[str, int] | None:
    """(group, seq) of rank 0's newest collective: a real example for the SQL cookbook."""
    rows = query(LATEST_COLLECTIVE_SQL, {"run": run.id})
    return (str(rows.iloc[0]["group_name"]), int(rows.iloc[0]["seq"])) if len(rows) else None


# --- topology ---------------------------------------------------------------------------------

# A rank's place, by its newest registration. A job that declared no 3D layout (plain DDP) registers
# its ranks at tp, pp and dp -1: each rank is then a data-parallel replica of its own (dp = rank), at
# tp 0 and pp -1 (no stage: ``figures.stage_name``).
PLACE = (
    "greatest(argMax(tp_rank, registered), 0) AS tp, argMax(pp_rank, registered) AS pp, "
    "if(argMax(dp_rank, registered) < 0, rank, argMax(dp_rank, registered)) AS dp"
)
# The newest registration of each rank: after a restart, the latest attempt's (a later attempt
# always registers with a higher version).
RANKS_SQL = (
    "SELECT rank, argMax(host, registered) AS host, argMax(pid, registered) AS pid, argMax(device, registered) AS device, "
    f"{PLACE}, argMax(attempt, registered) AS attempt FROM ranks WHERE run_id = {{run:String}} GROUP BY rank ORDER BY rank"
)


@per_run
def ranks(run: Run) -> pd.DataFrame:
    """Who each rank is: rank, host, pid, device, tp, pp, dp, attempt (of its newest registration)."""
    return query(RANKS_SQL, {"run": run.id})


# --- overview ---------------------------------------------------------------------------------

OVERVIEW_METRICS = ("step_time_s", "tokens_per_s", "mfu", "loss", "grad_norm")
STEP_METRICS_SQL = """
SELECT intDiv(step - 1, {every:UInt32}) * {every:UInt32} + 1 AS first_step, name,
       median(value) AS mid, min(value) AS low, max(value) AS high, uniqExact(rank) AS ranks
FROM step_metrics
WHERE run_id = {run:String} AND name IN {names:Array(String)} AND isFinite(value)
  AND """ + _latest("step_metrics", "run_id = {run:String} AND name IN {names:Array(String)}", "name, step") + """
GROUP BY first_step, name ORDER BY name, first_step
"""
#: points per line on the overview: longer runs are averaged over buckets of steps
OVERVIEW_POINTS = 2000


@per_run
def step_metrics(run: Run) -> pd.DataFrame:
    """first_step, name, mid (median over ranks), low, high, ranks; long runs in buckets of steps."""
    every = max(1, -(-run.steps // OVERVIEW_POINTS))
    return query(STEP_METRICS_SQL, {"run": run.id, "names": list(OVERVIEW_METRICS), "every": every})


# --- heat map ---------------------------------------------------------------------------------

# (total_s orders the names only: time spent in a step run twice was spent twice)
SEGMENTS_SQL = (
    "SELECT name, any(kind) AS kind, sum(total_ns) / 1e9 AS total_s, max(step) AS last_step FROM step_segments WHERE run_id = {run:String} "
    "GROUP BY name ORDER BY kind != 'compute', total_s DESC"
)


@per_run
def segments(run: Run) -> pd.DataFrame:
    """The segment names of the run (compute first, biggest first): name, kind, total_s, last_step."""
    return query(SEGMENTS_SQL, {"run": run.id})


# Each rank's time in the segment per step, divided by the median of its pipeline stage in that
# step: ranks of one stage do the same work, so 1.0 is normal and 1.3 is 30% slow. CPU time when
# every piece of the segment had it measured (host-only runs on shared cores), else wall time.
# A step run again after a restart counts as the latest attempt ran it. A row (rank) is named by
# the rank's newest registration; a cell is compared within the stage, and put on the host, that
# the rank had in the cell's attempt while the store still holds that registration (the ranks table
# keeps only the newest once merged).
_SEGMENT_STEPS = "run_id = {run:String} AND name = {segment:String} AND step BETWEEN {first:UInt32} AND {last:UInt32}"
HEAT_CELLS_SQL = f"""
WITH cells AS (
    SELECT attempt, step, rank, sum(total_ns) AS wall, sum(total_cpu_ns) AS cpu, sum(pieces) = sum(cpu_pieces) AS has_cpu
    FROM step_segments
    WHERE {_SEGMENT_STEPS} AND {_latest("step_segments", _SEGMENT_STEPS)}
    GROUP BY attempt, step, rank
),
who AS (
    SELECT rank, argMax(host, registered) AS host, argMax(pp_rank, registered) AS pp FROM ranks
    WHERE run_id = {{run:String}} GROUP BY rank
),
was AS (
    SELECT rank, attempt, argMax(host, registered) AS host, argMax(pp_rank, registered) AS pp, 1 AS known FROM ranks
    WHERE run_id = {{run:String}} GROUP BY rank, attempt
),
timed AS (
    SELECT c.step AS step, c.rank AS rank, w.host AS host, w.pp AS pp, if(v.known = 1, v.host, w.host) AS cell_host,
           if(v.known = 1, v.pp, w.pp) AS cell_pp, if(min(c.has_cpu) OVER () = 1, c.cpu, c.wall) AS ns,
           min(c.has_cpu) OVER () = 1 AS cpu_time
    FROM cells AS c LEFT JOIN who AS w ON w.rank = c.rank LEFT JOIN was AS v ON v.rank = c.rank AND v.attempt = c.attempt
),
rated AS (
    SELECT step, rank, host, cell_host, pp AS stage, ns AS cell_ns, cpu_time,
           ns / nullIf(median(ns) OVER (PARTITION BY step, cell_pp), 0) AS cell_ratio
    FROM timed
)
"""
HEAT_BY = {
    # one row per rank
    "rank": "SELECT step, toString(rank) AS row, rank, host, stage AS pp, cell_ns AS ns, cell_ratio AS ratio, cpu_time FROM rated",
    # one row per host: its slowest rank (a straggler must not be averaged away); grouped by the
    # host as LowCardinality: a third faster than by the plain string (1,024 ranks x 500 steps)
    "host": "SELECT step, any(h) AS row, argMax(rank, cell_ratio) AS rank, any(h) AS host, min(stage) AS pp, max(cell_ns) AS ns, "
    "max(cell_ratio) AS ratio, any(cpu_time) AS cpu_time FROM (SELECT *, cell_host AS h FROM rated) GROUP BY step, toLowCardinality(h)",
}


#: the heat map's steps at first (the newest ones); the slider widens the window
HEAT_STEPS = 100
#: above this many ranks the heat map starts with a row per host (its slowest rank)
HEAT_RANK_ROWS_UP_TO = 1024


def heat_first_view(world_size: int, last_step: int) -> tuple[str, int, int]:
    """How the heat map first draws a job of ``world_size`` ranks at ``last_step``: rows by rank or
    host, and its first and last step."""
    return "rank" if world_size <= HEAT_RANK_ROWS_UP_TO else "host", max(1, last_step - HEAT_STEPS + 1), last_step


@per_run
def heat_cells(run: Run, segment: str, first: int, last: int, by: str) -> pd.DataFrame:
    """step, row, rank, host, pp, ns, ratio (to the stage median), cpu_time; one row per cell.

    ``by``: "rank" (a row per rank) or "host" (a row per host, its slowest rank's cell).
    """
    sql = HEAT_CELLS_SQL + HEAT_BY[by]
    return query(sql, {"run": run.id, "segment": segment, "first": first, "last": last})


# --- timeline ---------------------------------------------------------------------------------

_STEPS = "run_id = {run:String} AND step BETWEEN {first:UInt32} AND {last:UInt32}"
# (the steps as the latest attempt that ran them ran them: not from a first run to a rerun)
WINDOW_SQL = (
    "SELECT toUnixTimestamp64Nano(min(first_start)) AS start_ns, toUnixTimestamp64Nano(max(last_end)) AS end_ns "
    f"FROM step_segments WHERE {_STEPS} AND {_latest('step_segments', _STEPS)}"
)
# (the newest step of the newest attempt begun by then: an earlier attempt may have gone further)
STEP_AT_SQL = (
    "SELECT argMax(step, (attempt, step)) AS step FROM step_segments "
    "WHERE run_id = {run:String} AND first_start <= fromUnixTimestamp64Nano({at:Int64})"
)


@per_run
def window(run: Run, first: int, last: int) -> tuple[int, int]:
    """(start, end) in ns of steps ``first`` .. ``last`` on any rank; (0, 0) when they have no spans."""
    row = query(WINDOW_SQL, {"run": run.id, "first": first, "last": last}).iloc[0]
    start, end = int(row["start_ns"] or 0), int(row["end_ns"] or 0)
    return (start, end) if start > 0 and end > start else (0, 0)


@per_run
def step_at(run: Run, at_ns: int) -> int:
    """The step running at ``at_ns`` (the newest step begun by then; 1 before any)."""
    step = query(STEP_AT_SQL, {"run": run.id, "at": at_ns}).iloc[0]["step"]
    return max(1, int(step or 1))


# Spans and operations are read by time on the chosen ranks: (run_id, rank, time) is the sort
# key of both tables, so ClickHouse reads only that window.
SPANS_SQL = """
SELECT rank, step, name, kind, microbatch, toUnixTimestamp64Nano(start_time) AS start_ns, toUnixTimestamp64Nano(end_time) AS end_ns
FROM spans
WHERE run_id = {run:String} AND rank IN {ranks:Array(UInt32)}
  AND start_time <= fromUnixTimestamp64Nano({end:Int64}) AND end_time >= fromUnixTimestamp64Nano({start:Int64})
ORDER BY rank, start_time
"""
OPS_SQL = """
SELECT rank, group_name, seq, op, peer, nbytes, state, step, attempt, toUnixTimestamp64Nano(issue_time) AS issue_ns,
       toUnixTimestamp64Nano(start_time) AS start_ns, toUnixTimestamp64Nano(end_time) AS end_ns
FROM collectives
WHERE run_id = {run:String} AND rank IN {ranks:Array(UInt32)}
  AND issue_time BETWEEN fromUnixTimestamp64Nano({start:Int64}) AND fromUnixTimestamp64Nano({end:Int64})
ORDER BY rank, issue_time
"""
# The matched collectives of the window (same group and sequence on every member, in one attempt:
# a restart numbers them anew), the spread of the members' arrivals and who came last: the rank the
# others waited for.
SKEW_SQL = """
SELECT group_name, seq, any(op) AS op, count() AS members,
       (max(toUnixTimestamp64Nano(issue_time)) - min(toUnixTimestamp64Nano(issue_time))) / 1e6 AS skew_ms,
       argMax(rank, issue_time) AS last_rank, argMin(rank, issue_time) AS first_rank,
       toUnixTimestamp64Nano(max(issue_time)) AS last_issue_ns
FROM collectives
WHERE run_id = {run:String} AND peer = -1
  AND issue_time BETWEEN fromUnixTimestamp64Nano({start:Int64}) AND fromUnixTimestamp64Nano({end:Int64})
GROUP BY attempt, group_name, seq HAVING members > 1
ORDER BY skew_ms DESC LIMIT {limit:UInt32}
"""


@per_run
def spans(run: Run, rank_list: tuple[int, ...], start_ns: int, end_ns: int) -> pd.DataFrame:
    """rank, step, name, kind, microbatch, start_ns, end_ns of the spans in the window."""
    return query(SPANS_SQL, {"run": run.id, "ranks": list(rank_list), "start": start_ns, "end": end_ns})


@per_run
def operations(run: Run, rank_list: tuple[int, ...], start_ns: int, end_ns: int) -> pd.DataFrame:
    """Collectives and point-to-point operations issued in the window by ``rank_list``."""
    return query(OPS_SQL, {"run": run.id, "ranks": list(rank_list), "start": start_ns, "end": end_ns})


@per_run
def arrival_skew(run: Run, start_ns: int, end_ns: int, limit: int = 12) -> pd.DataFrame:
    """The collectives of the window with the widest arrival spread, all members counted."""
    return query(SKEW_SQL, {"run": run.id, "start": start_ns, "end": end_ns, "limit": limit})


# --- 3D-parallel graph ------------------------------------------------------------------------

# Every rank as it was at a moment: its coordinates, its last heartbeat by then (phase, status,
# the first operation it was waiting in, everything in flight) and how it ended if it had. After a
# restart, the attempt running at that moment (the newest registered by then): its heartbeats and
# ends only (the processes an earlier attempt left are not this attempt's ranks), and only ranks
# that attempt or a later one has (a world that shrank drops its last ranks).
RANK_STATE_SQL = """
WITH (SELECT max(attempt) FROM ranks WHERE run_id = {run:String} AND registered <= fromUnixTimestamp64Nano({at:Int64})) AS shown
SELECT who.rank AS rank, who.host AS host, who.pid AS pid, who.device AS device, who.tp AS tp, who.pp AS pp, who.dp AS dp,
       beat.beat_ns AS beat_ns, beat.step AS step, beat.phase AS phase, beat.status AS beat_status,
       beat.wait_group AS wait_group, beat.wait_seq AS wait_seq, beat.wait_op AS wait_op, beat.in_flight AS in_flight,
       ended.exit_ns AS exit_ns, ended.reason AS exit_reason, ended.exit_code AS exit_code, ended.signal AS exit_signal,
       ended.message AS exit_message
FROM (
    SELECT rank, argMax(host, registered) AS host, argMax(pid, registered) AS pid, argMax(device, registered) AS device, {PLACE}
    FROM ranks WHERE run_id = {run:String} GROUP BY rank HAVING max(attempt) >= shown
) AS who
LEFT JOIN (
    SELECT rank, toUnixTimestamp64Nano(max(time)) AS beat_ns, argMax(step, time) AS step, argMax(phase, time) AS phase,
           argMax(status, time) AS status, argMax(inflight_group, time) AS groups, argMax(inflight_seq, time) AS seqs,
           argMax(inflight_op, time) AS ops, argMax(inflight_waiting, time) AS waiting, indexOf(waiting, 1) AS first_wait,
           if(first_wait > 0, groups[first_wait], '') AS wait_group, if(first_wait > 0, seqs[first_wait], 0) AS wait_seq,
           if(first_wait > 0, ops[first_wait], '') AS wait_op,
           arrayStringConcat(arrayMap((g, s, o) -> concat(o, ' ', g, ' #', toString(s)), groups, seqs, ops), ', ') AS in_flight
    FROM heartbeats WHERE run_id = {run:String} AND attempt = shown AND time <= fromUnixTimestamp64Nano({at:Int64}) GROUP BY rank
) AS beat ON beat.rank = who.rank
LEFT JOIN (
    SELECT rank, toUnixTimestamp64Nano(min(time)) AS exit_ns, argMin(reason, time) AS reason, argMin(exit_code, time) AS exit_code,
           argMin(signal, time) AS signal, argMin(message, time) AS message
    FROM exits WHERE run_id = {run:String} AND attempt = shown AND time <= fromUnixTimestamp64Nano({at:Int64}) GROUP BY rank
) AS ended ON ended.rank = who.rank
ORDER BY rank
""".replace("{PLACE}", PLACE)


@per_run
def rank_states(run: Run, at_ns: int) -> pd.DataFrame:
    """One row per rank at ``at_ns`` (see RANK_STATE_SQL); ``states.classify`` names the state."""
    return query(RANK_STATE_SQL, {"run": run.id, "at": at_ns})


FIRST_EXIT_SQL = (
    "SELECT toUnixTimestamp64Nano(min(time)) AS ns FROM exits WHERE run_id = {run:String} "
    "AND attempt = (SELECT max(attempt) FROM ranks WHERE run_id = {run:String})"
)


@per_run
def first_exit(run: Run) -> int:
    """When the first rank of the run's latest attempt ended, in ns; 0 while none has."""
    rows = query(FIRST_EXIT_SQL, {"run": run.id})
    ns = rows.iloc[0]["ns"] if len(rows) else None  # min over no rows: one row of 0 (or NULL)
    return int(ns) if pd.notna(ns) and ns > 0 else 0


# --- hosts ------------------------------------------------------------------------------------

# The hosts of the ranks' newest registrations, and any other host that sent metrics for the run
# (one evicted by a restart: its ranks now run elsewhere), with no ranks.
HOSTS_SQL = """
SELECT if(who.host != '', who.host, m.host) AS host, who.ranks AS ranks, m.samples AS samples, m.gpus AS gpus, m.max_temp_c AS max_temp_c,
       m.gpu_util AS gpu_util, m.throttled AS throttled, m.ecc_new AS ecc_new, m.xid_codes AS xid_codes
FROM (SELECT host, groupArray(rank) AS ranks FROM (
        SELECT rank, argMax(host, registered) AS host FROM ranks WHERE run_id = {run:String} GROUP BY rank ORDER BY rank
     ) GROUP BY host) AS who
FULL OUTER JOIN (
    SELECT host, count() AS samples, uniqExactIf(device, startsWith(name, 'hw.')) AS gpus,
           maxIf(value, name = 'hw.temperature') AS max_temp_c, avgIf(value, name = 'hw.gpu.utilization') AS gpu_util,
           countIf(startsWith(name, 'hw.gpu.throttle.') AND value > 0) AS throttled,
           maxIf(value, name = 'hw.errors.ecc_uncorrected') - minIf(value, name = 'hw.errors.ecc_uncorrected') AS ecc_new,
           uniqExactIf(name, startsWith(name, 'hw.gpu.xid.') AND value > 0) AS xid_codes
    FROM metrics WHERE run_id = {run:String} GROUP BY host
) AS m ON m.host = who.host
ORDER BY empty(ranks), host
"""


@per_run
def hosts(run: Run) -> pd.DataFrame:
    """Per host: its ranks, metric samples, GPUs, hottest GPU, mean GPU use, throttled samples,
    new uncorrected ECC errors and Xid codes seen."""
    return query(HOSTS_SQL, {"run": run.id})


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def node_states() -> pd.DataFrame:
    """Every node's newest state as healing sees it (``NODES_SQL``): a node's, not a run's."""
    return query(NODES_SQL)


#: what the hosts page plots, in panel order: (metric, panel title, rate of a cumulative counter?)
HOST_PANELS: tuple[tuple[str, str, bool], ...] = (
    ("hw.gpu.utilization", "GPU utilisation", False),
    ("hw.temperature", "GPU temperature (°C)", False),
    ("hw.power", "GPU power (W)", False),
    ("hw.gpu.memory.usage", "GPU memory used (bytes)", False),
    ("hw.gpu.clock.sm", "SM clock (Hz)", False),
    ("system.cpu.utilization", "host CPU utilisation", False),
    ("system.memory.utilization", "host memory utilisation", False),
    ("system.network.io.receive", "network receive (bytes/s)", True),
    ("system.network.io.transmit", "network transmit (bytes/s)", True),
)
# Averages per time bucket, per metric and device; cumulative counters become rates (the
# difference to the previous bucket's last value over the time between them; none for the first).
HOST_SERIES_SQL = """
SELECT name, device, time_ns,
       if(name IN {counters:Array(String)}, (last - lagInFrame(last, 1, last) OVER w) / nullIf((at_ns - lagInFrame(at_ns, 1, at_ns) OVER w) / 1e9, 0),
          mean) AS value
FROM (
    SELECT name, device, intDiv(toUnixTimestamp64Nano(time), {bucket_ns:Int64}) * {bucket_ns:Int64} AS time_ns,
           avg(value) AS mean, argMax(value, time) AS last, toUnixTimestamp64Nano(max(time)) AS at_ns
    FROM metrics WHERE run_id = {run:String} AND host = {host:String} AND name IN {names:Array(String)}
    GROUP BY name, device, time_ns
)
WINDOW w AS (PARTITION BY name, device ORDER BY time_ns ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)
ORDER BY name, device, time_ns
"""
# Throttling (a 0/1 gauge per reason) while it is on, and ECC / Xid counters where they rose
# (ECC counts since the driver loaded, Xid counts since the agent started), merged per bucket.
HOST_EVENTS_SQL = """
SELECT name, device, intDiv(toUnixTimestamp64Nano(time), {bucket_ns:Int64}) * {bucket_ns:Int64} AS time_ns,
       max(value) AS peak
FROM (
    SELECT name, device, time, value,
           value - lagInFrame(value, 1, if(startsWith(name, 'hw.gpu.xid.'), 0, value)) OVER (
               PARTITION BY name, device ORDER BY time ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING) AS rise
    FROM metrics
    WHERE run_id = {run:String} AND host = {host:String}
      AND (startsWith(name, 'hw.gpu.throttle.') OR startsWith(name, 'hw.errors.ecc') OR startsWith(name, 'hw.gpu.xid.'))
)
WHERE if(startsWith(name, 'hw.gpu.throttle.'), value > 0, rise > 0)
GROUP BY name, device, time_ns ORDER BY time_ns
"""
#: samples per line on the hosts page: a long run is averaged over wider buckets
HOST_POINTS = 600


def _bucket_ns(run: Run) -> int:
    return (int(run.duration_s // HOST_POINTS) + 1) * 1_000_000_000


@per_run
def host_series(run: Run, host: str) -> pd.DataFrame:
    """name, device, time_ns, value of the HOST_PANELS metrics of ``host``."""
    names = [name for name, _, _ in HOST_PANELS]
    counters = [name for name, _, rate in HOST_PANELS if rate]
    params = {"run": run.id, "host": host, "names": names, "counters": counters, "bucket_ns": _bucket_ns(run)}
    return query(HOST_SERIES_SQL, params)


@per_run
def host_events(run: Run, host: str) -> pd.DataFrame:
    """name, device, time_ns, peak: the throttle / ECC / Xid samples of ``host`` that say something happened."""
    return query(HOST_EVENTS_SQL, {"run": run.id, "host": host, "bucket_ns": _bucket_ns(run)})


# --- restarts and self-healing ----------------------------------------------------------------

# Where each attempt after the first began: its first step and first span. The rollup is sorted by
# (run_id, attempt, ...), so a run never restarted reads nothing here.
ATTEMPTS_SQL = (
    "SELECT attempt, min(step) AS first_step, max(step) AS last_step, toUnixTimestamp64Nano(min(first_start)) AS start_ns "
    "FROM step_segments WHERE run_id = {run:String} AND attempt > 0 GROUP BY attempt ORDER BY attempt"
)
ACTIONS_SQL = (
    "SELECT toUnixTimestamp64Nano(time) AS time_ns, attempt, action, hosts, incident_id, reason, evidence FROM actions "
    "WHERE run_id = {run:String} ORDER BY time, action LIMIT {limit:UInt32}"
)
SELFCHECKS_SQL = (
    "SELECT host, toUnixTimestamp64Nano(time) AS time_ns, check, value, unit, reference, passed, host_passed, summary, detail "
    "FROM selfchecks WHERE run_id = {run:String} ORDER BY time DESC, host, check LIMIT {limit:UInt32}"
)
#: the most actions and self-check figures a page reads (a run acts a handful of times)
HEALING_ROWS = 500


@per_run
def attempts(run: Run) -> pd.DataFrame:
    """attempt, first_step, last_step, start_ns of each attempt after the first (none: never restarted)."""
    return query(ATTEMPTS_SQL, {"run": run.id})


@per_run
def actions(run: Run) -> pd.DataFrame:
    """What the self-healing driver decided and did, oldest first: time_ns, attempt, action, hosts,
    incident_id, reason, evidence (JSON text)."""
    return query(ACTIONS_SQL, {"run": run.id, "limit": HEALING_ROWS})


@per_run
def selfchecks(run: Run) -> pd.DataFrame:
    """The hosts' self-check figures, newest first: host, time_ns, check, value, unit, reference (the
    peers' median), passed, host_passed, summary, detail."""
    return query(SELFCHECKS_SQL, {"run": run.id, "limit": HEALING_ROWS})


# --- step anatomy and comparisons -------------------------------------------------------------

#: the breakdown's categories in stacking order: the anatomy core's (rankscope/collector/anatomy), and what the
#: page shows without it (step_segments by kind, and the rest of the step time as unexplained)
ANATOMY_CATEGORIES = ("compute", "optimizer", "data", "bubble", "exposed_comm", "unexplained")
SEGMENT_CATEGORIES = ("compute", "optimizer", "data", "comm", "unexplained")
_RANGE = "run_id = {run:String} AND step BETWEEN {first:UInt32} AND {last:UInt32}"
_TIMED = _RANGE + " AND name = 'step_time_s'"
# Per step, each kind's time summed over the ranks that ran the step, divided by how many did: the mean
# rank's time in it (comm includes waiting for other ranks: without the anatomy core it cannot be split)
KIND_STEPS_SQL = f"""
SELECT k.step AS step, k.kind AS category, k.ns / r.ranks / 1e6 AS ms
FROM (SELECT step, kind, sum(total_ns) AS ns FROM step_segments WHERE {_RANGE} AND {_latest("step_segments", _RANGE)}
      GROUP BY step, kind) AS k
JOIN (SELECT step, uniqExact(rank) AS ranks FROM step_segments WHERE {_RANGE} AND {_latest("step_segments", _RANGE)}
      GROUP BY step) AS r ON r.step = k.step
ORDER BY step, category
"""
STEP_TIME_SQL = (
    f"SELECT step, avg(value) * 1e3 AS ms FROM step_metrics WHERE {_TIMED} AND isFinite(value) AND {_latest('step_metrics', _TIMED)} "
    "GROUP BY step ORDER BY step"
)


def _arrow_query(sql: str, params: Any) -> Any:
    from rankscope.dashboard.connection import query_arrow

    return query_arrow(sql, params)


def _anatomy() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """(breakdown, critical_path) of the step-anatomy core (``rankscope.collector.anatomy``), or None where
    this build has none (the page then shows what step_segments alone can say)."""
    try:
        from rankscope.collector import anatomy
    except ImportError:
        return None
    found = getattr(anatomy, "breakdown", None), getattr(anatomy, "critical_path", None)
    return found if all(callable(f) for f in found) else None  # type: ignore[return-value]


@per_run
def anatomy_steps(run: Run, first: int, last: int) -> dict[str, Any]:
    """Where the mean rank's step time went in steps ``first``..``last``: ``frame`` (step, category, ms),
    ``categories`` (stacking order), ``source`` ("anatomy": the anatomy core's breakdown; "segments": the
    spans' kinds, without it), ``total`` (category -> ms per step over the range), ``median_step``."""
    core = _anatomy()
    if core is not None:
        found = core[0](_arrow_query, run.id, first, last)
        rows = [(step, c, split.ns[c] / 1e6) for step, split in sorted(found.by_step.items()) for c in ANATOMY_CATEGORIES]
        frame = pd.DataFrame(rows, columns=["step", "category", "ms"])
        total = {c: found.total.ns[c] / 1e6 for c in ANATOMY_CATEGORIES} if found.total else {}
        return {"frame": frame, "categories": ANATOMY_CATEGORIES, "source": "anatomy", "total": total, "median_step": found.median_step()}
    params = {"run": run.id, "first": first, "last": last}
    kinds = query(KIND_STEPS_SQL, params)
    kinds = kinds[kinds["category"] != "user"] if len(kinds) else kinds
    steps = query(STEP_TIME_SQL, params).set_index("step")["ms"]
    frame = kinds.pivot_table(index="step", columns="category", values="ms", aggfunc="sum").reindex(columns=SEGMENT_CATEGORIES[:-1]).fillna(0.0)
    frame = frame.loc[:, (frame != 0).any()]  # the kinds this run has (data loading only where a stage loads data)
    frame["unexplained"] = (steps.reindex(frame.index) - frame.sum(axis=1)).clip(lower=0).fillna(0.0)
    long = frame.reset_index().melt(id_vars="step", var_name="category", value_name="ms")
    ordered = steps.sort_values(kind="stable")
    median = int(ordered.index[(len(ordered) - 1) // 2]) if len(ordered) else None
    total = frame.mean().to_dict() if len(frame) else {}
    return {"frame": long, "categories": SEGMENT_CATEGORIES, "source": "segments", "total": total, "median_step": median}


@per_run
def critical_path(run: Run, step: int) -> dict[str, Any] | None:
    """The anatomy core's critical path of ``step``: ``links`` (rank, what, kind, start_ns, end_ns, waited_on),
    ``costs`` (rank, link, kind, cost_ms, share), start_ns, end_ns, step_ms, without_slowest_ms; None when
    the step has no data; ``{"available": False}`` where this build has no anatomy core."""
    core = _anatomy()
    if core is None:
        return {"available": False}
    path = core[1](_arrow_query, run.id, step)
    if path is None or not path.links:
        return None
    links = pd.DataFrame([{"rank": k.rank, "what": k.what, "kind": k.kind, "start_ns": k.start_ns, "end_ns": k.end_ns,
                           "waited_on": k.waited_on} for k in path.links])  # fmt: skip
    costs = pd.DataFrame([c.as_json() for c in path.costs if c.cost_ns > 0], columns=["rank", "link", "kind", "on_path_ms", "excess_ms",
                                                                                     "cost_ms", "share"])  # fmt: skip
    return {"available": True, "links": links, "costs": costs, "start_ns": path.start_ns, "end_ns": path.end_ns,
            "step_ms": path.step_ns / 1e6, "without_slowest_ms": path.without_slowest_ns / 1e6}  # fmt: skip


@per_run
def comparison(run: Run, baseline: str, baseline_steps: tuple[int, int] | None, steps: tuple[int, int] | None) -> dict[str, Any]:
    """``rankscope compare``'s answer (its JSON form) for ``run`` (over ``steps``, None: after the warm-up)
    against ``baseline`` (a run id; this run's own id for another range of its steps). Raises the
    comparison's CompareError when a side is unknown or has no completed step."""
    from rankscope.collector.compare import Side, compare

    a = Side(baseline, *(baseline_steps or (None, None)))
    b = Side(run.id, *(steps or (None, None)))
    return compare(_arrow_query, a, b).as_json()
