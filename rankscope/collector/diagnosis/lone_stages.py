"""Ranks alone in their pipeline stage: each compared with its own first steps, against the other stages' change.

A pipeline of one rank a stage (tensor and data parallelism 1) leaves the straggler detector nobody
to compare a rank with: its stage's median is itself (campaign seed 1173170413: tp1 pp4 dp1, rank 1
1.39x slower from step 6, the job 17% slower, named by nothing). Stages run different layers (the
last one the loss head), so their times differ by design; but each stage's time is steady from step
to step. So a lone rank's step compute (CPU time where every piece had it measured, else wall time)
is set beside its own over the run's first steps (``BASELINE_STEPS``, the median of them), and that
relative time beside the other lone ranks' at the same step: what the point is compared with is its
baseline times the median of the others' relative times (a change of the whole machine moves them
all). The bar, the noise and the steps needed are the stage comparison's (``segment_window.slow_columns``).
A rank slow from its first steps on is not seen this way.
"""

from __future__ import annotations

import numpy as np

from rankscope.collector.diagnosis.context import RunContext
from rankscope.collector.diagnosis.segment_window import KINDS, STEP_COMPUTE, SegmentWindow, Series, slow_columns, stage_medians

#: the steps a lone rank's baseline is the median of (the first carries start-up costs; the median
#: keeps a fault from the third step out of it)
BASELINE_STEPS = (1, 2, 3)
#: what a lone rank's finding was compared with (its evidence's ``compared_with``)
COMPARED_WITH = f"its own step compute in steps {BASELINE_STEPS[0]}-{BASELINE_STEPS[-1]}, times the other lone stages' change since"
#: the fewest lone ranks compared: each needs two others to tell its change from the machine's
MIN_LONE = 3
#: a lone rank's step compute at the baseline steps
BASELINE_SQL = (
    "SELECT rank, step, sum(total_ns) AS wall, sum(total_cpu_ns) AS cpu, sum(pieces) = sum(cpu_pieces) AS has_cpu FROM step_segments "
    f"WHERE run_id = {{run:String}} AND attempt = {{attempt:UInt16}} AND kind IN {KINDS} AND step IN {{steps:Array(UInt32)}} "
    "AND rank IN {ranks:Array(UInt32)} GROUP BY rank, step"
)
#: per step, how long (ns) the ranks receiving from ``rank`` waited for its sends: each receive posted
#: before the matching send (the same group and sequence number, which count per direction and pair)
HELD_SQL = (
    "SELECT sent.step AS step, sum(greatest(sent.at - got.at, 0)) AS waited_ns FROM ("
    "  SELECT group_name, seq, peer, step, toUnixTimestamp64Nano(issue_time) AS at FROM collectives WHERE run_id = {run:String}"
    "  AND attempt = {attempt:UInt16} AND rank = {rank:UInt32} AND peer >= 0 AND match(op, 'send[^:]*$')"
    "  AND step BETWEEN {first_step:UInt32} AND {last_step:UInt32}"
    ") AS sent INNER JOIN ("
    "  SELECT group_name, seq, rank, toUnixTimestamp64Nano(issue_time) AS at FROM collectives WHERE run_id = {run:String}"
    "  AND attempt = {attempt:UInt16} AND peer = {rank:UInt32} AND match(op, 'recv[^:]*$')"
    "  AND step BETWEEN {first_step:UInt32} AND {last_step:UInt32}"
    ") AS got ON sent.group_name = got.group_name AND sent.seq = got.seq AND sent.peer = got.rank GROUP BY step"
)
#: ``ctx.seen`` key: (the attempt, its baselines), once every lone rank has all its baseline steps stored
_BASELINES = "lone_stages.baselines"


def lone_ranks(ctx: RunContext) -> list[int]:
    """The ranks alone in their pipeline stage, when there are ``MIN_LONE`` or more of them."""
    members: dict[int, list[int]] = {}
    for rank, stage in ctx.stage.items():
        members.setdefault(stage, []).append(rank)
    lone = sorted(ranks[0] for ranks in members.values() if len(ranks) == 1)
    return lone if len(lone) >= MIN_LONE else []


def slow_series(ctx: RunContext, window: SegmentWindow, *, min_excess_ns: float, excess: float, window_steps: int,
                min_steps: int) -> list[Series]:  # fmt: skip
    """The lone ranks slow at ``min_steps`` or more of the window's steps against their own first steps,
    as ``SegmentWindow.slow_series``' series of the step's compute (its segments summed)."""
    lone = lone_ranks(ctx)
    if not lone or not window.cells:
        return []
    steps = sorted({s for _, s in window.cells})
    wall_only = any(cell.cpu is None for cell in window.cells.values())
    ns = np.full((len(steps), len(lone)), np.nan)
    for i, step in enumerate(steps):
        cells = [cell for (_, s), cell in window.cells.items() if s == step]
        for j, rank in enumerate(lone):
            points = [(cell.wall if wall_only else cell.cpu)[rank] for cell in cells if rank < len(cell.wall)]  # type: ignore[index]
            points = [p for p in points if not np.isnan(p)]
            ns[i, j] = sum(points) if points else np.nan
    # A rank's rows come in step order: once each has a point two steps past the baseline's, all of its
    # baseline steps' rows are in (read then, once).
    past = np.asarray(steps) >= BASELINE_STEPS[-1] + 2
    if not (~np.isnan(ns[past])).any(axis=0).all():
        return []
    baselines = _baselines(ctx, lone)
    if not baselines:
        return []
    base = np.array([baselines[r][1 if wall_only else 0] for r in lone], dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = stage_medians(ns / base[None, :]) * base[None, :]
    found = slow_columns(STEP_COMPUTE, np.asarray(steps), ns, expected, np.array([0, len(lone)]), wall_only=wall_only,
                         min_excess_ns=min_excess_ns, excess=excess, window=window_steps, min_steps=min_steps)  # fmt: skip
    for x in found:
        x.rank = lone[x.rank]
    return found


def describe(ratio: float) -> str:
    """A lone rank's slowness, for an incident's summary."""
    steps = f"{BASELINE_STEPS[0]}-{BASELINE_STEPS[-1]}"
    return f"step compute {round(100 * (ratio - 1))}% slower than in steps {steps}, beside the other pipeline stages (each alone in its stage)"


def _baselines(ctx: RunContext, lone: list[int]) -> dict[int, tuple[float, float]] | None:
    """rank -> the median of its step compute over ``BASELINE_STEPS`` (CPU ns, NaN where a piece had none
    measured; wall ns), read once every lone rank has all those steps stored; None before."""
    kept = ctx.seen.get(_BASELINES)
    if kept is not None and kept[0] == ctx.attempt and set(kept[1]) == set(lone):
        return kept[1]
    rows = ctx.query(BASELINE_SQL, {"run": ctx.run_id, "steps": list(BASELINE_STEPS), "ranks": lone}).to_pylist()
    by_rank: dict[int, list[dict]] = {}
    for row in rows:
        by_rank.setdefault(int(row["rank"]), []).append(row)
    if any(len(by_rank.get(r, [])) < len(BASELINE_STEPS) for r in lone):
        return None
    baselines = {
        r: (float(np.median([row["cpu"] if row["has_cpu"] else np.nan for row in by_rank[r]])), float(np.median([row["wall"] for row in by_rank[r]])))
        for r in lone
    }  # fmt: skip
    ctx.seen[_BASELINES] = (ctx.attempt, baselines)
    return baselines


def held_back(ctx: RunContext, ranks: list[int], first_step: int, last_step: int) -> dict[int, dict[int, int]]:
    """rank -> step -> how long (ns) its pipeline neighbours waited for its sends at the step: what a lone
    stage costs the others (it takes part in no collective that waits for it alone: a slow middle stage
    of four arrives at the pipeline's all-reduces before the first stage, whose last backward comes last)."""
    out: dict[int, dict[int, int]] = {}
    for rank in ranks:
        rows = ctx.query(HELD_SQL, {"run": ctx.run_id, "rank": rank, "first_step": first_step, "last_step": last_step}).to_pylist()
        out[rank] = {int(r["step"]): int(r["waited_ns"]) for r in rows}
    return out
