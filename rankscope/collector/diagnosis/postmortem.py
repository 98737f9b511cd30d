"""A run diagnosed after the fact (``rankscope diagnose``), and set beside what was raised live.

One pass at the end sees only the faults still visible in the newest steps: a straggler that
recovered, a loss spike long past, a slow link that healed were episodes the live passes opened and
closed. So the postmortem replays the run: the detectors that judge a window of steps pass once per
step or few (``RunContext.until_step``), keeping their windows between passes as the live ones do,
and a last pass of every detector judges the run as the live diagnosis last saw it
(``engine.offline_now``). A hang is an episode in time, not in steps: each stall (the newest step
not advancing for ``hang_after_s`` while heartbeats came) is replayed at moments through it, the
hang detector reading what was recorded by then (``RunContext.until_ns``), so that a hang that
resolved (a frozen rank resumed) is found, from when the live diagnosis raised it, and closed.
The incidents come out of a ``Ledger`` as the live ones do: episodes
that ended closed, with their time span. ``compare`` then names the incidents only one side raised
(matched on kind, ranks and hosts), so that a postmortem shows where it and the live diagnosis differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankscope.collector.diagnosis import hang
from rankscope.collector.diagnosis.context import Query, RunContext
from rankscope.collector.diagnosis.engine import diagnose
from rankscope.collector.diagnosis.ledger import Ledger
from rankscope.collector.diagnosis.registry import EVERY, THOROUGH
from rankscope.common.incidents import INCIDENTS_SQL, Incident, from_rows
from rankscope.common.settings import Settings

#: the most replay passes of a run (a pass took 0.15 s on 8 ranks, 1 s at 100,096 ranks): beyond
#: as many steps a pass covers several, and an episode seen at fewer horizons than that can be missed
#: (it then shows as raised live only). Up to 300 steps every step is a horizon.
MAX_PASSES = 300

NEWEST_STEP_SQL = "SELECT max(max_step) AS newest FROM rank_state WHERE run_id = {run:String} AND attempt = {attempt:UInt16}"
# when each step was first heard of (the newest step's advance), and the newest heartbeat
STEPS_HEARD_SQL = (
    "SELECT step, toUnixTimestamp64Nano(min(time)) AS ns FROM heartbeats WHERE run_id = {run:String} AND attempt = {attempt:UInt16} "
    "GROUP BY step ORDER BY step"
)
LAST_HEARTBEAT_SQL = "SELECT toUnixTimestamp64Nano(max(last_heartbeat)) AS ns FROM rank_state WHERE run_id = {run:String} AND attempt = {attempt:UInt16}"
#: the moments of a stall a replay judges: once it is a hang (``hang.stall_after_ns``), then every half of
#: hang_after_s, at most this many
MOMENTS_PER_STALL = 8
# when the latest attempt began: the live incidents of earlier attempts are theirs, not this one's
ATTEMPT_BEGAN_SQL = (
    "SELECT toUnixTimestamp64Nano(min(registered)) AS ns FROM ranks WHERE run_id = {run:String} "
    "AND attempt = (SELECT max(attempt) FROM ranks WHERE run_id = {run:String})"
)


def replay(run_id: str, query: Query, settings: Settings, *, over: bool) -> list[Incident]:
    """The run's incidents as the live passes would have left them, episodes that closed included;
    ``over``: the run ended, so every incident is closed (as the live diagnosis's final passes do)."""
    ctx = RunContext.load(run_id, query, settings)
    ledger = Ledger(run_id)
    newest = int(ctx.query(NEWEST_STEP_SQL, {"run": run_id}).to_pylist()[0]["newest"] or 0)
    stride = max(1, -(-newest // MAX_PASSES))
    stalls = _stalls(ctx)
    for step in range(1, newest, stride):
        ctx.until_step = step
        ledger.update(diagnose(run_id, query, settings, ctx=ctx, lane=THOROUGH), owns=THOROUGH.owns)
        for moments in (stalls.pop(s) for s in sorted(stalls) if s < step + stride):
            _replay_stall(ctx, ledger, moments)
    for step in sorted(stalls):  # at the newest step
        _replay_stall(ctx, ledger, stalls[step])
    ctx.until_step = None
    ledger.update(diagnose(run_id, query, settings, ctx=ctx, lane=EVERY), final=over)
    return [i for i in ledger.incidents.values() if i.status != "merged"]


def _stalls(ctx: RunContext) -> dict[int, list[int]]:
    """The run's stalls, by the step that stopped advancing: the moments (ns) a replay judges each at."""
    heard = ctx.query(STEPS_HEARD_SQL, {"run": ctx.run_id}).to_pydict()
    last = int(ctx.query(LAST_HEARTBEAT_SQL, {"run": ctx.run_id}).to_pylist()[0]["ns"] or 0)
    half_ns = int(ctx.settings.hang_after_s * 1e9) // 2
    stalls = {}
    previous = [(None, None), *zip(heard["step"], heard["ns"])]
    for (before, before_ns), step, began, ended in zip(previous, heard["step"], heard["ns"], [*heard["ns"][1:], last]):
        after_ns = hang.stall_after_ns(ctx.settings, step, began, None if before is None else (before, before_ns))
        if ended - began >= after_ns:
            stalls[step] = [began + after_ns + k * half_ns for k in range(MOMENTS_PER_STALL) if k * half_ns <= ended - began - after_ns]
    return stalls


def _replay_stall(ctx: RunContext, ledger: Ledger, moments: list[int]) -> None:
    """A stall judged at each of its moments, then over (a hang still on at the run's end is found again
    by the last pass)."""
    for moment in moments:
        ctx.until_ns = moment
        ledger.update(hang.detect(ctx), owns=_hangs)
    ctx.until_ns = None
    ledger.update([], owns=_hangs)


def _hangs(kind: str) -> bool:
    return kind in hang.KINDS


def live(run_id: str, query: Query) -> list[Incident]:
    """The incidents the live diagnosis stored for the run's latest attempt (open and closed)."""
    began = int(query(ATTEMPT_BEGAN_SQL, {"run": run_id}).to_pylist()[0]["ns"] or 0)
    return [i for i in from_rows(query(INCIDENTS_SQL, {"run": run_id}).to_pylist()) if i.finding.last_seen_ns >= began]


@dataclass(frozen=True)
class Comparison:
    """The offline incidents, and the disagreements with the live ones."""

    offline: list[Incident]
    #: raised live, not found offline
    live_only: list[Incident]
    #: found offline, never raised live
    offline_only: list[Incident]

    @property
    def agrees(self) -> bool:
        return not self.live_only and not self.offline_only


def compare(offline: list[Incident], raised: list[Incident]) -> Comparison:
    """Match offline and live incidents on what they name: kind, ranks and hosts."""
    offline_names = {_names(i) for i in offline}
    live_names = {_names(i) for i in raised}
    return Comparison(
        offline=offline,
        live_only=[i for i in raised if _names(i) not in offline_names],
        offline_only=[i for i in offline if _names(i) not in live_names],
    )


def _names(incident: Incident) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    f = incident.finding
    return f.kind, tuple(sorted(f.ranks)), tuple(sorted(f.hosts))
