"""Where each rank's step time goes: compute, exposed communication, pipeline bubble, data, optimizer, unexplained.

Computed in the store on read (chDB and a ClickHouse server alike, the same SQL), for a bounded
range of steps, with no rollup table: ``BOUNDS_SQL`` finds each step's latest attempt and time
bounds, ``BREAKDOWN_SQL`` (with those bound as parameters) does the rest. Every rank's step is its
own timeline of intervals:

- spans of kind ``compute``, ``optimizer``, ``data`` and ``comm`` (the agent cuts compute,
  optimizer and data spans into pieces around the collectives they block in: their pieces never
  include time spent waiting for other ranks);
- collectives and point-to-point operations from issue to end (``peer >= 0``: point-to-point).

Each moment of the step counts once, for the first of these that covers it:

1. ``compute``: a compute span;
2. ``optimizer``: an optimizer span;
3. ``data``: a data-loading span;
4. ``bubble``: a point-to-point operation (a pipeline stage waiting for, or exchanging with, its
   neighbour) that no compute, optimizer or data span overlaps;
5. ``exposed_comm``: a collective or a ``comm`` span that none of the above overlaps (an
   all-reduce running in the background of the backward pass is hidden by it, and not counted);
6. ``unexplained``: the rest of the step's wall time (Python between segments, what no span covers).

A rank's step wall time is from its first to its last recorded moment of the step, or its own
``step_time_s`` (``step_metrics``) where that is longer. Where a step was run again after a
restart, only its latest attempt counts.

How: the length of the union of the intervals of categories 1..k, for k = 1..5, from one sort of
the rank's intervals (a running maximum of the ends of the earlier intervals, per k, as window
functions); category k's time is the k-th union minus the (k-1)-th. Results come per step (the mean
over ranks), per rank (the mean over steps) and for the range (the mean over rank-steps), in one
``GROUPING SETS`` pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

Query = Callable[[str, Mapping[str, object]], pa.Table]

#: the categories, in the order they claim time (``unexplained`` is what none claims)
CATEGORIES = ("compute", "optimizer", "data", "bubble", "exposed_comm", "unexplained")

#: each step's latest attempt and its time bounds (step_segments is keyed by attempt, name and step: cheap).
#: Read first, and bound as parameters into ``BREAKDOWN_SQL``: as a CTE it would be run once per reference.
BOUNDS_SQL = """
SELECT step, attempt, toUnixTimestamp64Nano(lo) AS lo, toUnixTimestamp64Nano(hi) AS hi FROM (
    SELECT step, attempt, min(first_start) AS lo, max(last_end) AS hi, max(attempt) OVER (PARTITION BY step) AS latest
    FROM step_segments
    WHERE run_id = {run:String} AND step BETWEEN {first_step:UInt32} AND {last_step:UInt32}
    GROUP BY step, attempt
) WHERE attempt = latest ORDER BY step
"""

#: a collective issued this long before the first span of its step still counts (ns)
MARGIN_NS = 60 * 10**9

# ``{steps}``: the (step, attempt) pairs that count; ``{lo}``..``{hi}``: their spans' time bounds (ns).
BREAKDOWN_SQL = f"""
WITH intervals AS (
    SELECT rank, step, toUnixTimestamp64Nano(start_time) AS s, toUnixTimestamp64Nano(end_time) AS e,
           multiIf(kind = 'compute', 1, kind = 'optimizer', 2, kind = 'data', 3, 5) AS layer
    FROM spans
    WHERE run_id = {{run:String}} AND step BETWEEN {{first_step:UInt32}} AND {{last_step:UInt32}}
      AND start_time BETWEEN fromUnixTimestamp64Nano({{lo:Int64}}) AND fromUnixTimestamp64Nano({{hi:Int64}})
      AND (step, attempt) IN {{steps:Array(Tuple(UInt32, UInt16))}} AND kind IN ('compute', 'optimizer', 'data', 'comm')
    UNION ALL
    SELECT rank, step, toUnixTimestamp64Nano(issue_time), toUnixTimestamp64Nano(end_time), if(peer >= 0, 4, 5)
    FROM collectives
    WHERE run_id = {{run:String}} AND step BETWEEN {{first_step:UInt32}} AND {{last_step:UInt32}}
      AND issue_time BETWEEN fromUnixTimestamp64Nano({{lo:Int64}} - {MARGIN_NS}) AND fromUnixTimestamp64Nano({{hi:Int64}})
      AND (step, attempt) IN {{steps:Array(Tuple(UInt32, UInt16))}} AND end_time >= issue_time
),
unions AS (
    SELECT rank, step, max(e) - min(s) AS extent,
           sum(if(layer <= 1, greatest(0, e - greatest(s, p1)), 0)) AS u1,
           sum(if(layer <= 2, greatest(0, e - greatest(s, p2)), 0)) AS u2,
           sum(if(layer <= 3, greatest(0, e - greatest(s, p3)), 0)) AS u3,
           sum(if(layer <= 4, greatest(0, e - greatest(s, p4)), 0)) AS u4,
           sum(greatest(0, e - greatest(s, p5))) AS u5
    FROM (
        SELECT rank, step, s, e, layer,
               maxIf(e, layer <= 1) OVER w AS p1, maxIf(e, layer <= 2) OVER w AS p2, maxIf(e, layer <= 3) OVER w AS p3,
               maxIf(e, layer <= 4) OVER w AS p4, max(e) OVER w AS p5
        FROM intervals
        WINDOW w AS (PARTITION BY rank, step ORDER BY s, e ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
    )
    GROUP BY rank, step
),
scalars AS (
    SELECT rank, step, maxIf(value, name = 'step_time_s') AS step_s, maxIf(value, name = 'mfu') AS mfu, countIf(name = 'mfu') > 0 AS has_mfu
    FROM step_metrics
    WHERE run_id = {{run:String}} AND step BETWEEN {{first_step:UInt32}} AND {{last_step:UInt32}} AND name IN ('step_time_s', 'mfu')
      AND (step, attempt) IN {{steps:Array(Tuple(UInt32, UInt16))}}
    GROUP BY rank, step
),
per_rank_step AS (
    SELECT u.rank AS rank, u.step AS step, greatest(u.extent, toInt64(x.step_s * 1e9)) AS wall,
           u.u1 AS compute, u.u2 - u.u1 AS optimizer, u.u3 - u.u2 AS data, u.u4 - u.u3 AS bubble, u.u5 - u.u4 AS exposed_comm,
           wall - u.u5 AS unexplained, x.mfu AS mfu, x.has_mfu AS has_mfu
    FROM unions AS u LEFT JOIN scalars AS x ON x.rank = u.rank AND x.step = u.step
)
SELECT grouping(step) = 0 AND grouping(rank) = 1 AS by_step, grouping(rank) = 0 AND grouping(step) = 1 AS by_rank,
       if(by_step, step, 0) AS at_step, if(by_rank, rank, 0) AS at_rank, count() AS rank_steps, avg(wall) AS wall_ns, max(wall) AS max_wall_ns,
       avg(compute) AS compute_ns, avg(optimizer) AS optimizer_ns, avg(data) AS data_ns, avg(bubble) AS bubble_ns,
       avg(exposed_comm) AS exposed_comm_ns, avg(unexplained) AS unexplained_ns,
       avgIf(mfu, has_mfu = 1) AS mfu, countIf(has_mfu = 1) AS mfu_points
FROM per_rank_step
GROUP BY GROUPING SETS ((step), (rank), ())
ORDER BY by_step DESC, by_rank DESC, at_step, at_rank
"""


@dataclass(frozen=True)
class Split:
    """Mean nanoseconds per category over ``rank_steps`` rank-steps; they add up to ``wall_ns``."""

    wall_ns: float
    max_wall_ns: float
    ns: dict[str, float]
    rank_steps: int
    #: mean MFU where the trainer reported it (GPU runs), else None; over ``mfu_points`` rank-steps
    mfu: float | None = None
    mfu_points: int = 0

    def share(self, category: str) -> float:
        return self.ns[category] / self.wall_ns if self.wall_ns > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"wall_ms": round(self.wall_ns / 1e6, 3), "max_wall_ms": round(self.max_wall_ns / 1e6, 3),
                **{f"{c}_ms": round(self.ns[c] / 1e6, 3) for c in CATEGORIES}, "rank_steps": self.rank_steps,
                "mfu": self.mfu}  # fmt: skip


def merge(splits: list[Split]) -> Split:
    """The mean of several splits, weighted by their rank-steps."""
    n = sum(s.rank_steps for s in splits)
    points = sum(s.mfu_points for s in splits)
    return Split(
        wall_ns=sum(s.wall_ns * s.rank_steps for s in splits) / n, max_wall_ns=max(s.max_wall_ns for s in splits),
        ns={c: sum(s.ns[c] * s.rank_steps for s in splits) / n for c in CATEGORIES}, rank_steps=n,
        mfu=sum((s.mfu or 0.0) * s.mfu_points for s in splits) / points if points else None, mfu_points=points,
    )  # fmt: skip


@dataclass
class Breakdown:
    """The breakdown of steps ``first_step``..``last_step``: per step, per rank and the whole range."""

    run_id: str
    first_step: int
    last_step: int
    total: Split | None = None
    by_step: dict[int, Split] = field(default_factory=dict)
    by_rank: dict[int, Split] = field(default_factory=dict)

    def median_step(self) -> int | None:
        """The step whose slowest rank's wall time is the median of the range (the lower one of two)."""
        if not self.by_step:
            return None
        ordered = sorted(self.by_step, key=lambda s: (self.by_step[s].max_wall_ns, s))
        return ordered[(len(ordered) - 1) // 2]


#: one statement reads at most this many rank-steps (a longer range is read in pieces and merged)
CHUNK_RANK_STEPS = 250_000

RANKS_SQL = "SELECT uniqExact(rank) AS ranks FROM ranks WHERE run_id = {run:String}"


def breakdown(query: Query, run_id: str, first_step: int, last_step: int, *, ranks: int | None = None) -> Breakdown:
    """The breakdown of ``run_id``'s steps ``first_step``..``last_step`` (the latest attempt of each).

    Two statements: the steps' attempts and bounds (``BOUNDS_SQL``), then ``BREAKDOWN_SQL``; a range of
    more than ``CHUNK_RANK_STEPS`` rank-steps (``ranks``: the job's size, read from the store when None)
    is read in pieces of whole steps, one statement each, and merged.
    """
    out = Breakdown(run_id, first_step, last_step)
    bounds = query(BOUNDS_SQL, {"run": run_id, "first_step": first_step, "last_step": last_step}).to_pylist()
    if not bounds:
        return out
    if ranks is None:
        ranks = int(query(RANKS_SQL, {"run": run_id}).to_pylist()[0]["ranks"] or 1)
    per_chunk = max(1, CHUNK_RANK_STEPS // max(ranks, 1))
    by_rank: dict[int, list[Split]] = {}
    totals: list[Split] = []
    for i in range(0, len(bounds), per_chunk):
        chunk = bounds[i : i + per_chunk]
        params = {"run": run_id, "first_step": chunk[0]["step"], "last_step": chunk[-1]["step"],
                  "steps": [(b["step"], b["attempt"]) for b in chunk], "lo": min(b["lo"] for b in chunk),
                  "hi": max(b["hi"] for b in chunk)}  # fmt: skip
        for r in query(BREAKDOWN_SQL, params).to_pylist():
            if not r["rank_steps"]:
                continue
            split = Split(
                wall_ns=float(r["wall_ns"]), max_wall_ns=float(r["max_wall_ns"]), ns={c: float(r[f"{c}_ns"]) for c in CATEGORIES},
                rank_steps=int(r["rank_steps"]), mfu=float(r["mfu"]) if r["mfu_points"] else None, mfu_points=int(r["mfu_points"]),
            )  # fmt: skip
            if r["by_step"]:
                out.by_step[int(r["at_step"])] = split
            elif r["by_rank"]:
                by_rank.setdefault(int(r["at_rank"]), []).append(split)
            else:
                totals.append(split)
    out.by_rank = {rank: merge(parts) for rank, parts in sorted(by_rank.items())}
    out.total = merge(totals) if totals else None
    return out
