"""Stragglers: a rank whose own compute is slower than that of the ranks doing the same work.

Ranks of one pipeline stage run the same layers on the same amount of data, so each compute,
data and optimizer segment is compared, step by step, with the median of its stage (robust to
the straggler itself). Compute time comes from ``step_segments``: the pieces of a segment with
its waits in collectives cut out, so a tensor-parallel peer waiting for the straggler does not
look slow. Communication time is the wrong signal: the fast ranks are the ones that wait.
Corroboration: in the groups it belongs to, the straggler arrives last at collectives.
Where the agent measured the CPU time of every piece of a segment (host-only runs on shared
cores, see agent.recorder), that is compared instead of wall time: it measures the work, while
wall time there mostly measures the scheduler. Wall time is compared too, with a far higher bar
(``straggler_wall_excess``, at every step of the window): a rank starved of CPU (a throttled host,
a CPU quota) does the same work in the same CPU time, and only waits longer to run.
A rank is a straggler when it has been slow for several steps in a row (a single fast step among
them allowed): slow steps scattered among fast ones are a busy host's scheduler, not a slow rank.
A host is named when every rank on it (two or more) is a straggler.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np

from rankscope.collector.anatomy.path import INCIDENT_STEPS, incident_cost
from rankscope.collector.diagnosis.context import RunContext
from rankscope.collector.diagnosis.incidents import Finding

SEGMENTS_SQL = (
    "SELECT name, step, rank, sum(total_ns) AS wall, sum(total_cpu_ns) AS cpu, sum(pieces) = sum(cpu_pieces) AS has_cpu, "
    "toUnixTimestamp64Nano(min(first_start)) AS started "
    "FROM step_segments WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND kind IN ('compute', 'data', 'optimizer') "
    "AND step BETWEEN {first_step:UInt32} AND {last_step:UInt32} GROUP BY name, step, rank"
)

#: stages of up to this many ranks measure a rank's noise on the other ranks' points (see POINTS_SQL)
LEAVE_ONE_OUT_UP_TO = 16


def _median(array: str) -> str:
    """SQL for the median of ``array`` as numpy computes it (the mean of the two middle values)."""
    return f"(arrayReduce('quantileExactLow(0.5)', {array}) + arrayReduce('quantileExactHigh(0.5)', {array})) / 2"


# Every (rank, segment, step) point compared with its stage, computed in the store: a 12,288-rank
# job has about a million points in the window, too many to move and loop over in Python on every
# pass. One pass of nested window functions (a CTE referenced twice is planned and run twice):
# - the measure: CPU time for a segment when every piece of it, on every rank, had it measured;
# - the stage's median per (segment, step), exact and equal to numpy's (the mean of the two middle
#   values: quantileExactLow and quantileExactHigh); in a stage of four ranks or fewer, the
#   median of the others (the straggler would pull a small median towards itself);
# - the ratio, capped at 1 when the excess is too small to matter (a millisecond of data loading);
# - ``recent``: among the last ``window`` points of its (rank, segment) series;
# - the threshold of a rank's segment: 1 + max(excess, 3 robust standard deviations (1.4826 MAD)
#   of its stage's recent ratios), so that a busy host's noise does not read as a straggler while
#   a real one still stands out. In a stage of up to ``LEAVE_ONE_OUT_UP_TO`` ranks the noise is that
#   of the other ranks: a quarter of a four-rank stage's points are the straggler's own, which
#   would raise its bar; in a larger stage one rank's share moves the MAD little.
# Only the points of series slow at ``min_steps`` or more steps come back: no other can be a straggler.
POINTS_SQL = f"""
SELECT name, step, rank, ns, median, ratio, started, wall_only, threshold FROM (
  SELECT *, countIf(ratio >= threshold) OVER (PARTITION BY rank, name) AS slow_steps FROM (
    SELECT *, 1 + greatest({{excess:Float64}}, 3 * 1.4826 * if(empty(peers), stage_mad, {_median("arrayMap(x -> abs(x - peers_mid), peers)")})) AS threshold
    FROM (
      SELECT *, (quantileExactLowIf(0.5)(dev, recent) OVER segment_stage + quantileExactHighIf(0.5)(dev, recent) OVER segment_stage) / 2 AS stage_mad,
             arrayMap(p -> p.2, arrayFilter(p -> p.1 != rank, small_stage)) AS peers, {_median("peers")} AS peers_mid
      FROM (
        SELECT *, abs(ratio - (quantileExactLowIf(0.5)(ratio, recent) OVER segment_stage
                               + quantileExactHighIf(0.5)(ratio, recent) OVER segment_stage) / 2) AS dev,
               groupArrayIf((rank, ratio), recent AND stage_ranks <= {LEAVE_ONE_OUT_UP_TO}) OVER segment_stage AS small_stage
        FROM (
          SELECT *, if(ns - median >= {{min_excess_ns:Float64}}, ns / median, least(ns / median, 1.0)) AS ratio,
                 row_number() OVER (PARTITION BY rank, name ORDER BY step DESC) <= {{window:UInt32}} AS recent,
                 max(n) OVER (PARTITION BY name, stage) AS stage_ranks
          FROM (
          SELECT *, arrayFilter((x, i) -> i != indexOf(few, ns), few, arrayEnumerate(few)) AS others,
                 if(n <= 4, {_median("others")}, (lo + hi) / 2) AS median
          FROM (
            SELECT *, count() OVER cell AS n, quantileExactLow(0.5)(ns) OVER cell AS lo,
                   quantileExactHigh(0.5)(ns) OVER cell AS hi, groupArray(5)(ns) OVER cell AS few
            FROM (
              SELECT s.*, greatest(r.pp, 0) AS stage FROM (
                SELECT name, step, rank, started, min(has_cpu) OVER (PARTITION BY name) = 0 OR {{wall:UInt8}} = 1 AS wall_only,
                       if(wall_only, wall, cpu) AS ns
                FROM ({SEGMENTS_SQL})
              ) AS s
              LEFT JOIN (SELECT rank, argMax(pp_rank, registered) AS pp FROM ranks WHERE run_id = {{run:String}} AND attempt = {{attempt:UInt16}} GROUP BY rank) AS r
              USING (rank)
            )
            WINDOW cell AS (PARTITION BY name, step, stage)
          )
          WHERE n >= 2
        )
        WHERE median > 0
      )
      WINDOW segment_stage AS (PARTITION BY name, stage)
    )
    WINDOW segment_stage AS (PARTITION BY name, stage)
    )
  )
)
WHERE slow_steps >= {{min_steps:UInt32}}
"""

NEWEST_SQL = (
    "SELECT max(step) AS newest FROM step_segments WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND step >= {since:UInt32}"
)
CPU_MEASURED_SQL = (
    "SELECT countIf(cpu_pieces > 0) > 0 AS cpu FROM step_segments WHERE run_id = {run:String} AND attempt = {attempt:UInt16} "
    "AND step BETWEEN {first_step:UInt32} AND {last_step:UInt32}"
)
EVIDENCE_SQL = (
    "SELECT step, rank, round(sum(total_ns) / 1e6, 2) AS wall_ms, round(sum(total_cpu_ns) / 1e6, 2) AS cpu_ms FROM step_segments "
    "WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND name = {segment:String} AND rank IN {ranks:Array(UInt32)} "
    "GROUP BY step, rank ORDER BY step, rank"
)

# Only the groups of the ranks asked about: every group's collectives would be a million rows at scale.
ARRIVALS_SQL = (
    "SELECT rank, count() AS collectives, countIf(is_last) AS last FROM ("
    "  SELECT rank, issue_time = max(issue_time) OVER (PARTITION BY group_name, seq) AS is_last,"
    "         count() OVER (PARTITION BY group_name, seq) AS members"
    "  FROM collectives WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND peer = -1 AND step >= {first_step:UInt32}"
    "  AND group_name IN (SELECT DISTINCT group_name FROM collectives WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND peer = -1"
    "                     AND step >= {first_step:UInt32} AND rank IN {ranks:Array(UInt32)})"
    ") WHERE members > 1 AND rank IN {ranks:Array(UInt32)} GROUP BY rank"
)


def detect(ctx: RunContext) -> list[Finding]:
    """Stragglers over the last steps of the run (``straggler_window`` of them and a margin)."""
    s = ctx.settings
    last_step = ctx.newest_step(NEWEST_SQL)
    if last_step == 0:
        return []
    # Completed steps only: the newest is in progress (or was cut short by a hang or crash), and
    # the first two carry start-up and warm-up costs (allocations, first-time code paths).
    last_step -= 1
    first_step = max(3, last_step - 4 * s.straggler_window)
    if last_step < first_step:
        return []
    slow = _slow_segments(ctx, first_step, last_step, wall=False)
    window = {"run": ctx.run_id, "first_step": first_step, "last_step": last_step}
    if ctx.query(CPU_MEASURED_SQL, window).to_pylist()[0]["cpu"]:
        for rank, info in _slow_segments(ctx, first_step, last_step, wall=True).items():
            if rank not in slow or info["ratio"] > slow[rank]["ratio"]:
                slow[rank] = info
    if not slow:
        return []
    arrivals = _arrivals(ctx, first_step, sorted(slow))
    return _findings(ctx, slow, arrivals)


def _slow_segments(ctx: RunContext, first_step: int, last_step: int, *, wall: bool) -> dict[int, dict]:
    """rank -> its slowest persistently slow segment: {segment, ratio, since_step, since_ns, steps, peers_ms, ms}.

    ``wall``: compare wall time even where CPU time was measured, with the higher bar
    ``straggler_wall_excess`` met at every step of the window (its noise comes in runs of steps).
    """
    s = ctx.settings
    min_steps = s.straggler_window if wall else s.straggler_min_steps
    params = {"run": ctx.run_id, "first_step": first_step, "last_step": last_step, "window": s.straggler_window,
              "min_excess_ns": max(s.straggler_min_excess_s, s.straggler_step_share * ctx.median_step_s(first_step, last_step)) * 1e9,
              "excess": max(s.straggler_excess, s.straggler_wall_excess) if wall else s.straggler_excess,
              "min_steps": min_steps, "wall": int(wall)}  # fmt: skip
    cols = ctx.query(POINTS_SQL, params).to_pydict()
    # (rank, segment) -> [(step, ratio, own ns, median ns, started)], for the series that may be slow
    series: dict[tuple[int, str], list[tuple[int, float, int, float, int]]] = defaultdict(list)
    thresholds: dict[tuple[int, str], float] = {}
    wall_only: set[str] = set()
    rows = zip(*(cols[c] for c in ("name", "step", "rank", "ns", "median", "ratio", "started", "wall_only", "threshold")))
    for name, step, rank, ns, median, ratio, started, wall, threshold in rows:
        series[(rank, name)].append((step, ratio, ns, median, started))
        thresholds[(rank, name)] = threshold
        if wall:
            wall_only.add(name)
    found: dict[int, dict] = {}
    for (rank, name), points in series.items():
        threshold = thresholds[(rank, name)]
        points.sort()
        recent = points[-s.straggler_window :]
        slow = [p for p in recent if p[1] >= threshold]
        if len(slow) < min_steps or recent[-1][1] < threshold:
            continue  # not slow often enough lately, or no longer slow
        episode = _episode(points, threshold)
        if sum(p[1] >= threshold for p in episode) < min_steps:
            continue  # slow steps scattered among fast ones: the scheduler's noise, not a slow rank
        ratio = float(np.median([p[1] for p in episode if p[1] >= threshold]))
        if rank not in found or ratio > found[rank]["ratio"]:
            found[rank] = {
                "segment": name,
                "measure": "wall time" if name in wall_only else "CPU time",
                "ratio": round(ratio, 3),
                "threshold": round(threshold, 3),
                "since_step": episode[0][0],
                "since_ns": episode[0][4],
                "last_ns": recent[-1][4],
                "steps": [{"step": p[0], "ratio": round(p[1], 3), "ms": round(p[2] / 1e6, 2), "stage_median_ms": round(p[3] / 1e6, 2)}
                          for p in recent],  # fmt: skip
            }
    return found


def _episode(points: list[tuple], threshold: float) -> list[tuple]:
    """The newest run of slow steps, allowing single steps below the threshold inside it (noise)."""
    start = len(points) - 1
    i = start - 1
    while i >= 0:
        if points[i][1] >= threshold:
            start = i
        elif i == 0 or points[i - 1][1] < threshold:
            break  # two fast steps in a row (or the first step): the episode began after them
        i -= 1
    return points[start:]


def _arrivals(ctx: RunContext, first_step: int, ranks: list[int]) -> dict[int, tuple[int, int]]:
    """rank -> (collectives it took part in, times it arrived last), for ``ranks``."""
    table = ctx.query(ARRIVALS_SQL, {"run": ctx.run_id, "first_step": first_step, "ranks": ranks}).to_pydict()
    return {r: (n, last) for r, n, last in zip(table["rank"], table["collectives"], table["last"])}


def _findings(ctx: RunContext, slow: dict[int, dict], arrivals: dict[int, tuple[int, int]]) -> list[Finding]:
    slow_hosts = ctx.whole_hosts(slow)
    findings: list[Finding] = []
    for host in sorted(slow_hosts):
        ranks = ctx.ranks_of_host[host]
        worst = max(ranks, key=lambda r: slow[r]["ratio"])
        info = slow[worst]
        summary = (f"host {host}: ranks {', '.join(map(str, ranks))} are all slower than their stage peers; "
                   f"{ctx.who(worst)} {info['segment']} {_pct(info['ratio'])} slower since step {info['since_step']}")  # fmt: skip
        found = _finding(ctx, f"straggler:host={host}", ranks, info, arrivals, summary)
        findings.append(replace(found, absorbs=tuple(f"straggler:rank={r}" for r in sorted(ranks, key=lambda r: slow[r]["since_step"]))))
    for rank in sorted(r for r in slow if ctx.host.get(r) not in slow_hosts):
        info = slow[rank]
        summary = f"{ctx.who(rank)}: {info['segment']} {_pct(info['ratio'])} slower than its stage peers since step {info['since_step']}"
        findings.append(_finding(ctx, f"straggler:rank={rank}", [rank], info, arrivals, summary))
    return findings


def _finding(ctx: RunContext, key: str, ranks: list[int], info: dict, arrivals: dict[int, tuple[int, int]], summary: str) -> Finding:
    stage_ranks = sorted(r for r, st in ctx.stage.items() if st == ctx.stage.get(ranks[0], 0))
    evidence = {
        "segment": info["segment"],
        "measure": info["measure"],
        "slow_above_ratio": info["threshold"],
        "ratio_to_stage_median": info["ratio"],
        "since_step": info["since_step"],
        "recent_steps": info["steps"],
        "stage_ranks": stage_ranks,
        "arrived_last": {str(r): {"collectives": arrivals[r][0], "last": arrivals[r][1]} for r in ranks if r in arrivals},
    }
    # what its links on the critical paths of the latest steps cost them (collector/anatomy)
    cost = incident_cost(ctx.query, ctx.run_id, [p["step"] for p in info["steps"][-INCIDENT_STEPS:]], ranks, attempt=ctx.attempt)
    if cost is not None:
        evidence["critical_path_cost"] = cost
        summary = f"{summary}; {cost['text']}"
    return Finding(
        kind="straggler",
        key=key,
        severity="warning",
        ranks=tuple(ranks),
        hosts=ctx.hosts_of(ranks),
        first_seen_ns=info["since_ns"],
        last_seen_ns=info["last_ns"],
        summary=summary,
        evidence=evidence,
        sql=ctx.literal_sql(EVIDENCE_SQL, segment=info["segment"], ranks=stage_ranks),
    )


def _pct(ratio: float) -> str:
    return f"{round(100 * (ratio - 1))}%"

