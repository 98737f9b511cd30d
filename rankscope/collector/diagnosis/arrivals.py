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
segments; the window as long as one of its group's members last that often by chance is unlikely:
``steps_needed``), or last at every step of it, by the bar at all but one, with its median wait above the
others' noise (a throttled host beside a CPU hog, last at every all-reduce, its waits often within
the others' 60-70 ms spread), in every group it took part in: a rank that waited in one group for a slow member
arrives late in its other groups, never in the one it waited in. Runs of several pipeline stages
are left to the segments: a stage after a slow one arrives late at its data-parallel all-reduce
with compute as fast as ever.

Ranks of a host that arrive late together (a throttled host, two starved ranks) take turns at
arriving last, and neither is late alone: hosts are judged the same way, a host's arrival being its
first rank's (all of them after every other host's ranks) against the other hosts' last, in the
groups that span hosts. A late host names all its ranks (the straggler names the host); one slow
rank of a host is no late host, its host-mate arriving with the others.

A rank is judged once the rows of all its groups are in. The collectives no wrapper sees (DTensor's
functional collectives, DDP's reducer) come from the flight recorder, read every few seconds: a rank
seen late in its data-parallel group while its tensor-parallel group's rows of the same steps are
still on their way looks late in every group it took part in (campaign seeds 1716390287 and
769188504, FSDP2 with DTensor on a 2 x 2 mesh: live, for one flush cycle, a rank "arrives last at
mesh_dp:1's collectives", named by no pass once the rest came).
"""

from __future__ import annotations

from collections.abc import Callable

from rankscope.collector.diagnosis.context import RunContext
from rankscope.collector.diagnosis.segment_window import episode
from rankscope.common.settings import Settings

#: the measure an arrival finding names (the segments' findings name theirs)
SEGMENT = "arrival"

# Per (last rank, group, step): how long the group waited for it alone, the group's noise (the
# median spread of the others' arrivals over the range, once per collective), and when it arrived first. Collectives of groups of two or more members over a step
# range; ``{where}`` narrows the rows further. The rows' ``{who}``: a rank, or (``_BY_HOST``) a host,
# each arriving at ``first`` (a rank: its arrival; a host: its first rank's) and done at ``latest``.
_WAITS = (
    "SELECT last AS who, group_name, step, sum(wait) AS late_ns, sum(noise) AS noise_ns, min(last_issue) AS first_issue FROM ("
    "  SELECT *, quantileExact(0.5)(spread) OVER (PARTITION BY group_name) AS noise FROM ("
    "    SELECT group_name, seq, min(at_step) AS step, argMax(who, first) AS last, max(first) AS last_issue,"
    "           arrayMax(arrayFilter((t, w) -> w != last, groupArray(latest), groupArray(who))) AS others,"
    "           greatest(last_issue - others, 0) AS wait, others - min(first) AS spread, count() AS members FROM ("
    "      SELECT group_name, seq, min(step) AS at_step, {who} AS who, min(toUnixTimestamp64Nano(issue_time)) AS first,"
    "             max(toUnixTimestamp64Nano(issue_time)) AS latest FROM collectives"
    "      WHERE run_id = {{run:String}} AND attempt = {{attempt:UInt16}} AND peer = -1"
    "      AND step BETWEEN {{first_step:UInt32}} AND {{last_step:UInt32}}{where} GROUP BY group_name, seq, who"
    "    ) GROUP BY group_name, seq HAVING members > 1"
    "  )"
    ") GROUP BY who, group_name, step"
)
_BY_RANK = {"who": "rank", "type": "UInt32"}
#: how likely one of a group's members (ranks, or hosts) may be last at all but one of a window's steps
#: by chance, at most: the window is as long as that takes (``steps_needed``)
BY_CHANCE = 0.005
_BY_HOST = {"who": "transform(rank, {ranks:Array(UInt32)}, {hosts:Array(String)}, '')", "type": "String"}


def _sql(by: dict[str, str]) -> tuple[str, str]:
    """(candidates, steps) for ``by``: the (who, group) late at ``min_steps`` or more of the steps, and
    the steps of ``whos`` in ``groups`` over the longer range their episodes are looked for in."""
    candidates = (
        "SELECT who, group_name, countIf(late_ns > 0) >= {window:UInt32} AND countIf(late_ns >= {bar_ns:Int64}) >= {min_steps:UInt32} "
        "AND quantileExact(0.5)(late_ns) >= any(noise_ns) AS always FROM (" + _WAITS.format(who=by["who"], where="") + ") "
        "GROUP BY who, group_name HAVING countIf(late_ns >= {bar_ns:Int64} AND late_ns >= noise_ns) >= {min_steps:UInt32} OR always"
    )
    steps = _WAITS.format(who=by["who"], where=" AND group_name IN {groups:Array(String)}") + f" HAVING who IN {{whos:Array({by['type']})}} ORDER BY who, step"
    return candidates, steps


#: ``ctx.seen`` key: rank -> its groups of two or more (``_groups_of``)
_GROUPS_KEY = "arrivals.groups"
#: the groups ``ranks`` held collectives in over the steps, with the newest step of each
GROUPS_SQL = (
    "SELECT rank, group_name, max(step) AS newest FROM collectives WHERE run_id = {run:String} AND attempt = {attempt:UInt16} "
    "AND peer = -1 AND step BETWEEN {first_step:UInt32} AND {last_step:UInt32} AND rank IN {ranks:Array(UInt32)} GROUP BY rank, group_name"
)
#: how far the rows of ``ranks`` in each of their groups have come (step 0, the set-up, left out): the
#: steps they held collectives at, the newest of them, and when the newest was issued
REACHED_SQL = (
    "SELECT group_name, min(step) AS first, max(step) AS reached, uniqExact(step) AS steps, "
    "toUnixTimestamp64Nano(max(issue_time)) AS newest_ns FROM collectives WHERE run_id = {run:String} AND attempt = {attempt:UInt16} "
    "AND rank IN {ranks:Array(UInt32)} AND peer = -1 AND step BETWEEN 1 AND {last_step:UInt32} AND group_name IN {groups:Array(String)} "
    "GROUP BY group_name"
)
#: a group whose newest row was issued this long before its rank's other groups' is done, not behind: the
#: flight recorder is read every ``fr_interval_s`` (2 s) and its rows flushed within seconds
BEHIND_S = 10.0
#: for people (an incident's SQL): who arrived last at each group's collectives of each step, how long the others waited for it
EVIDENCE_SQL = _WAITS.format(who="rank", where="") + " ORDER BY group_name, step"
#: who arrived last at the collectives of the groups of ``ranks`` over the steps (``held_back``)
_HELD_SQL = _WAITS.format(who="rank", where=(
    " AND group_name IN (SELECT DISTINCT group_name FROM collectives WHERE run_id = {run:String} AND attempt = {attempt:UInt16}"
    " AND peer = -1 AND step BETWEEN {first_step:UInt32} AND {last_step:UInt32} AND rank IN {ranks:Array(UInt32)})"))


def late_ranks(ctx: RunContext, first_step: int, last_step: int, step_s: float) -> dict[int, dict]:
    """rank -> its late episode over steps ``first_step``..``last_step``, in the shape of the straggler
    detector's slow episodes (``straggler._findings``), for the ranks late lately, alone or with
    every rank of their host; ``step_s``: the median step time (s), 0 when unknown."""
    if any(stage > 0 for stage in ctx.stage.values()):
        return {}
    found = _late(ctx, _BY_RANK, lambda rank: rank, {}, first_step, last_step, step_s)
    shared = {h: on for h, on in ctx.ranks_of_host.items() if len(on) > 1 and not any(r in found for r in on)}
    if shared:
        ranks = sorted(ctx.host)
        hosts = {"ranks": ranks, "hosts": [ctx.host[r] for r in ranks]}
        for host, info in _late(ctx, _BY_HOST, ctx.host.get, hosts, first_step, last_step, step_s).items():
            text = f"with every rank of {host}, {info['text']}, after every rank of the other hosts"
            found.update(dict.fromkeys(shared.get(host, ()), {**info, "text": text}))
    return found


def _late(ctx: RunContext, by: dict[str, str], who_of: Callable[[int], object], params: dict, first_step: int, last_step: int,
          step_s: float) -> dict:  # fmt: skip
    """who (a rank or a host, ``by``; ``who_of`` a rank's) -> its late episode, as ``late_ranks``."""
    s = ctx.settings
    candidates_sql, steps_sql = _sql(by)
    bar_ns = int(max(s.straggler_min_excess_s, s.straggler_excess * step_s) * 1e9)
    if by is _BY_HOST:
        window = steps_needed(s, len(ctx.ranks_of_host))
    else:
        window = steps_needed(s, min((len(g) for g in ctx.groups.values() if len(g) > 1), default=len(ctx.host)))
    min_steps = window - 1
    newest = {**params, "run": ctx.run_id, "first_step": max(first_step, last_step - window + 1), "last_step": last_step}
    late = ctx.query(candidates_sql, {**newest, "bar_ns": bar_ns, "min_steps": min_steps, "window": window}).to_pylist()
    if not late:
        return {}
    candidates = {r["who"] for r in late}
    took_part: dict[object, set[str]] = {}
    members = sorted(r for r in ctx.host if who_of(r) in candidates) if by is _BY_HOST else sorted(candidates)
    for r in ctx.query(GROUPS_SQL, {**newest, "ranks": members}).to_pylist():
        group = ctx.groups.get(r["group_name"])
        if group is None or len({who_of(m) for m in group}) > 1:  # a group of one (rank or host) waits for nobody
            took_part.setdefault(who_of(r["rank"]), set()).add(r["group_name"])
    late_in: dict[object, set[str]] = {}
    for r in late:
        late_in.setdefault(r["who"], set()).add(r["group_name"])
    always = {(r["who"], r["group_name"]) for r in late if r["always"]}
    whos = sorted(w for w, groups in late_in.items() if took_part.get(w, set()) <= groups)
    whos = [w for w in whos if not _behind(ctx, ctx.ranks_of_host.get(w, []) if by is _BY_HOST else [w], last_step)]
    if not whos:
        return {}
    params = {**params, "run": ctx.run_id, "first_step": first_step, "last_step": last_step, "whos": whos,
              "groups": sorted({g for w in whos for g in late_in[w]})}  # fmt: skip
    steps: dict[object, dict[int, tuple[float, int, list[str]]]] = {}  # who -> step -> (wait, first issue, groups)
    for r in ctx.query(steps_sql, params).to_pylist():
        if r["group_name"] not in late_in[r["who"]]:
            continue
        # within the others' noise: not late, unless it was last at every step of the window (``always``)
        wait = r["late_ns"] if r["late_ns"] >= r["noise_ns"] or (r["who"], r["group_name"]) in always else 0
        at = steps.setdefault(r["who"], {})
        before, issued, groups = at.get(r["step"], (float("inf"), r["first_issue"], []))
        at[r["step"]] = (min(before, wait), min(issued, r["first_issue"]), [*groups, r["group_name"]])  # late in every group
    found = {}
    for who, at in steps.items():
        for step in at:  # a step it was late in some of its groups only
            if len(at[step][2]) < len(late_in[who]):
                at[step] = (0, *at[step][1:])
        info = _episode_of(at, range(first_step, last_step + 1), bar_ns, step_s, window, min_steps)
        if info is not None:
            found[who] = info
    return found


def held_back(ctx: RunContext, ranks: list[int], first_step: int, last_step: int) -> dict[int, dict[int, int]]:
    """rank -> step -> how long (ns) its groups waited for it alone at their collectives of the step
    (0 where it was never last), for each of ``ranks`` that took part in collectives of groups of two or
    more up to ``last_step`` (from the set-up on), over the steps of ``first_step``..``last_step`` whose
    collectives are stored: a rank that the others never wait for costs them nothing, whatever its
    spans say. A rank whose rows of those steps are not in yet (the flight recorder's come seconds
    late) maps to no step: nothing is known of it yet (CI of dd7abd5: two ranks raised live on CPU time
    before their all-reduces of the steps came, which then showed nobody waiting for them)."""
    params = {"run": ctx.run_id, "first_step": first_step, "last_step": last_step, "ranks": ranks}
    in_group: dict[str, list[int]] = {}  # group -> the ranks of ``ranks`` in it
    for rank, groups in _groups_of(ctx, ranks, last_step).items():
        for group in groups:
            in_group.setdefault(group, []).append(rank)
    waited: dict[int, dict[int, int]] = {rank: {} for members in in_group.values() for rank in members}
    for r in ctx.query(_HELD_SQL, params).to_pylist() if waited else ():
        for rank in in_group.get(r["group_name"], ()):  # the step's rows are in: it counts, as 0 if another member was last
            at = waited[rank]
            at[r["step"]] = at.get(r["step"], 0) + (int(r["late_ns"]) if r["who"] == rank else 0)
    return waited


def _groups_of(ctx: RunContext, ranks: list[int], last_step: int) -> dict[int, set[str]]:
    """rank -> the groups of two or more it has held collectives in up to ``last_step`` (from the set-up
    on), of those of ``ranks`` that have any. What was read is kept from pass to pass (``ctx.seen``):
    each pass reads a rank's rows after the newest step read of it before (its rows come in step
    order, the flight recorder's seconds late)."""
    known: dict[int, tuple[int, set[str]]] = ctx.seen.setdefault(_GROUPS_KEY, {})  # rank -> (newest step read, groups)
    since: dict[int, list[int]] = {}  # first step to read -> ranks
    for rank in ranks:
        since.setdefault(known.get(rank, (-1, set()))[0] + 1, []).append(rank)
    for first, some in since.items():
        if first > last_step:
            continue
        for r in ctx.query(GROUPS_SQL, {"run": ctx.run_id, "first_step": first, "last_step": last_step, "ranks": some}).to_pylist():
            upto, groups = known.setdefault(r["rank"], (-1, set()))
            if len(ctx.groups.get(r["group_name"], ())) > 1:
                groups.add(r["group_name"])
            known[r["rank"]] = (max(upto, int(r["newest"])), groups)
    return {r: known[r][1] for r in ranks if known.get(r, (0, set()))[1]}


def steps_needed(s: Settings, members: int) -> int:
    """The steps a rank or host is judged over: ``straggler_window`` at least, and enough that one of
    ``members`` last at all but one of them by chance, each as likely last (w (1/m)^(w-1) (1 - 1/m) +
    (1/m)^w), is at most BY_CHANCE likely: 12 for two (a clean DDP job on 2 cores had a host's two ranks
    last together for 6 steps; an FSDP2 rank of a 2 x 2 mesh, one of a pair, was last 6 steps running
    beside a killed rank), 8 for three, 6 from four."""
    m, w = max(members, 2), s.straggler_window
    while w * (1 / m) ** (w - 1) * (1 - 1 / m) + (1 / m) ** w > BY_CHANCE:
        w += 1
    return w


def _behind(ctx: RunContext, ranks: list[int], last_step: int) -> bool:
    """Whether a group of ``ranks`` (a rank, or a host's) that held collectives step after step has their
    rows stop short of ``last_step`` while their other groups' go on: the rest are on their way (the
    flight recorder's), and they are judged once those are in. A host's groups within it count: they
    tell a late rank of it from the host-mate that waited for it. A group used now and then (a metric's
    all-reduce every ten steps) or no longer (BEHIND_S) is not behind."""
    mine = set(ranks)
    groups = [g for g, members in ctx.groups.items() if len(members) > 1 and not mine.isdisjoint(members)]
    if len(groups) < 2:
        return False
    params = {"run": ctx.run_id, "ranks": ranks, "last_step": last_step, "groups": groups}
    reached = ctx.query(REACHED_SQL, params).to_pylist()
    newest_ns = max((int(g["newest_ns"]) for g in reached), default=0)
    return any(
        g["reached"] < last_step and 2 * g["steps"] > g["reached"] - g["first"] + 1 and newest_ns - int(g["newest_ns"]) < BEHIND_S * 1e9
        for g in reached
    )


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
