"""Stragglers: a rank whose own compute is slower than that of the ranks doing the same work.

Ranks of one pipeline stage run the same layers on the same amount of data, so each compute,
data and optimizer segment is compared, step by step, with the median of its stage (robust to
the straggler itself). Compute time comes from ``step_segments``: the pieces of a segment with
its waits in collectives cut out, so a tensor-parallel peer waiting for the straggler does not
look slow. Communication time is the wrong signal: the fast ranks are the ones that wait.
Corroboration: in the groups it belongs to, the straggler arrives last at collectives.
Where the agent measured the CPU time of every piece of a segment (host-only runs on shared
cores, see agent.recorder), that is compared instead of wall time: it measures the work, while
wall time there mostly measures the scheduler. Wall time is compared too, on the step's compute
as a whole and with a far higher bar (``straggler_wall_excess``, at all steps of the window but
one): a rank starved of CPU (a throttled host, a CPU quota) does the same work in the same CPU
time, and only waits longer to run. A rank slower in CPU time must also have held its groups
back at their collectives (``_waited_for``): CPU time on shared cores counts the hypervisor's steal.
A rank is a straggler when it has been slow for several steps in a row (a single fast step among
them allowed): slow steps scattered among fast ones are a busy host's scheduler, not a slow rank.
A host is named when every rank on it (two or more) is a straggler.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np

from rankscope.collector.anatomy.path import incident_cost, whole_steps
from rankscope.collector.diagnosis.context import RunContext
from rankscope.collector.diagnosis import arrivals as late_arrivals
from rankscope.collector.diagnosis import lone_stages, segment_window
from rankscope.collector.diagnosis.detector import FunctionDetector
from rankscope.collector.diagnosis.segment_window import STEP_COMPUTE, SegmentWindow, Series
from rankscope.common.incidents import Finding
from rankscope.common.settings import Settings

#: the kinds of incident this detector names
KINDS = ("straggler",)
DETECTOR = FunctionDetector("straggler", KINDS, "thorough", lambda scan: detect(scan.ctx))
NEWEST_SQL = (
    "SELECT max(step) AS newest FROM step_segments WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND step >= {since:UInt32}"
)
EVIDENCE_SQL = (
    "SELECT step, rank, round(sum(total_ns) / 1e6, 2) AS wall_ms, round(sum(total_cpu_ns) / 1e6, 2) AS cpu_ms FROM step_segments "
    "WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND name IN {segments:Array(String)} AND rank IN {ranks:Array(UInt32)} "
    "GROUP BY step, rank ORDER BY step, rank"
)

#: ``ctx.seen`` key: the hosts named slow as a whole, while a rank of theirs is still slow
HOSTS_NAMED = "straggler.hosts"

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
    window = SegmentWindow.of(ctx)
    window.refresh(ctx, first_step, last_step)
    step_s = ctx.median_step_s(first_step, last_step)
    series = _slow_series(ctx, window, s, step_s, wall=False)
    if window.cpu_measured:
        series += _slow_series(ctx, window, s, step_s, wall=True)
    lone = lone_stages.slow_series(ctx, window, min_excess_ns=_min_excess_ns(s, step_s), excess=s.straggler_excess,
                                   window_steps=s.straggler_window, min_steps=_min_steps(s, False))  # fmt: skip
    series += [(x, False) for x in lone]
    slow: dict[int, dict] = {}
    started = window.started(ctx, first_step, last_step, {x.rank for x, _ in series}) if series else {}
    for x, wall in series:
        info = _slow_episode(x, wall, started, s)
        if info is not None and any(x is y for y in lone):
            info = {**info, "text": lone_stages.describe(info["ratio"]), "compared_with": lone_stages.COMPARED_WITH}
        if info is not None and (x.rank not in slow or info["ratio"] > slow[x.rank]["ratio"]):
            slow[x.rank] = {**info, "segments": window.names if x.segment == STEP_COMPUTE else [x.segment]}
    slow = _waited_for(ctx, slow, last_step, step_s)
    for rank, info in late_arrivals.late_ranks(ctx, first_step, last_step, step_s).items():
        slow.setdefault(rank, info)  # a slow segment, where one shows, says more
    if not slow:
        ctx.seen.pop(HOSTS_NAMED, None)  # the episode is over: a host named in it is no longer held
        return []
    arrivals = _arrivals(ctx, first_step, sorted(slow))
    return _findings(ctx, slow, arrivals)


def _slow_series(ctx: RunContext, window: SegmentWindow, s: Settings, step_s: float, *, wall: bool) -> list[tuple[Series, bool]]:
    """The series slow often enough to be looked at, each with ``wall``: compare the step's compute in
    wall time even where CPU time was measured, with the higher bar ``straggler_wall_excess`` met at
    all steps of the window but one (its noise comes in runs of steps); ``step_s``: the median step."""
    found = window.slow_series(
        ctx.stage, wall=wall, window=s.straggler_window, min_steps=_min_steps(s, wall), min_excess_ns=_min_excess_ns(s, step_s),
        excess=max(s.straggler_excess, s.straggler_wall_excess) if wall else s.straggler_excess,
    )  # fmt: skip
    return [(x, wall) for x in found]


def _min_excess_ns(s: Settings, step_s: float) -> float:
    """How much slower (ns) a point must be to count at all: ``straggler_min_excess_s``, and
    ``straggler_step_share`` of the median step ``step_s``."""
    return max(s.straggler_min_excess_s, s.straggler_step_share * step_s) * 1e9


def _min_steps(s: Settings, wall: bool) -> int:
    """How many of the window's steps must be slow: for wall time all but one (the step's compute as a
    whole; a quota's bursts can still spare one), for CPU time ``straggler_min_steps``."""
    return s.straggler_window - 1 if wall else s.straggler_min_steps


def _slow_episode(x: Series, wall: bool, started: dict[tuple[int, str, int], int], s: Settings) -> dict | None:
    """The series' slow episode if it is slow lately: {segment, measure, ratio, threshold, since_step,
    since_ns, last_ns, steps} (``detect`` adds the segments it sums); None when it was not slow often
    enough lately, or is no longer."""
    min_steps = _min_steps(s, wall)
    recent = x.points[-s.straggler_window :]
    slow = [p for p in recent if p[1] >= p[4]]
    if len(slow) < min_steps or not any(p[1] >= p[4] for p in recent[-2:]):
        return None  # not slow often enough, or no longer: two fast steps in a row (one is noise, as in an episode)
    episode = segment_window.episode(x.points, _slow_point)
    if sum(p[1] >= p[4] for p in episode) < min_steps:
        return None  # slow steps scattered among fast ones: the scheduler's noise, not a slow rank
    return {
        "segment": x.segment,
        "measure": "wall time" if x.wall_only else "CPU time",
        "ratio": round(float(np.median([p[1] for p in episode if p[1] >= p[4]])), 3),
        "threshold": round(x.threshold, 3),
        "since_step": episode[0][0],
        "since_ns": started.get((x.rank, x.segment, episode[0][0]), 0),
        "last_ns": started.get((x.rank, x.segment, recent[-1][0]), 0),
        "steps": [{"step": p[0], "ratio": round(p[1], 3), "ms": round(p[2] / 1e6, 2), "stage_median_ms": round(p[3] / 1e6, 2),
                   "slow_above_ratio": round(p[4], 3)} for p in recent],  # fmt: skip
    }


def _waited_for(ctx: RunContext, slow: dict[int, dict], last_step: int, step_s: float) -> dict[int, dict]:
    """``slow`` less the ranks slower in CPU time whose groups did not wait for them at their collectives,
    a step, for at least ``straggler_waited_share`` of the time they were slower and ``straggler_excess``
    of the median step ``step_s`` (the bar of a late arrival, arrivals.py), over the episode's slow steps
    whose collectives are stored (none stored yet: left out, judged at a later pass). CPU time on shared cores
    also counts what the hypervisor stole and what a neighbour's cache misses cost: a clean DDP job
    under the suite had ranks 0 and 2 spend 50% more CPU time a step than 1 and 3 (65 against 44 ms)
    while their groups waited 1-4 ms a step for them; after a starved rank's release two ranks spent
    23% more, held 5-9 ms of 170 ms steps; a rank 1.7x slower held its groups 390-1190 ms a step. A
    rank alone in its pipeline stage holds back the neighbours that receive from it (``lone_stages.held_back``).
    A rank in no group of two or more has nobody to hold back, and is kept."""
    cpu = sorted(r for r, info in slow.items() if info["measure"] == "CPU time")
    if not cpu:
        return slow
    first = min(p["step"] for r in cpu for p in slow[r]["steps"])
    waits = late_arrivals.held_back(ctx, cpu, first, last_step)
    lone = [r for r in cpu if "compared_with" in slow[r]]
    for rank, steps in lone_stages.held_back(ctx, lone, first, last_step).items():
        at = waits.setdefault(rank, {})
        for step, ns in steps.items():
            at[step] = at.get(step, 0) + ns
    kept = dict(slow)
    for rank in cpu:
        if rank not in waits:
            continue
        info = slow[rank]
        steps = [p for p in info["steps"] if p["ratio"] >= p["slow_above_ratio"] and p["step"] in waits[rank]]
        slower_ms = sum(p["ms"] - p["stage_median_ms"] for p in steps)
        waited_ms = sum(waits[rank][p["step"]] for p in steps) / 1e6
        bar_ms = max(ctx.settings.straggler_waited_share * slower_ms, ctx.settings.straggler_excess * step_s * 1e3 * len(steps))
        if not steps or waited_ms < bar_ms:
            del kept[rank]
        else:
            kept[rank] = {**info, "waited_ms_per_step": round(waited_ms / len(steps), 2)}
    return kept


def _slow_point(point: tuple) -> bool:
    """A series' point (step, ratio, ns, median ns, bar) at or above its bar."""
    return point[1] >= point[4]


def _arrivals(ctx: RunContext, first_step: int, ranks: list[int]) -> dict[int, tuple[int, int]]:
    """rank -> (collectives it took part in, times it arrived last), for ``ranks``."""
    table = ctx.query(ARRIVALS_SQL, {"run": ctx.run_id, "first_step": first_step, "ranks": ranks}).to_pydict()
    return {r: (n, last) for r, n, last in zip(table["rank"], table["collectives"], table["last"])}


def _findings(ctx: RunContext, slow: dict[int, dict], arrivals: dict[int, tuple[int, int]]) -> list[Finding]:
    # A host named slow as a whole stays named while a rank of it is still slow: its ranks share its
    # quota, and one of them dipping under the bar for a step or two is no other fault (the test bed's
    # throttled node2, named live as the host for 40 s, then as rank 5 alone to the end).
    held = {h for h in ctx.seen.get(HOSTS_NAMED, set()) if any(r in slow for r in ctx.ranks_of_host.get(h, ()))}
    slow_hosts = ctx.whole_hosts(slow) | held
    ctx.seen[HOSTS_NAMED] = slow_hosts
    findings: list[Finding] = []
    costs: dict[tuple, tuple] = {}  # what this pass's findings cost, kept for the next (``_cost``)
    for host in sorted(slow_hosts):
        ranks = ctx.ranks_of_host[host]
        still = [r for r in ranks if r in slow]
        worst = max(still, key=lambda r: slow[r]["ratio"])
        info = slow[worst]
        are = "are all slower than their stage peers"
        if len(still) < len(ranks):
            are = f"were all slower than their stage peers, {', '.join(f'rank {r}' for r in still)} still {'is' if len(still) == 1 else 'are'}"
        summary = (f"host {host}: ranks {', '.join(map(str, ranks))} {are}; "
                   f"{ctx.who(worst)} {info.get('text') or _pct(info['ratio']) + ' slower'} since step {info['since_step']}")  # fmt: skip
        found = _finding(ctx, f"straggler:host={host}", ranks, info, arrivals, summary, costs)
        findings.append(replace(found, absorbs=tuple(f"straggler:rank={r}" for r in sorted(still, key=lambda r: slow[r]["since_step"]))))
    for rank in sorted(r for r in slow if ctx.host.get(r) not in slow_hosts):
        info = slow[rank]
        what = info.get("text") or f"{info['segment']} {_pct(info['ratio'])} slower than its stage peers"
        summary = f"{ctx.who(rank)}: {what} since step {info['since_step']}"
        found = _finding(ctx, f"straggler:rank={rank}", [rank], info, arrivals, summary, costs)
        # a rank of a host named before, alone now (its host-mate's slowness dipped): the same fault
        host = ctx.host.get(rank)
        findings.append(replace(found, absorbs=(f"straggler:host={host}",)) if host else found)
    ctx.seen["straggler.costs"] = costs
    return _waiting_left_out(findings, ctx.settings.straggler_step_share)


def _waiting_left_out(findings: list[Finding], floor: float) -> list[Finding]:
    """``findings`` less the slow ranks that cost their steps nothing while another finding's cost them at
    least ``floor``: those wait for it (a 1.5x tensor-parallel peer of a 2x one). A finding alone keeps
    its place whatever its measured cost: the cost is evidence, never the only reason to lose an incident
    (a path walked on rows still arriving can miss the rank that holds everyone)."""
    share = [f.evidence.get("critical_path_cost", {}).get("share") for f in findings]
    if not any(s is not None and s >= floor for s in share):
        return findings
    return [f for f, s in zip(findings, share) if s is None or s >= floor]


def _finding(ctx: RunContext, key: str, ranks: list[int], info: dict, arrivals: dict[int, tuple[int, int]], summary: str,
             costs: dict[tuple, tuple]) -> Finding:  # fmt: skip
    stage_ranks = sorted(r for r, st in ctx.stage.items() if st == ctx.stage.get(ranks[0], 0))
    segments = info["segments"]
    evidence = {
        "segment": info["segment"],
        "segments": segments,
        "measure": info["measure"],
        "slow_above_ratio": info["threshold"],
        "ratio_to_stage_median": info["ratio"],
        "since_step": info["since_step"],
        "recent_steps": info["steps"],
        "stage_ranks": stage_ranks,
        "arrived_last": {str(r): {"collectives": arrivals[r][0], "last": arrivals[r][1]} for r in ranks if r in arrivals},
    }
    if "compared_with" in info:
        evidence["compared_with"] = info["compared_with"]
    if "waited_ms_per_step" in info:
        evidence["groups_waited_for_it_ms_per_step"] = info["waited_ms_per_step"]
    if segments == [late_arrivals.SEGMENT]:
        evidence["groups"] = info["groups"]
        sql = ctx.literal_sql(late_arrivals.EVIDENCE_SQL, first_step=info["since_step"], last_step=info["steps"][-1]["step"])
    else:
        sql = ctx.literal_sql(EVIDENCE_SQL, segments=segments, ranks=stage_ranks)
    # a link's cost on the critical path is its excess over its stage peers': a lone rank has none to cost
    cost = None if "compared_with" in info else _cost(ctx, [p["step"] for p in info["steps"]], ranks, costs)
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
        sql=sql,
    )


def _cost(ctx: RunContext, window: list[int], ranks: list[int], costs: dict[tuple, tuple]) -> dict | None:
    """What the links of ``ranks`` on the critical paths of the newest steps of ``window`` that every rank has
    sent cost them (rankscope/collector/anatomy: ``whole_steps``); None while no step is whole. The pass
    before's figure is kept while the store holds as many pieces of those steps, all their segments (their
    paths, and so the cost, are the same): at 100,000 ranks asking each step's frame again took 0.2 s a
    pass, counting the pieces 0.02 s. ``costs``: this pass's, for the next."""
    pieces = whole_steps(ctx.query, ctx.run_id, window, len(ctx.host), attempt=ctx.attempt)
    if not pieces:
        return None
    steps, held = list(pieces), tuple(pieces.items())
    kept: dict = ctx.seen.get("straggler.costs", {})
    key = (tuple(steps), tuple(ranks))
    if key in kept and kept[key][0] == held:
        cost = kept[key][1]
    else:
        cost = incident_cost(ctx.query, ctx.run_id, steps, ranks, attempt=ctx.attempt, groups=ctx.group_index, world=len(ctx.host))
    if cost is not None:  # a failed read is asked again next pass
        costs[key] = (held, cost)
    return copy.deepcopy(cost)


def _pct(ratio: float) -> str:
    return f"{round(100 * (ratio - 1))}%"

