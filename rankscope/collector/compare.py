"""What makes one run (or one stretch of steps) slower than another: the segments, ranks and process
groups behind the difference in step time, largest first.

Each side of a comparison is a run and a range of its steps (``Side``); the two sides may be two runs
or two ranges of one run. Everything is read through a ``Query`` (a collector client, a store reader),
aggregated in the store, and compared here:

- **step time**: per step, the median over the ranks of ``step_metrics`` ``step_time_s``; per side,
  the median over its steps (robust to a slow step or two). Only completed steps count (those with a
  step time), each as the latest attempt ran it (a step run again after a restart counts once).
- **segments** (``step_segments``): per step, the *critical* value of a segment: the slowest rank of
  each pipeline stage sets the stage's pace in lockstep training, so the maximum over the stage's
  ranks, then over the stages (for a communication segment: the longest time a rank spent in it,
  mostly waiting). Per side, the median over steps. Wall time, or CPU time for the ranks' own work
  where the agent measured it on both sides (host-only runs on shared cores, where wall time mostly
  measures the scheduler: as the straggler detector and the heat map compare).
- **(segment, rank)**: each rank's own time per step in each segment, the median over steps,
  matched by role across the sides (``match_ranks``): the same rank number when both sides have the
  same world size, else the same (tp, pp, dp) coordinates.
- **groups** (``collectives``, completed operations): per collective (group, sequence number) its
  *transfer* time is the shortest time a member spent in it (issue to end: the last member to
  arrive spent only the transfer) and its *arrival skew* the longest minus the shortest (how long
  the first member had it outstanding before the last arrived: waiting, or computing on while it
  ran in the background). A point-to-point send is matched with its receive (the n-th send from A
  to B on a group is the n-th receive at B from A): its transfer runs from the later of the two
  issues to the receive's end, its skew is how long the earlier side waited. Per step summed over a
  group's operations of each kind (``send/recv`` for the point-to-point ones); per side, the median
  over steps. The rank the others waited for is the one that arrived last, weighted by the skew.

The **contributions** rank the causes together, largest first in the direction the step time
moved, each as a share of the step-time difference:

- the ranks' own work (compute, data, optimizer, user segments): a rank's change is split into the
  part the ranks of its pipeline stage share (their median change: "backward on every rank of
  stage 1") and what the rank changed beyond that ("rank 5 backward"): a straggler shows as itself,
  a slower kernel as the segment, not as every rank one by one;
- a group's transfer change (collectives, and sends with their receives).

Waits are effects, not causes: a rank waits longer when a peer is slower (or a pipeline stage
when its neighbour is), and counting both would count the straggler twice. They are listed apart
(``waits``): the time in each communication segment (its slowest rank's) and each group's arrival
skew with the rank that arrived last. The shares overlap (parts of a step run at the same time)
and need not add up to 100%.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # light at import: `rankscope compare` parses its step ranges with this module
    from rankscope.collector.diagnosis.context import Query

#: the first steps of a run carry start-up costs (allocations, first-time code paths): a side
#: without an explicit range starts after them (when the run has steps beyond them)
WARMUP_STEPS = 2
#: kinds of span that are the rank's own work (the rest, "comm", is communication)
COMM = "comm"
#: contributions shown in the table (the JSON has them all)
TABLE_ROWS = 12
#: the headline names this many contributions at most
HEADLINE_ITEMS = 3
#: a contribution smaller than this share of the larger side's step time is noise for the headline
HEADLINE_MIN_SHARE_OF_STEP = 0.01
_ALL_STEPS = (1, 2**32 - 1)

__all__ = ["CompareError", "Comparison", "Contribution", "Side", "compare", "parse_steps"]


class CompareError(ValueError):
    """The comparison cannot be made as asked (an unknown run, a range without completed steps)."""


@dataclass(frozen=True)
class Side:
    """A run and a range of its steps (None: the run's completed steps after the warm-up)."""

    run_id: str
    first_step: int | None = None
    last_step: int | None = None

    @property
    def explicit(self) -> bool:
        return self.first_step is not None


def parse_steps(text: str) -> tuple[int, int]:
    """``"100-200"`` -> (100, 200); ``"150"`` -> (150, 150). ValueError with a readable message otherwise."""
    parts = text.strip().split("-")
    try:
        if len(parts) == 1:
            first = last = int(parts[0])
        elif len(parts) == 2:
            first, last = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"expected a step range such as 100-200 (or one step), got {text!r}") from None
    if first < 1:
        raise ValueError(f"steps are numbered from 1, got {text!r}")
    if last < first:
        raise ValueError(f"the range {text!r} ends before it begins")
    return first, last


# --- the queries ------------------------------------------------------------------------------

_W = "run_id = {run:String} AND step BETWEEN {first:UInt32} AND {last:UInt32}"


def _latest(table: str, where: str) -> str:
    """Of each step, only the rows of the latest attempt that ran it (a step run again after a restart counts once)."""
    return f"(step, attempt) IN (SELECT step, max(attempt) FROM {table} WHERE {where} GROUP BY step)"


def _median(x: str) -> str:
    """The exact median as numpy computes it (the mean of the two middle values)."""
    return f"(quantileExactLow(0.5)({x}) + quantileExactHigh(0.5)({x})) / 2"


RUN_SQL = (
    "SELECT argMax(status, updated) AS status, argMax(world_size, updated) AS world_size, argMax(tp, updated) AS tp, "
    "argMax(pp, updated) AS pp, argMax(dp, updated) AS dp FROM runs WHERE run_id = {run:String}"
)
_TIMED = _W + " AND name = 'step_time_s'"
_STEP_TIMES = f"step_metrics WHERE {_TIMED} AND isFinite(value)"
#: the completed steps of the range: those with a step time
_COMPLETED = f"SELECT DISTINCT step FROM {_STEP_TIMES}"
STEP_TIMES_SQL = (
    f"SELECT step, {_median('value')} AS step_s, max(attempt) AS run_attempt FROM {_STEP_TIMES} "
    f"AND {_latest('step_metrics', _TIMED)} GROUP BY step ORDER BY step"
)
# A run that records no step time (no agent.record_scalars): a step lasts from its first span's start
# to its last span's end over all ranks; the newest step may still be running (the caller drops it).
SPAN_STEPS_SQL = (
    "SELECT step, (toUnixTimestamp64Nano(max(last_end)) - toUnixTimestamp64Nano(min(first_start))) / 1e9 AS step_s, "
    f"max(attempt) AS run_attempt FROM step_segments WHERE {_W} AND {_latest('step_segments', _W)} GROUP BY step ORDER BY step"
)
#: each (segment, step, rank) cell of the side's completed steps, as the latest attempt ran it: wall time,
#: and CPU time where every piece of it had that measured (host-only runs on shared cores)
_CELLS = (
    "SELECT name, any(kind) AS seg_kind, step, rank, sum(total_ns) AS ns, sum(total_cpu_ns) AS cpu, sum(pieces) = sum(cpu_pieces) AS has_cpu "
    f"FROM step_segments WHERE {_W} AND {_latest('step_segments', _W)} AND step IN ({{completed}}) GROUP BY name, step, rank"
)
PER_RANK_SQL = (
    f"SELECT name, any(seg_kind) AS kind, rank, {_median('ns')} / 1e9 AS wall_s, {_median('cpu')} / 1e9 AS cpu_s, "
    f"min(has_cpu) AS all_cpu, count() AS steps FROM ({_CELLS}) GROUP BY name, rank ORDER BY name, rank"
)
# Who each rank is: its registration in the side's attempt where the store still holds it, else its
# newest (the ranks table keeps only the newest once merged).
ROLES_SQL = (
    "SELECT rank, argMax(tp_rank, k) AS tp, argMax(pp_rank, k) AS pp, argMax(dp_rank, k) AS dp, argMax(host, k) AS host "
    "FROM (SELECT *, (attempt = {attempt:UInt16}, registered) AS k FROM ranks WHERE run_id = {run:String}) GROUP BY rank ORDER BY rank"
)
# Per segment and step: in each pipeline stage the slowest rank and the fastest; the critical value is
# the slowest stage's slowest rank (wall and CPU time), the spread the largest of the stages' slowest
# minus fastest. Medians over steps; the rank that was the slowest most often.
SEGMENTS_SQL = f"""
WITH cells AS ({_CELLS}),
who AS (
    SELECT rank, greatest(argMax(pp_rank, k), 0) AS stage
    FROM (SELECT *, (attempt = {{attempt:UInt16}}, registered) AS k FROM ranks WHERE run_id = {{run:String}}) GROUP BY rank
),
staged AS (
    SELECT c.name AS name, any(c.seg_kind) AS seg_kind, c.step AS step, w.stage AS stage, max(c.ns) AS slowest, min(c.ns) AS fastest,
           argMax(c.rank, c.ns) AS slowest_rank, max(c.cpu) AS slowest_cpu, argMax(c.rank, c.cpu) AS slowest_cpu_rank,
           min(c.has_cpu) AS stage_cpu
    FROM cells AS c LEFT JOIN who AS w ON w.rank = c.rank GROUP BY name, step, stage
),
stepped AS (
    SELECT name, any(seg_kind) AS step_kind, step, max(slowest) AS critical,
           max(slowest_cpu) AS critical_cpu, argMax(slowest_rank, slowest) AS pace_rank,
           argMax(slowest_cpu_rank, slowest_cpu) AS pace_cpu_rank, max(slowest - fastest) AS spread, min(stage_cpu) AS step_cpu
    FROM staged GROUP BY name, step
)
SELECT name, any(step_kind) AS kind, {_median('critical')} / 1e9 AS critical_s, {_median('critical_cpu')} / 1e9 AS critical_cpu_s,
       {_median('spread')} / 1e9 AS waited_s, topK(1)(pace_rank)[1] AS pace_rank, topK(1)(pace_cpu_rank)[1] AS pace_cpu_rank,
       min(step_cpu) AS all_cpu, count() AS steps
FROM stepped GROUP BY name ORDER BY name
"""
# Completed collectives (not point-to-point), matched across their members by (attempt, group, seq).
_OPS = f"""
SELECT step, group_name, any(op) AS op_name, count() AS members, min(dur) AS transfer, max(dur) AS longest,
       argMax(rank, issue_ns) AS last_rank, max(issue_ns) - min(issue_ns) AS skew
FROM (
    SELECT step, attempt, group_name, op, seq, rank, toUnixTimestamp64Nano(issue_time) AS issue_ns,
           toUnixTimestamp64Nano(end_time) - issue_ns AS dur
    FROM collectives
    WHERE {_W} AND peer = -1 AND end_time > issue_time AND {_latest('collectives', _W + ' AND peer = -1')} AND step IN ({{completed}})
)
GROUP BY attempt, step, group_name, seq HAVING members > 1
"""
GROUPS_SQL = f"""
WITH ops AS ({_OPS}),
stepped AS (
    SELECT group_name, op_name, step, sum(transfer) AS step_transfer, sum(longest - transfer) AS step_skew, count() AS step_calls
    FROM ops GROUP BY group_name, op_name, step
),
late AS (
    SELECT group_name, op_name, topKWeighted(1)(last_rank, toUInt64(greatest(skew, 0)))[1] AS last_rank FROM ops GROUP BY group_name, op_name
)
SELECT s.group_name AS group_name, s.op_name AS op, {_median('s.step_transfer')} / 1e9 AS transfer_s, {_median('s.step_skew')} / 1e9 AS skew_s,
       {_median('s.step_calls')} AS calls, count() AS steps, any(l.last_rank) AS last_rank
FROM stepped AS s LEFT JOIN late AS l ON l.group_name = s.group_name AND l.op_name = s.op_name
GROUP BY s.group_name, s.op_name ORDER BY group_name, op
"""

# Point-to-point transfers (pipeline sends and receives), each send matched with its receive: the n-th
# send from A to B on a group is the n-th receive at B from A (same attempt, group, seq). The transfer
# is from the later of the two issues to the receive's end; the skew how long the earlier one waited
# for the later; the last to arrive is the later of the two.
P2P_SQL = f"""
WITH p2p AS (
    SELECT attempt, step, group_name, seq, rank, peer, positionCaseInsensitive(op, 'send') > 0 AS is_send,
           toUnixTimestamp64Nano(issue_time) AS issue_ns, toUnixTimestamp64Nano(end_time) AS end_ns
    FROM collectives
    WHERE {_W} AND peer >= 0 AND end_time > issue_time AND {_latest('collectives', _W + ' AND peer >= 0')} AND step IN ({{completed}})
),
pairs AS (
    SELECT r.step AS step, r.group_name AS group_name, greatest(r.end_ns - greatest(s.issue_ns, r.issue_ns), 0) AS transfer,
           abs(r.issue_ns - s.issue_ns) AS skew, if(s.issue_ns >= r.issue_ns, s.rank, r.rank) AS last_rank
    FROM (SELECT * FROM p2p WHERE is_send) AS s
    JOIN (SELECT * FROM p2p WHERE NOT is_send) AS r
      ON r.attempt = s.attempt AND r.group_name = s.group_name AND r.seq = s.seq AND r.rank = s.peer AND r.peer = s.rank
),
stepped AS (
    SELECT group_name, step, sum(transfer) AS step_transfer, sum(skew) AS step_skew, count() AS step_calls FROM pairs GROUP BY group_name, step
),
late AS (
    SELECT group_name, topKWeighted(1)(last_rank, toUInt64(skew))[1] AS last_rank FROM pairs GROUP BY group_name
)
SELECT s.group_name AS group_name, 'send/recv' AS op, {_median('s.step_transfer')} / 1e9 AS transfer_s,
       {_median('s.step_skew')} / 1e9 AS skew_s, {_median('s.step_calls')} AS calls, count() AS steps, any(l.last_rank) AS last_rank
FROM stepped AS s LEFT JOIN late AS l ON l.group_name = s.group_name
GROUP BY s.group_name ORDER BY group_name
"""


# --- one side, read -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Role:
    tp: int
    pp: int
    dp: int
    host: str

    @property
    def known(self) -> bool:
        return min(self.tp, self.pp, self.dp) >= 0

    @property
    def coords(self) -> tuple[int, int, int]:
        return (self.tp, self.pp, self.dp)


@dataclass(frozen=True)
class SegmentStat:
    """A segment's critical value per step (its slowest rank's time; median over steps), by wall and by CPU
    time, with the rank that set it most often, and the spread within a stage (slowest minus fastest, wall)."""

    critical_s: float
    critical_cpu_s: float
    waited_s: float
    pace_rank: int
    pace_cpu_rank: int

    def critical(self, cpu: bool) -> float:
        return self.critical_cpu_s if cpu else self.critical_s

    def pace(self, cpu: bool) -> int:
        return self.pace_cpu_rank if cpu else self.pace_rank


@dataclass
class SideData:
    """What one side of a comparison read from the store."""

    side: Side
    status: str
    world_size: int
    tp: int
    pp: int
    dp: int
    first_step: int
    last_step: int
    steps: int
    attempt: int
    step_time_s: float
    #: where the step time came from: "step_time_s" (the trainer's own), or "spans" (their extent)
    step_time_source: str
    #: rank -> its role
    roles: dict[int, Role] = field(default_factory=dict)
    #: (segment, rank) -> (wall, CPU) seconds per step (medians over steps)
    per_rank: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    #: segment -> kind
    kinds: dict[str, str] = field(default_factory=dict)
    #: segments whose every piece, on every rank, had its CPU time measured
    cpu_measured: set[str] = field(default_factory=set)
    #: segment -> its critical value per step and what the others waited (``SegmentStat``)
    segments: dict[str, SegmentStat] = field(default_factory=dict)
    #: (group, op) -> (transfer s, arrival skew s, calls per step, the rank that arrived last most)
    groups: dict[tuple[str, str], tuple[float, float, float, int]] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted({rank for _, rank in self.per_rank})

    def describe(self) -> dict[str, Any]:
        return {
            "run": self.side.run_id, "status": self.status, "first_step": self.first_step, "last_step": self.last_step,
            "steps": self.steps, "attempt": self.attempt, "step_time_s": self.step_time_s, "step_time_source": self.step_time_source,
            "world_size": self.world_size, "tp": self.tp, "pp": self.pp, "dp": self.dp, "ranks_with_data": len(self.ranks),
        }  # fmt: skip


def _rows(query: Query, sql: str, params: Mapping[str, object]) -> list[dict[str, Any]]:
    return query(sql, params).to_pylist()


def _steps(query: Query, side: Side) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """The side's run, its completed steps' times (warm-up left out where the range is the whole run) and
    where they come from; CompareError when the run is unknown or the range holds no completed step."""
    run = _rows(query, RUN_SQL, {"run": side.run_id})
    if not run or not run[0]["status"]:  # argMax over no rows is the empty string
        raise CompareError(f"no run {side.run_id!r} in the store (rankscope sql \"SELECT DISTINCT run_id FROM runs\" lists them)")
    info = run[0]
    first, last = (side.first_step, side.last_step) if side.explicit else _ALL_STEPS
    window = {"run": side.run_id, "first": first, "last": last}
    steps = _rows(query, STEP_TIMES_SQL, window)
    source = "step_time_s"
    if not steps:
        steps = _rows(query, SPAN_STEPS_SQL, window)
        source = "spans"
        if steps and info["status"] == "running" and not side.explicit:
            steps = steps[:-1]  # the newest step may still be running
    if not side.explicit and len(steps) > WARMUP_STEPS:
        steps = [s for s in steps if s["step"] > WARMUP_STEPS] or steps
    if not steps:
        where = f"steps {first}-{last}" if side.explicit else "any step"
        raise CompareError(f"run {side.run_id!r} has no completed step in {where}")
    return info, steps, source


def step_time_s(query: Query, side: Side) -> float:
    """The side's median step time (s) alone, without the per-rank and per-segment reads of ``load_side``."""
    return _median_of([float(s["step_s"]) for s in _steps(query, side)[1]])


def load_side(query: Query, side: Side) -> SideData:
    """Read one side; CompareError when its run is unknown or the range holds no completed step."""
    info, steps, source = _steps(query, side)
    first, last = int(steps[0]["step"]), int(steps[-1]["step"])
    attempt = max(int(s["run_attempt"]) for s in steps)
    data = SideData(
        side=side, status=str(info["status"]), world_size=int(info["world_size"]), tp=int(info["tp"]), pp=int(info["pp"]),
        dp=int(info["dp"]), first_step=first, last_step=last, steps=len(steps), attempt=attempt,
        step_time_s=_median_of([float(s["step_s"]) for s in steps]), step_time_source=source,
    )  # fmt: skip
    params = {"run": side.run_id, "first": first, "last": last, "attempt": attempt}
    completed = _COMPLETED if source == "step_time_s" else f"SELECT step FROM step_segments WHERE {_W}"

    def sql(text: str) -> str:
        return text.replace("{completed}", completed)

    unmeasured = set()
    for r in _rows(query, sql(PER_RANK_SQL), params):
        data.per_rank[(r["name"], int(r["rank"]))] = (float(r["wall_s"]), float(r["cpu_s"]))
        data.kinds[r["name"]] = r["kind"]
        if not r["all_cpu"]:
            unmeasured.add(r["name"])
    data.cpu_measured = set(data.kinds) - unmeasured
    for r in _rows(query, sql(SEGMENTS_SQL), params):
        data.segments[r["name"]] = SegmentStat(float(r["critical_s"]), float(r["critical_cpu_s"]), float(r["waited_s"]),
                                               int(r["pace_rank"]), int(r["pace_cpu_rank"]))  # fmt: skip
        data.kinds.setdefault(r["name"], r["kind"])
    for r in [*_rows(query, sql(GROUPS_SQL), params), *_rows(query, sql(P2P_SQL), params)]:
        data.groups[(r["group_name"], r["op"])] = (float(r["transfer_s"]), float(r["skew_s"]), float(r["calls"]), int(r["last_rank"]))
    ranks = set(data.ranks)
    for r in _rows(query, ROLES_SQL, params):
        if int(r["rank"]) in ranks:
            data.roles[int(r["rank"])] = Role(int(r["tp"]), int(r["pp"]), int(r["dp"]), str(r["host"]))
    return data


def _measure(cpu: bool | int) -> str:
    return "cpu" if cpu else "wall"


def _median_of(values: Iterable[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return math.nan
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _shared_change(members: list[tuple[int, int, float, float]]) -> tuple[int, int, float, float]:
    """The member (rank_b, rank_a, a_s, b_s) of a stage whose change the others share: the median change,
    and of the two middle ones of an even count the one nearer zero: in a stage of two ranks, one rank
    slower (or faster) is that rank, not half a stage-wide change."""
    ordered = sorted(members, key=lambda m: m[3] - m[2])
    n = len(ordered)
    return ordered[n // 2] if n % 2 else min(ordered[n // 2 - 1], ordered[n // 2], key=lambda m: abs(m[3] - m[2]))


# --- matching ranks by role ---------------------------------------------------------------------


@dataclass(frozen=True)
class Matching:
    #: "rank" (the same number) or "coordinates" (the same tp, pp, dp)
    how: str
    #: rank in B -> its counterpart in A
    pairs: dict[int, int]
    unmatched_a: tuple[int, ...]
    unmatched_b: tuple[int, ...]
    note: str


def match_ranks(a: SideData, b: SideData) -> Matching:
    """Rank r with rank r when both sides have the same world size; otherwise by (tp, pp, dp) coordinates."""
    ranks_a, ranks_b = a.ranks, b.ranks
    world_a, world_b = a.world_size or len(ranks_a), b.world_size or len(ranks_b)
    if world_a == world_b:
        pairs = {r: r for r in ranks_b if r in set(ranks_a)}
        layout_a, layout_b = (a.tp, a.pp, a.dp), (b.tp, b.pp, b.dp)
        note = f"ranks matched by number (both sides: {world_b} ranks)"
        if layout_a != layout_b:
            note += f"; the layouts differ (TP {a.tp} x PP {a.pp} x DP {a.dp} against TP {b.tp} x PP {b.pp} x DP {b.dp}): a rank's role may differ"
        how = "rank"
    else:
        by_coords = {a.roles[r].coords: r for r in ranks_a if r in a.roles and a.roles[r].known}
        pairs = {r: by_coords[b.roles[r].coords] for r in ranks_b if r in b.roles and b.roles[r].known and b.roles[r].coords in by_coords}
        how = "coordinates"
        note = f"ranks matched by their (tp, pp, dp) coordinates: the world sizes differ ({world_a} against {world_b} ranks)"
        if not pairs:
            note += "; no rank's coordinates match, so no rank is compared with another"
    unmatched_a = tuple(r for r in ranks_a if r not in set(pairs.values()))
    unmatched_b = tuple(r for r in ranks_b if r not in pairs)
    if unmatched_a or unmatched_b:
        note += f"; without a counterpart: {len(unmatched_a)} rank(s) of A, {len(unmatched_b)} of B"
    return Matching(how, pairs, unmatched_a, unmatched_b, note)


# --- the comparison -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Contribution:
    """One cause (or, in ``waits``, one effect) of the difference in step time."""

    #: "rank" (a segment on one rank, beyond its stage), "stage" (a segment on every rank of a stage),
    #: "group" (a process group's transfers), "wait" (time in a communication segment, a group's arrival skew)
    level: str
    label: str
    a_s: float
    b_s: float
    #: the change this item stands for (for "rank": beyond its stage's shared change)
    diff_s: float
    #: diff_s over the step-time difference; None when the step time did not change
    share: float | None
    segment: str = ""
    kind: str = ""
    #: "cpu" where the ranks' CPU time was compared (host-only runs, their own work), else "wall"
    measure: str = "wall"
    rank: int | None = None
    rank_a: int | None = None
    host: str = ""
    stage: int | None = None
    group: str = ""
    op: str = ""
    #: the rank the others waited for: the last to arrive at the group's collectives (waits in a group)
    waited_for: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, "")}


@dataclass
class Comparison:
    a: SideData
    b: SideData
    matching: Matching
    contributions: list[Contribution]
    waits: list[Contribution]
    segments: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    groups: list[dict[str, Any]]

    @property
    def diff_s(self) -> float:
        return self.b.step_time_s - self.a.step_time_s

    @property
    def relative(self) -> float | None:
        return self.diff_s / self.a.step_time_s if self.a.step_time_s > 0 else None

    def headline(self) -> str:
        """``step time +212 ms (+23%): rank 5 backward +180 ms (85% of the difference), ...``"""
        head = f"step time {_ms(self.diff_s)}" + (f" ({self.relative:+.0%})" if self.relative is not None else "")
        floor = HEADLINE_MIN_SHARE_OF_STEP * max(self.a.step_time_s, self.b.step_time_s)
        sign = 1 if self.diff_s >= 0 else -1
        items = [c for c in self.contributions if c.diff_s * sign > 0 and abs(c.diff_s) >= floor][:HEADLINE_ITEMS]
        if not items:
            return head + ": no segment, rank or group stands out"
        parts = [f"{c.label} {_ms(c.diff_s)}" + (f" ({c.share:.0%} of the difference)" if c.share is not None and i == 0 else
                                                   f" ({c.share:.0%})" if c.share is not None else "")
                 for i, c in enumerate(items)]  # fmt: skip
        return head + ": " + ", ".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {
            "a": self.a.describe(), "b": self.b.describe(),
            "step_time": {"a_s": self.a.step_time_s, "b_s": self.b.step_time_s, "diff_s": self.diff_s, "relative": self.relative},
            "summary": self.headline(),
            "matching": {"how": self.matching.how, "note": self.matching.note, "unmatched_a": list(self.matching.unmatched_a),
                         "unmatched_b": list(self.matching.unmatched_b)},
            "contributions": [c.as_json() for c in self.contributions],
            "waits": [w.as_json() for w in self.waits],
            "segments": self.segments, "ranks": self.ranks, "groups": self.groups,
        }  # fmt: skip

    def table(self, rows: int = TABLE_ROWS) -> str:
        """The comparison as text for a terminal: the headline, the causes, then segments, waits and groups."""
        a, b = self.a, self.b
        out = [
            f"A: run {a.side.run_id} steps {a.first_step}-{a.last_step} ({a.steps} completed){_warmup(a)}: step time {a.step_time_s * 1e3:,.1f} ms",
            f"B: run {b.side.run_id} steps {b.first_step}-{b.last_step} ({b.steps} completed){_warmup(b)}: step time {b.step_time_s * 1e3:,.1f} ms",
            self.matching.note,
        ]
        if "spans" in (a.step_time_source, b.step_time_source):
            out.append("step time from the spans' extent on some side (no step_time_s recorded)")
        on_cpu = sorted(s["segment"] for s in self.segments if s["measure"] == "cpu")
        if on_cpu:
            out.append(f"compared on CPU time (host-only runs on shared cores, where wall time measures the scheduler): {', '.join(on_cpu)}")
        out += ["", self.headline(), ""]
        share = "each as a share of the step-time difference; shares overlap and need not add up to 100%"
        out.append(f"What accounts for it, largest first ({share}):")
        out += _text_table(
            ["contribution", "A (ms)", "B (ms)", "change (ms)", "share"],
            [[c.label, _plain_ms(c.a_s), _plain_ms(c.b_s), _ms(c.diff_s, unit=False), _share(c.share)] for c in self.contributions[:rows]],
        )
        if len(self.contributions) > rows:
            out.append(f"  ... {len(self.contributions) - rows} more (--top, or --format json for all)")
        if self.waits:
            out += ["", "Waits (effects, not counted above: ranks waiting for a slower peer, and who arrived last):"]
            out += _text_table(
                ["wait", "A (ms)", "B (ms)", "change (ms)", "share"],
                [[w.label, _plain_ms(w.a_s), _plain_ms(w.b_s), _ms(w.diff_s, unit=False), _share(w.share)] for w in self.waits[:rows]],
            )
        out += ["", "Segments per step (the slowest rank's time in each: the pace for its own work, the longest wait for communication):"]
        out += _text_table(
            ["segment", "kind", "A (ms)", "B (ms)", "change (ms)", "share", "slowest rank in B"],
            [[s["segment"], s["kind"], _plain_ms(s["a_s"]), _plain_ms(s["b_s"]), _ms(s["diff_s"], unit=False), _share(s["share"]),
              "" if s["pace_rank_b"] is None else str(s["pace_rank_b"])] for s in self.segments[:rows]],
        )  # fmt: skip
        if self.groups:
            out += ["", "Process groups per step, ms (transfer: a collective's last member's time in it, or a send's from both sides "
                        "ready to the receive's end; skew: how far apart the sides arrived):"]
            out += _text_table(
                ["group", "op", "transfer A", "transfer B", "change", "skew A", "skew B", "change", "last to arrive in B"],
                [[g["group"], g["op"], _plain_ms(g["transfer_a_s"]), _plain_ms(g["transfer_b_s"]), _ms(g["transfer_diff_s"], unit=False),
                  _plain_ms(g["skew_a_s"]), _plain_ms(g["skew_b_s"]), _ms(g["skew_diff_s"], unit=False),
                  "" if g["last_to_arrive_b"] is None else f"rank {g['last_to_arrive_b']}"] for g in self.groups[:rows]],
            )  # fmt: skip
        return "\n".join(out)


def compare(query: Query, a: Side, b: Side) -> Comparison:
    """Compare side B with side A (B minus A); CompareError for an unknown run or an empty range."""
    return build(load_side(query, a), load_side(query, b))


def build(a: SideData, b: SideData) -> Comparison:
    """The comparison of two sides already read (pure: no queries)."""
    matching = match_ranks(a, b)
    diff_step = b.step_time_s - a.step_time_s

    def share(x: float) -> float | None:
        return x / diff_step if diff_step else None

    def cpu(name: str) -> bool:
        """Whether a segment is compared on CPU time: the ranks' own work, measured so on both sides."""
        return (b.kinds.get(name) or a.kinds.get(name)) != COMM and name in a.cpu_measured and name in b.cpu_measured

    causes: list[Contribution] = []
    waits: list[Contribution] = []
    ranks_rows: list[dict[str, Any]] = []
    # (segment, rank): each matched rank's change, split into its stage's shared part and its own
    changes: dict[tuple[str, int], list[tuple[int, int, float, float]]] = defaultdict(list)  # (segment, stage) -> [(rank_b, rank_a, a_s, b_s)]
    for (name, rank_b), b_times in sorted(b.per_rank.items()):
        rank_a = matching.pairs.get(rank_b)
        a_times = a.per_rank.get((name, rank_a)) if rank_a is not None else None
        if a_times is None:
            continue
        pick = 1 if cpu(name) else 0
        a_s, b_s = a_times[pick], b_times[pick]
        role = b.roles.get(rank_b)
        stage = role.pp if role is not None and role.pp >= 0 else 0
        changes[(name, stage)].append((rank_b, int(rank_a), a_s, b_s))
        ranks_rows.append({"segment": name, "kind": b.kinds.get(name, ""), "measure": _measure(pick), "rank": rank_b, "rank_a": rank_a,
                           "stage": stage, "host": role.host if role else "", "a_s": a_s, "b_s": b_s, "diff_s": b_s - a_s,
                           "share": share(b_s - a_s)})  # fmt: skip
    stages_b = len({stage for _, stage in changes})
    for (name, stage), members in changes.items():
        kind = b.kinds.get(name, "")
        if kind == COMM:
            continue  # communication: its critical change below, its waits apart
        measure = _measure(cpu(name))
        typical = _shared_change(members)
        common = typical[3] - typical[2]
        if len(members) > 1:
            where = f"every rank of stage {stage}" if stages_b > 1 else "every rank"
            causes.append(Contribution(  # A and B: the times of the rank whose change the stage shares
                "stage", f"{name} on {where}", typical[2], typical[3], common, share(common),
                segment=name, kind=kind, measure=measure, stage=stage,
            ))  # fmt: skip
        for rank_b, rank_a, a_s, b_s in members:
            own = (b_s - a_s) - (common if len(members) > 1 else 0.0)
            role = b.roles.get(rank_b)
            causes.append(Contribution(
                "rank", f"rank {rank_b}{'' if rank_a == rank_b else f' (A: rank {rank_a})'} {name}", a_s, b_s, own, share(own),
                segment=name, kind=kind, measure=measure, rank=rank_b, rank_a=rank_a, host=role.host if role else "", stage=stage,
            ))  # fmt: skip
    segments_rows: list[dict[str, Any]] = []
    none = SegmentStat(0.0, 0.0, 0.0, -1, -1)
    for name in sorted(set(a.segments) | set(b.segments)):
        kind = b.kinds.get(name) or a.kinds.get(name, "")
        on_cpu = cpu(name)
        sa, sb = a.segments.get(name, none), b.segments.get(name, none)
        ca, cb = sa.critical(on_cpu), sb.critical(on_cpu)
        only = "" if name in a.segments and name in b.segments else ("A" if name in a.segments else "B")
        pace = sb.pace(on_cpu)
        segments_rows.append({"segment": name, "kind": kind, "measure": _measure(on_cpu), "a_s": ca, "b_s": cb, "diff_s": cb - ca,
                              "share": share(cb - ca), "spread_a_s": sa.waited_s, "spread_b_s": sb.waited_s,
                              "pace_rank_b": pace if pace >= 0 and name in b.segments else None, "only_in": only})  # fmt: skip
        suffix = f" (only in {only})" if only else ""
        if kind == COMM:  # time in a communication region is mostly waiting: its transfers are counted on the operations
            waits.append(Contribution("wait", f"time in {name} (waits included){suffix}", ca, cb, cb - ca, share(cb - ca), segment=name,
                                      kind=kind, measure="wall"))  # fmt: skip
    groups_rows: list[dict[str, Any]] = []
    for key in sorted(set(a.groups) | set(b.groups)):
        group, op = key
        ta, wa, calls_a, _ = a.groups.get(key, (0.0, 0.0, 0.0, -1))
        tb, wb, calls_b, last = b.groups.get(key, (0.0, 0.0, 0.0, -1))
        only = "" if key in a.groups and key in b.groups else ("A" if key in a.groups else "B")
        last_b = last if key in b.groups and last >= 0 else None
        groups_rows.append({"group": group, "op": op, "transfer_a_s": ta, "transfer_b_s": tb, "transfer_diff_s": tb - ta,
                            "skew_a_s": wa, "skew_b_s": wb, "skew_diff_s": wb - wa, "calls_a": calls_a, "calls_b": calls_b,
                            "last_to_arrive_b": last_b, "only_in": only})  # fmt: skip
        suffix = f" (only in {only})" if only else ""
        causes.append(Contribution("group", f"{group} {op}{suffix}", ta, tb, tb - ta, share(tb - ta), group=group, op=op, measure="wall"))
        who = f", last to arrive: rank {last_b}" if last_b is not None and wb > wa else ""
        waits.append(Contribution("wait", f"{group} {op} arrival skew{suffix}{who}", wa, wb, wb - wa, share(wb - wa), group=group, op=op,
                                  waited_for=last_b))  # fmt: skip
    sign = -1.0 if diff_step < 0 else 1.0

    def order(c: Contribution | dict[str, Any]) -> tuple[float, float]:
        value = c.diff_s if isinstance(c, Contribution) else c["diff_s"]
        return (-value * sign, -abs(value))

    causes.sort(key=order)
    waits.sort(key=order)
    segments_rows.sort(key=order)
    ranks_rows.sort(key=order)
    groups_rows.sort(key=lambda g: (-(g["transfer_diff_s"] + g["skew_diff_s"]) * sign, g["group"], g["op"]))
    return Comparison(a, b, matching, causes, waits, segments_rows, ranks_rows, groups_rows)


# --- text ---------------------------------------------------------------------------------------


def _ms(seconds: float, unit: bool = True) -> str:
    """A signed change in milliseconds: ``+212 ms``, ``-0.4 ms``."""
    ms = seconds * 1e3
    text = f"{ms:+,.0f}" if abs(ms) >= 10 else f"{ms:+,.1f}"
    return f"{text} ms" if unit else text


def _plain_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if abs(ms) >= 10 else f"{ms:,.1f}"


def _share(share: float | None) -> str:
    return "" if share is None else f"{share:.0%}"


def _warmup(side: SideData) -> str:
    return "" if side.side.explicit or side.first_step <= 1 else f", after {WARMUP_STEPS} warm-up steps"


def _text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Rows aligned under the header: text left, numbers right."""
    if not rows:
        return ["  (none)"]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    numeric = [all(_numeric(str(r[i])) for r in rows) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  " + "  ".join(str(c).rjust(w) if n else str(c).ljust(w) for c, w, n in zip(cells, widths, numeric)).rstrip()

    return [line(header), *(line(r) for r in rows)]


def _numeric(text: str) -> bool:
    return text == "" or text.replace(",", "").replace("%", "").replace("+", "").replace("-", "").replace(".", "").isdigit()
