"""Late arrivals: a rank that its groups' collectives wait for, step after step.

A collective completes only once its last member arrives, so a rank that arrives late costs every
member of the group that much, whatever its spans say: DDP waits for its gradient all-reduces
outside any compute segment, a rank starved of CPU computes no slower in CPU time, and a framework
that runs forward and backward inside the optimizer's step (Lightning) has one segment a step.

What a rank costs its group at a collective is how long the others waited for it alone: its
arrival minus the second-latest member's, when it arrived last. At a step, summed over the group's
collectives of the step, it is late when that reaches ``straggler_excess`` of the median step (and
``straggler_min_excess_s``) and the others' noise, the median spread of the others' arrivals (on
shared cores, whoever the scheduler ran last arrives last by a few ms, with the others as spread);
a straggler when late at all steps of the window but one (as the wall-time comparison of the
segments), in every group it took part in: a rank that waited in one group for a slow member
arrives late in its other groups, never in the one it waited in. Runs of several pipeline stages
are left to the segments: a stage after a slow one arrives late at its data-parallel all-reduce
with compute as fast as ever. Ranks of a host that arrive late together (a throttled host) take
turns at arriving last: the segments' wall-time comparison names the host.
"""

from __future__ import annotations

from rankscope.collector.diagnosis.context import RunContext
from rankscope.collector.diagnosis.segment_window import episode

#: the measure an arrival finding names (the segments' findings name theirs)
SEGMENT = "arrival"

# Per (last rank, group, step): how long the group waited for it alone, the group's noise (the
# median spread of the others' arrivals over the range, once per collective), and when it arrived first. Collectives of groups of two or more members over a step
# range; ``{where}`` narrows the rows further.
_WAITS = (
    "SELECT last_rank AS rank, group_name, step, sum(wait) AS late_ns, sum(noise) AS noise_ns, min(last_issue) AS first_issue FROM ("
    "  SELECT *, quantileExact(0.5)(spread) OVER (PARTITION BY group_name) AS noise FROM ("
    "    SELECT group_name, seq, min(step) AS step, argMax(rank, issue) AS last_rank, groupArraySorted(2)(-issue) AS top,"
    "           top[2] - top[1] AS wait, -top[2] - min(issue) AS spread, -top[1] AS last_issue, count() AS members FROM ("
    "      SELECT group_name, seq, step, rank, toUnixTimestamp64Nano(issue_time) AS issue FROM collectives"
    "      WHERE run_id = {{run:String}} AND attempt = {{attempt:UInt16}} AND peer = -1"
    "      AND step BETWEEN {{first_step:UInt32}} AND {{last_step:UInt32}}{where}"
    "    ) GROUP BY group_name, seq HAVING members > 1"
    "  )"
    ") GROUP BY last_rank, group_name, step"
)
#: (rank, group) late at ``min_steps`` or more of the steps
CANDIDATES_SQL = (
    "SELECT rank, group_name FROM (" + _WAITS.format(where="") + ") "
    "GROUP BY rank, group_name HAVING countIf(late_ns >= {bar_ns:Int64} AND late_ns >= noise_ns) >= {min_steps:UInt32}"
)
#: the groups of ``ranks`` that held collectives over the steps
GROUPS_SQL = (
    "SELECT DISTINCT rank, group_name FROM collectives WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND peer = -1 "
    "AND step BETWEEN {first_step:UInt32} AND {last_step:UInt32} AND rank IN {ranks:Array(UInt32)}"
)
#: the steps of ``ranks`` in ``groups``, over the longer range their episodes are looked for in
STEPS_SQL = _WAITS.format(where=" AND group_name IN {groups:Array(String)}") + " HAVING rank IN {ranks:Array(UInt32)} ORDER BY rank, step"
#: for people (an incident's SQL): who arrived last at each group's collectives of each step, how long the others waited for it
EVIDENCE_SQL = _WAITS.format(where="") + " ORDER BY group_name, step"


def late_ranks(ctx: RunContext, first_step: int, last_step: int, step_s: float) -> dict[int, dict]:
    """rank -> its late episode over steps ``first_step``..``last_step``, in the shape of the straggler
    detector's slow episodes (``straggler._findings``), for the ranks late lately; ``step_s``: the
    median step time (s), 0 when unknown."""
    s = ctx.settings
    if any(stage > 0 for stage in ctx.stage.values()):
        return {}
    bar_ns = int(max(s.straggler_min_excess_s, s.straggler_excess * step_s) * 1e9)
    min_steps = s.straggler_window - 1
    newest = {"run": ctx.run_id, "first_step": max(first_step, last_step - s.straggler_window + 1), "last_step": last_step}
    late = ctx.query(CANDIDATES_SQL, {**newest, "bar_ns": bar_ns, "min_steps": min_steps}).to_pylist()
    if not late:
        return {}
    candidates = sorted({r["rank"] for r in late})
    took_part: dict[int, set[str]] = {}
    for r in ctx.query(GROUPS_SQL, {**newest, "ranks": candidates}).to_pylist():
        if len(ctx.groups.get(r["group_name"], (0, 0))) > 1:  # a group of one waits for nobody
            took_part.setdefault(r["rank"], set()).add(r["group_name"])
    late_in: dict[int, set[str]] = {}
    for r in late:
        late_in.setdefault(r["rank"], set()).add(r["group_name"])
    ranks = sorted(r for r, groups in late_in.items() if took_part.get(r, set()) <= groups)
    if not ranks:
        return {}
    params = {"run": ctx.run_id, "first_step": first_step, "last_step": last_step, "ranks": ranks,
              "groups": sorted({g for r in ranks for g in late_in[r]})}  # fmt: skip
    steps: dict[int, dict[int, tuple[float, int, list[str]]]] = {}  # rank -> step -> (wait, first issue, groups)
    for r in ctx.query(STEPS_SQL, params).to_pylist():
        if r["group_name"] not in late_in[r["rank"]]:
            continue
        wait = r["late_ns"] if r["late_ns"] >= r["noise_ns"] else 0  # within the others' noise: not late
        at = steps.setdefault(r["rank"], {})
        before, issued, groups = at.get(r["step"], (float("inf"), r["first_issue"], []))
        at[r["step"]] = (min(before, wait), min(issued, r["first_issue"]), [*groups, r["group_name"]])  # late in every group
    found = {}
    for rank, at in steps.items():
        for step in at:  # a step it was late in some of its groups only
            if len(at[step][2]) < len(late_in[rank]):
                at[step] = (0, *at[step][1:])
        info = _episode_of(at, range(first_step, last_step + 1), bar_ns, step_s, s.straggler_window, min_steps)
        if info is not None:
            found[rank] = info
    return found


def _episode_of(at: dict[int, tuple[float, int, list[str]]], steps: range, bar_ns: int, step_s: float, window: int,
                min_steps: int) -> dict | None:  # fmt: skip
    """A rank's late episode over ``steps`` from the steps it arrived last in (step -> how long the group
    waited for it, when it arrived, its groups), or None when it is not late often enough lately."""
    step_ns = step_s * 1e9
    points = [(step, 1 + wait / step_ns if step_ns else 1.0, wait, step_ns, bar_ns) for step in steps for wait in [at.get(step, (0,))[0]]]
    recent = points[-window:]
    if sum(p[2] >= bar_ns for p in recent) < min_steps or not any(p[2] >= bar_ns for p in recent[-2:]):
        return None
    late_points = [p for p in episode(points, lambda p: p[2] >= bar_ns) if p[2] >= bar_ns]
    if len(late_points) < min_steps:
        return None
    late_ms = sorted(p[2] for p in late_points)[len(late_points) // 2] / 1e6
    groups = sorted({g for p in late_points for g in at[p[0]][2]})
    return {
        "segment": SEGMENT,
        "measure": "arrival at collectives",
        "ratio": round(sorted(p[1] for p in late_points)[len(late_points) // 2], 3),
        "threshold": round(1 + bar_ns / step_ns, 3) if step_ns else 1.0,
        "since_step": late_points[0][0],
        "since_ns": at[late_points[0][0]][1],
        "last_ns": at[late_points[-1][0]][1],
        "segments": [SEGMENT],
        "groups": groups,
        "text": f"arrives last at {', '.join(groups)}'s collectives, {late_ms:.0f} ms a step after the others (median)",
        "steps": [{"step": p[0], "late_ms": round(p[2] / 1e6, 2), "step_ms": round(p[3] / 1e6, 2), "late_above_ms": round(bar_ns / 1e6, 2)}
                  for p in recent],  # fmt: skip
    }
