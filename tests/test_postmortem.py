"""`rankscope diagnose`'s postmortem on a real store: an episode that opened and closed during the run
is replayed (one pass at the end would not see it), silence is judged when the live passes last
looked, the live incidents are compared, and window reads come in pages under the result limit.
The same, on real runs with real faults: tests/test_diagnosis_scenarios.py, tests/test_testbed_scenarios.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from test_detector_registry import RUN, _first_attempt
from test_diagnosis_state import rows
from test_store import T0, migrated, sample_rows, store  # noqa: F401 (fixtures)

from rankscope.collector.diagnosis import hang, postmortem, registry
from rankscope.collector.diagnosis.context import RunContext, pages
from rankscope.collector.diagnosis.detector import FunctionDetector, Scan
from rankscope.collector.diagnosis.engine import LAST_DATA_SQL, diagnose, listening_s, offline_now, write_to
from rankscope.collector.store.base import Store
from rankscope.common.incidents import Finding
from rankscope.common.settings import Settings

NEWEST_SQL = "SELECT max(step) AS newest FROM heartbeats WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND step >= {since:UInt32}"


def _slow_at_steps_3_to_6(scan: Scan) -> list[Finding]:
    """A windowed detector's stand-in: rank 2 was slow while the newest step was 3..6, and is no longer."""
    step = scan.ctx.newest_step(NEWEST_SQL)
    if not 3 <= step <= 6:
        return []
    return [Finding("episode", "episode:rank=2", "warning", (2,), scan.ctx.hosts_of([2]), T0 + 3 * 10**9, T0 + step * 10**9, "rank 2 slow")]


EPISODE = FunctionDetector("episode", ("episode",), "thorough", _slow_at_steps_3_to_6)


@pytest.fixture
def run_of_ten_steps(migrated: Store) -> Store:  # noqa: F811
    """A run of ten ranks on two hosts, heard long ago: rank r's last heartbeat at step r + 1."""
    migrated.insert_arrow("ranks", _first_attempt(sample_rows("ranks", 10, run_id=RUN)))
    migrated.insert_arrow("heartbeats", _first_attempt(sample_rows("heartbeats", 10, run_id=RUN)))
    return migrated


def test_an_episode_that_closed_during_the_run_is_replayed_and_compared_with_the_live_incident(run_of_ten_steps: Store) -> None:
    query, settings = run_of_ten_steps.query_arrow, Settings()
    with registry.added(EPISODE):
        assert [f for f in diagnose(RUN, query, settings) if f.kind == "episode"] == []  # one pass at the end: gone
        found = [i for i in postmortem.replay(RUN, query, settings, over=False) if i.finding.kind == "episode"]
        assert [(i.status, i.finding.ranks, i.finding.hosts, i.finding.last_seen_ns) for i in found] == [("closed", (2,), ("node-00",), T0 + 6 * 10**9)]
        raised = postmortem.live(RUN, query)
        assert raised == []
        alone = postmortem.compare(found, raised)
        assert not alone.agrees and alone.offline_only == found and alone.live_only == []
        write_to(run_of_ten_steps.insert_arrow)([replace(found[0], finding=replace(found[0].finding, summary="rank 2 slow, live"))])
        agreed = postmortem.compare(found, postmortem.live(RUN, query))
        assert agreed.agrees, agreed


def test_after_the_run_silence_is_judged_when_the_live_passes_last_looked(run_of_ten_steps: Store) -> None:
    """Not at the run's last data (a killed rank's peers end seconds after it went quiet): the live passes
    went on for ``listening_s`` after it."""
    ctx = RunContext.load(RUN, run_of_ten_steps.query_arrow, Settings(silent_after_s=40))
    last = int(ctx.query(LAST_DATA_SQL, {"run": RUN}).to_pylist()[0]["ns"])
    assert offline_now(ctx) == last + 120 * 10**9 == last + listening_s(ctx.settings) * 10**9


def test_window_reads_come_in_pages_under_the_result_limit() -> None:
    """A step's cells at 100,096 ranks are 500,000 rows; a key over the limit goes alone."""
    assert pages({3: 500_480, 1: 300_000, 2: 200_000, 4: 1}, limit=500_000) == [[1, 2], [3], [4]]
    assert pages({}) == []


S = 10**9
RANKS = [0, 1, 2, 3]
#: what a rank waits in: (group, seq, issued at s)
Wait = tuple[str, int, int]


def _job(into: Store, run: str, groups: dict[str, list[int]]) -> None:
    """Four ranks, two a host (node-0: 0, 1; node-1: 2, 3), and their groups."""
    into.insert_arrow("ranks", rows("ranks", 4, run_id=run, rank=RANKS, host=[f"node-{r // 2}" for r in RANKS], registered=T0,
                                    pid=[1000 + r for r in RANKS], tp_rank=-1, pp_rank=-1, dp_rank=-1))  # fmt: skip
    into.insert_arrow("groups", rows("groups", len(groups), run_id=run, name=list(groups), ranks=list(groups.values()), registered=T0))


def _heartbeats(
    into: Store, run: str, beats: list[tuple[int, int]], *, step: Callable[[int], int], progress: Callable[[int, int], int],
    wait: Callable[[int, int], Wait | None], phase: str = "forward",
) -> None:  # fmt: skip
    """A heartbeat of each (rank, second) in ``beats``: in ``step(t)``, its last progress at ``progress(r, t)`` s,
    waiting in ``wait(r, t)`` (None: in nothing)."""
    waits = [wait(r, t) for r, t in beats]
    into.insert_arrow("heartbeats", rows(
        "heartbeats", len(beats), run_id=run, rank=[r for r, _ in beats], host=[f"node-{r // 2}" for r, _ in beats],
        time=[T0 + t * S for _, t in beats], step=[step(t) for _, t in beats], phase=phase, status="running",
        last_progress=[T0 + progress(r, t) * S for r, t in beats], inflight_group=[[w[0]] if w else [] for w in waits],
        inflight_seq=[[w[1]] if w else [] for w in waits], inflight_op=[["all_reduce"] if w else [] for w in waits],
        inflight_peer=[[-1] if w else [] for w in waits], inflight_issue=[[T0 + w[2] * S] if w else [] for w in waits],
        inflight_waiting=[[1] if w else [] for w in waits],
    ))  # fmt: skip


def _collectives(into: Store, run: str, ops: list[tuple[int, str, int, int, int, int]]) -> None:
    """All-reduces, each (rank, group, seq, issued ns, ended ns (0: still pending), step)."""
    into.insert_arrow("collectives", rows(
        "collectives", len(ops), run_id=run, rank=[o[0] for o in ops], group_name=[o[1] for o in ops], seq=[o[2] for o in ops],
        op="all_reduce", peer=-1, issue_time=[o[3] for o in ops], start_time=[o[3] for o in ops], end_time=[o[4] for o in ops],
        state=["completed" if o[4] else "pending" for o in ops], step=[o[5] for o in ops],
    ))  # fmt: skip


def _stall_resolved(into: Store, run: str, *, frozen: bool = False, entered_s: int = 30) -> None:
    """Four ranks (node-0: 0, 1; node-1: 2, 3) heard every second for 40 s: step 4 begins at 5 s and rank
    2 does nothing in it until 30 s (heard, quiet), the others waiting in default_pg #9; then it enters
    #9, step 5 begins and the run ends normally at 40 s. ``frozen``: rank 2 is stopped from 4 s to 30 s
    instead (no heartbeat; its backward of step 4, ended at 7 s, stored), rank 3 took its stack at 9 s.
    ``entered_s``: when rank 2 entered #9 (its row of it issued then)."""
    _job(into, run, {"default_pg": RANKS})
    _heartbeats(
        into, run, [(r, t) for t in range(41) for r in RANKS if not (frozen and r == 2 and 3 < t < 30)],
        step=lambda t: 3 if t < 5 else 4 if t < 30 else 5, progress=lambda r, t: 5 if 5 <= t < 30 else t,
        wait=lambda r, t: ("default_pg", 9, 6) if r != 2 and 6 <= t < 30 else None,
    )  # fmt: skip
    issued = [(r, seq, T0 + (seq - 5) * S if seq < 9 or r != 2 else T0 + entered_s * S) for r in RANKS for seq in range(1, 10)]
    _collectives(into, run, [(r, "default_pg", seq, at, T0 + 30 * S + S // 2 if seq == 9 else at + S // 2, min(4, max(1, seq // 2)))
                             for r, seq, at in issued])  # fmt: skip
    if frozen:
        into.insert_arrow("spans", rows("spans", 1, run_id=run, rank=2, step=4, name="backward", kind="compute", start_time=T0 + 6 * S,
                                        end_time=T0 + 7 * S, cpu_ns=-1))  # fmt: skip
        into.insert_arrow("stacks", rows("stacks", 1, run_id=run, rank=3, host="node-1", time=T0 + 9 * S, reason="stopped peer pid 1002",
                                         method="py-spy", text="Process 1002: python ddp_job.py\n"))  # fmt: skip
    into.insert_arrow("exits", rows("exits", 4, run_id=run, rank=RANKS, host=[f"node-{r // 2}" for r in RANKS], time=T0 + 40 * S, reason="normal"))


def test_a_hang_that_resolved_is_replayed_from_when_it_began(migrated: Store) -> None:  # noqa: F811
    """Judged at the run's end, a stall long over is no hang; the replay judges the stall at moments
    through it, each reading what was recorded by then, and finds the hang, closed, first seen when
    step 4 began, as a live pass at the time did (issue 29)."""
    _stall_resolved(migrated, "resolved")
    settings = Settings(hang_after_s=6, silent_after_s=10)
    assert [f for f in diagnose("resolved", migrated.query_arrow, settings) if f.kind == "hang"] == []
    found = postmortem.replay("resolved", migrated.query_arrow, settings, over=True)
    assert [(i.finding.kind, i.status, i.finding.ranks, i.finding.hosts) for i in found] == [("hang", "closed", (2,), ("node-1",))], found
    hang = found[0].finding
    assert hang.first_seen_ns == T0 + 5 * S and T0 + 11 * S <= hang.last_seen_ns < T0 + 30 * S
    assert "rank 2 (node-1) in forward at step 4" in hang.summary and "3 ranks wait on it (default_pg #9) since step 4" in hang.summary


@pytest.mark.parametrize("first", [2, 3], ids=["rank-2-works-first", "rank-3-enters-first"])
def test_a_frozen_host_is_one_hang_and_its_thaw_names_none_of_its_ranks_alone(migrated: Store, first: int) -> None:  # noqa: F811
    """node-1 (ranks 2, 3) frozen from 4 s while node-0's ranks wait in default_pg #9 of step 4: silent,
    the two are one hang naming the host. Thawed at 20 s, one of them works again and the other has made
    no progress yet: the stall is ending, and the other is not named alone (seed 555533734: a second
    live hang, for rank 3, the frozen host's other rank). Where rank 3 resumed first it has entered #9
    already, so the others wait on rank 2 alone (555533734 again, a session later: rank 2 named)."""
    _job(migrated, "thawed", {"default_pg": RANKS})
    _heartbeats(
        migrated, "thawed", [(r, t) for t in range(21) for r in RANKS if r < 2 or t < 4 or t == 20], step=lambda t: 3 if t < 5 else 4,
        progress=lambda r, t: t if t < 5 or r == first else 5 if r < 2 else 3,  # after the thaw one works, the other not yet
        wait=lambda r, t: ("default_pg", 9, 6) if (r < 2 and t >= 6) or (r == first == 3 and t == 20) else None, phase="backward",
    )  # fmt: skip
    settings = Settings(hang_after_s=6, silent_after_s=10)
    ctx = RunContext.load("thawed", migrated.query_arrow, settings)
    (frozen,) = hang.detect(replace(ctx, until_ns=T0 + 15 * S))
    assert (frozen.ranks, frozen.hosts) == ((2, 3), ("node-1",)) and frozen.summary.startswith("hang: host node-1 ("), frozen.summary
    assert hang.detect(ctx) == []  # thawed: one moving, the other quiet (was: the other named alone)
    hangs = [i for i in postmortem.replay("thawed", migrated.query_arrow, settings, over=True) if i.finding.kind == "hang"]
    assert [(i.status, i.finding.ranks, i.finding.hosts) for i in hangs] == [("closed", (2, 3), ("node-1",))], hangs


def test_a_thaw_whose_first_sign_is_stored_after_a_later_pass_names_none_of_the_hosts_ranks_alone(migrated: Store) -> None:  # noqa: F811
    """As above, but the heartbeat that says rank 2 works again (said at 13 s, entered #9 since) is
    stored only after a pass that read node-0's heartbeats up to 15 s and named the host (a collector
    behind: campaign seed 1608066736). The next pass finds rank 3 heard again without moving, and
    the others waiting on it alone: rank 2's own progress, later than the pass that named it read,
    says the stall is ending, and rank 3 is not named alone."""
    _job(migrated, "late-thaw", {"default_pg": RANKS})
    step = lambda t: 3 if t < 5 else 4  # noqa: E731
    wait = lambda r, t: ("default_pg", 9, 6) if (r < 2 and t >= 6) or (r == 2 and t >= 13) else None  # noqa: E731
    progress = lambda r, t: t if t < 5 else 13 if r == 2 and t >= 13 else 5 if r < 2 else 3  # noqa: E731  (rank 2: its backward ended at 13 s)
    beats = lambda keep: [(r, t) for t in range(21) for r in RANKS if keep(r, t)]  # noqa: E731
    _heartbeats(migrated, "late-thaw", beats(lambda r, t: (r < 2 and t <= 15) or t < 4), step=step, progress=progress, wait=wait, phase="backward")
    settings = Settings(hang_after_s=6, silent_after_s=10)
    ctx = RunContext.load("late-thaw", migrated.query_arrow, settings)
    (frozen,) = hang.detect(ctx)
    assert frozen.ranks == (2, 3) and frozen.summary.startswith("hang: host node-1 ("), frozen.summary
    later = lambda r, t: (r < 2 and t > 15) or (r == 2 and t >= 13) or (r == 3 and t == 20)  # noqa: E731
    _heartbeats(migrated, "late-thaw", beats(later), step=step, progress=progress, wait=wait, phase="backward")
    assert hang.detect(ctx) == []  # was: rank 3 named alone, heard again without moving


def test_steps_that_all_outlast_hang_after_are_slow_not_hung(migrated: Store) -> None:  # noqa: F811
    """Every step 10 s with hang_after at 6 s: in steps 2-4 rank 2 computes for 9 s (its spans end late,
    nothing in between), the others waiting in default_pg #step from 2 s in. That is the job's pace,
    not a hang (seed 739796868: a host's link at 12 Mbit/s, every step 14 s, the ranks in their
    gradient all-reduce named a hang 11 s into each step, live only). From 40 s rank 2 stops in step 5:
    a hang once the stall has lasted two steps at that pace, 20 s, named then, live and replayed."""
    _job(migrated, "slow-steps", {"default_pg": RANKS})
    step = lambda t: min(1 + t // 10, 5)  # noqa: E731
    _heartbeats(
        migrated, "slow-steps", [(r, t) for t in range(71) for r in RANKS], step=step,
        progress=lambda r, t: t if t < 10 else 10 * (step(t) - 1) + (1 if r != 2 else 0),
        wait=lambda r, t: ("default_pg", step(t), 10 * (step(t) - 1) + 2) if r != 2 and t >= 10 and (t % 10 >= 2 or t >= 42) else None,
    )  # fmt: skip
    ops = [(r, k, T0 + (10 * (k - 1) + (9 if r == 2 else 2)) * S) for k in range(1, 5) for r in RANKS] + [(r, 5, T0 + 42 * S) for r in (0, 1, 3)]
    _collectives(migrated, "slow-steps", [(r, "default_pg", k, at, 0 if k == 5 else T0 + (10 * k - 1) * S, k) for r, k, at in ops])
    settings = Settings(hang_after_s=6, silent_after_s=10)
    ctx = RunContext.load("slow-steps", migrated.query_arrow, settings)
    assert [hang.detect(replace(ctx, until_ns=T0 + t * S)) for t in (17, 28, 39, 55)] == [[]] * 4
    (hung,) = hang.detect(replace(ctx, until_ns=T0 + 61 * S))
    assert hung.ranks == (2,) and hung.first_seen_ns == T0 + 40 * S, hung.summary
    hangs = [i for i in postmortem.replay("slow-steps", migrated.query_arrow, settings, over=True) if i.finding.kind == "hang"]
    assert [(i.finding.ranks, i.finding.first_seen_ns) for i in hangs] == [((2,), T0 + 40 * S)], hangs


def test_a_rank_slow_to_start_is_hung_only_after_three_times_hang_after(migrated: Store) -> None:  # noqa: F811
    """Rank 2 heard from 0 s but quiet at step 0 (still importing, loading), the others waiting on it in
    default_pg #1 from 1 s: with hang_after at 6 s, start-up gets 18 s (a rank on a loaded host took
    over 10 s to its first step and was named hung at step 0: CI, session 34); stalled past that, it is hung."""
    _job(migrated, "start-up", {"default_pg": RANKS})
    _heartbeats(
        migrated, "start-up", [(r, t) for t in range(31) for r in RANKS], step=lambda t: 0, progress=lambda r, t: 0 if r == 2 else 1,
        wait=lambda r, t: ("default_pg", 1, 1) if r != 2 and t >= 1 else None,
    )  # fmt: skip
    _collectives(migrated, "start-up", [(r, "default_pg", 1, T0 + S, 0, 0) for r in (0, 1, 3)])
    ctx = RunContext.load("start-up", migrated.query_arrow, Settings(hang_after_s=6, silent_after_s=10))
    assert [hang.detect(replace(ctx, until_ns=T0 + t * S)) for t in (8, 12, 17)] == [[]] * 3
    (hung,) = hang.detect(replace(ctx, until_ns=T0 + 25 * S))
    assert hung.ranks == (2,) and "since step 0" in hung.summary, hung.summary


def test_a_frozen_host_heard_again_a_rank_at_a_time_is_still_the_host(migrated: Store) -> None:  # noqa: F811
    """node-1 (ranks 2, 3) frozen from 4 s inside default_pg #9, which both had entered (their rows
    pending), node-0's ranks waiting in it. Thawed at 20 s, rank 3 is heard once, still where it froze
    (no progress, in #9), rank 2 not yet: rank 3 was as silent through the stall as rank 2, and the
    host is named, not rank 2 alone as rank 3's waiter (seed 1529690754: the postmortem, judging a
    moment after the thaw, named rank 0 alone where the live diagnosis had named node0)."""
    _job(migrated, "heard-again", {"default_pg": RANKS})
    _heartbeats(
        migrated, "heard-again", [(r, t) for t in range(21) for r in RANKS if r < 2 or t < 4 or (r, t) == (3, 20)],
        step=lambda t: 3 if t < 5 else 4, progress=lambda r, t: min(t, 5 if r < 2 else 3),
        wait=lambda r, t: ("default_pg", 9, 6) if (r < 2 and t >= 6) or (r, t) == (3, 20) else None, phase="backward",
    )  # fmt: skip
    ops = [(r, seq, T0 + seq * S // 4) for r in RANKS for seq in range(1, 9)]
    _collectives(migrated, "heard-again", [(r, "default_pg", seq, at, at + S // 8, 3) for r, seq, at in ops]
                 + [(r, "default_pg", 9, T0 + 7 * S // 2, 0, 3) for r in (2, 3)])  # fmt: skip
    settings = Settings(hang_after_s=6, silent_after_s=10)
    ctx = RunContext.load("heard-again", migrated.query_arrow, settings)
    (frozen,) = hang.detect(replace(ctx, until_ns=T0 + 20 * S + S // 2))
    assert (frozen.ranks, frozen.hosts) == ((2, 3), ("node-1",)) and frozen.summary.startswith("hang: host node-1 ("), frozen.summary
    hangs = [i for i in postmortem.replay("heard-again", migrated.query_arrow, settings, over=True) if i.finding.kind == "hang"]
    assert [(i.finding.ranks, i.finding.hosts) for i in hangs] == [((2, 3), ("node-1",))], hangs


def test_a_rank_waiting_inside_a_collective_its_frozen_peer_entered_waits_on_that_peer(migrated: Store) -> None:  # noqa: F811
    """Rank 3 frozen from 4 s inside tp #7, which it entered (its row stored, as a frozen rank's is once
    it resumes); rank 2, its tensor-parallel peer, blocked in tp #7 too, heard and quiet; ranks 0 and 1
    blocked in dp #5, which rank 2 never reached. Rank 2 waits on rank 3, whose part never comes: rank
    3 is the root, not rank 2 (seed 87878808: offline, reading the frozen rank's row, named rank 2
    beside it, where live, before that row came, named rank 3 alone)."""
    _job(migrated, "inside", {"tp": [2, 3], "dp": [0, 1, 2]})
    waits_in = {0: ("dp", 5, 6), 1: ("dp", 5, 6), 2: ("tp", 7, 6)}
    _heartbeats(
        migrated, "inside", [(r, t) for t in range(21) for r in RANKS if r != 3 or t < 4], step=lambda t: 3 if t < 5 else 4,
        progress=lambda r, t: min(t, 5), wait=lambda r, t: waits_in[r] if r in waits_in and t >= 6 else None,
    )  # fmt: skip
    _collectives(migrated, "inside", [(r, "dp", seq, T0 + seq * S // 2, T0 + seq * S // 2 + S // 4, 3) for r in (0, 1, 2) for seq in range(1, 5)]
                 + [(3, "tp", 7, T0 + 3 * S, 0, 3)])  # fmt: skip
    ctx = RunContext.load("inside", migrated.query_arrow, Settings(hang_after_s=6, silent_after_s=10))
    (found,) = hang.detect(ctx)
    assert (found.ranks, found.hosts) == ((3,), ("node-1",)), found.summary
    assert found.evidence["waits_for"]["2"] == [3], found.evidence


@pytest.mark.parametrize("thawed", [False, True], ids=["silent", "heard-again"])
def test_a_rank_blocked_with_its_frozen_tensor_parallel_peer_out_of_sight_waits_on_it(migrated: Store, thawed: bool) -> None:  # noqa: F811
    """A 2 x 2 mesh (FSDP2 with DTensor): rank 0 frozen from 4 s; rank 1, its tensor-parallel peer, blocked in
    their tp all-reduce, a functional collective no wrapper sees (heard, quiet, in nothing by its own
    account); ranks 2 and 3 wait in their dp groups on ranks 0 and 1. Rank 1 waits on rank 0: the hang is
    rank 0's alone (replayed, campaign seed 769188504 named rank 1 beside it, live and offline). ``thawed``:
    rank 0 is heard again at 20 s without moving, as when its job is torn down (seed 104460427: then the
    postmortem named both)."""
    run = f"unseen-{thawed}"
    _job(migrated, run, {"tp0": [0, 1], "tp1": [2, 3], "dp0": [0, 2], "dp1": [1, 3]})
    waits_in = {2: ("dp0", 5, 6), 3: ("dp1", 5, 6)}
    _heartbeats(
        migrated, run, [(r, t) for t in range(21) for r in RANKS if r != 0 or t < 4 or (thawed and t == 20)], step=lambda t: 3 if t < 5 else 4,
        progress=lambda r, t: min(t, 5 if r else 3), wait=lambda r, t: waits_in[r] if r in waits_in and t >= 6 else None,
    )  # fmt: skip
    _collectives(migrated, run, [(r, f"dp{r % 2}", seq, T0 + seq * S // 2, T0 + seq * S // 2 + S // 4, 3) for r in RANKS for seq in range(1, 5)])
    (found,) = hang.detect(RunContext.load(run, migrated.query_arrow, Settings(hang_after_s=6, silent_after_s=10)))
    assert (found.ranks, found.hosts) == ((0,), ("node-0",)), found.summary
    assert ("heard again without moving" in found.summary) == thawed, found.summary


def test_a_frozen_hosts_rank_that_nobody_is_seen_to_wait_on_is_in_its_hang(migrated: Store) -> None:  # noqa: F811
    """A 2 x 2 mesh, node-0 (ranks 0, 1) frozen from 4 s: rank 3 waits on rank 1 in dp1, rank 2 waits on rank 3
    in their tensor-parallel group, so nobody is seen to wait on rank 0. The hang is node-0's, both ranks
    (campaign seed 365879949: rank 1 named alone, rank 0 lost beside it, live only)."""
    run = "frozen-mesh"
    _job(migrated, run, {"tp0": [0, 1], "tp1": [2, 3], "dp0": [0, 2], "dp1": [1, 3]})
    waits_in = {2: ("tp1", 5, 6), 3: ("dp1", 5, 6)}
    _heartbeats(
        migrated, run, [(r, t) for t in range(21) for r in RANKS if r > 1 or t < 4], step=lambda t: 3 if t < 5 else 4,
        progress=lambda r, t: min(t, 5 if r > 1 else 3), wait=lambda r, t: waits_in[r] if r in waits_in and t >= 6 else None,
    )  # fmt: skip
    _collectives(migrated, run, [(r, g, seq, T0 + seq * S // 2, T0 + seq * S // 2 + S // 4, 3)
                                 for r in RANKS for g in (f"dp{r % 2}", f"tp{r // 2}") for seq in range(1, 5)])  # fmt: skip
    (found,) = hang.detect(RunContext.load(run, migrated.query_arrow, Settings(hang_after_s=6, silent_after_s=10)))
    assert (found.ranks, found.hosts) == ((0, 1), ("node-0",)) and found.summary.startswith("hang: host node-0 ("), found.summary


def _in_transit(into: Store, run: str, *, mb_s: float, ends_s: int | None) -> None:
    """Four ranks (node-0: 0, 1; node-1: 2, 3), steps of 2 s until step 4 begins at 6 s: ranks 0 and 2 then
    enter pair #9 together and stay in it (their data on the wire), ranks 1 and 3 wait on them in
    default_pg #5. Each host's first rank reports its network counters every 2 s, moving ``mb_s`` MB/s from
    6 s (2 MB/s before). ``ends_s``: when pair #9 completes and step 5 begins (None: never)."""
    _job(into, run, {"default_pg": RANKS, "pair": [0, 2]})
    end = ends_s or 10**6
    step = lambda t: 1 + t // 2 if t < 6 else 4 if t < end else 5  # noqa: E731
    _heartbeats(
        into, run, [(r, t) for t in range(min(end + 3, 41)) for r in RANKS], step=step,
        progress=lambda r, t: t if t < 6 or t >= end else 6,
        wait=lambda r, t: (("pair", 9, 6) if r % 2 == 0 else ("default_pg", 5, 6)) if 6 <= t < end else None,
    )  # fmt: skip
    pair = [(r, "pair", seq, T0 + seq * S // 2, T0 + seq * S // 2 + S // 4, 1 + seq // 4) for r in (0, 2) for seq in range(1, 9)]
    pair += [(r, "pair", 9, T0 + 6 * S, T0 + end * S if ends_s else 0, 4) for r in (0, 2)]
    world = [(r, "default_pg", seq, T0 + seq * S, 0 if seq == 5 else T0 + seq * S + S // 4, min(seq, 4)) for r in RANKS for seq in range(1, 5)]
    world += [(r, "default_pg", 5, T0 + 6 * S, T0 + (end + 1) * S if ends_s else 0, 4) for r in (1, 3)]
    _collectives(into, run, pair + world)
    times = range(0, min(end + 3, 41), 2)
    counted = [int(2e6 * min(t, 6) + mb_s * 1e6 * max(0, min(t, end) - 6) + 2e6 * max(0, t - end)) for t in times]
    into.insert_arrow("metrics", rows(
        "metrics", 4 * len(counted), run_id=run, rank=[r for r in (0, 2) for _ in range(2) for _ in counted],
        host=[f"node-{r // 2}" for r in (0, 2) for _ in range(2) for _ in counted], device="eth0",
        name=[n for _ in (0, 2) for n in ("system.network.io.receive", "system.network.io.transmit") for _ in counted],
        time=[T0 + t * S for _ in range(4) for t in times], value=[float(v / 2) for _ in range(4) for v in counted],
    ))  # fmt: skip


def test_a_slow_transfer_is_not_a_hang_until_it_outlasts_three_stalls_and_a_dead_one_is_named_at_once(migrated: Store) -> None:  # noqa: F811
    """Ranks inside an operation every member entered wait on nobody: their data is on the wire. While
    their hosts still move bytes the stall is a slow transfer (campaign seed 1880171644: a host's link at
    9 Mbit/s, its first slow step 17 s, its ranks in their gradient all-reduce named hung 10 s in, live only),
    named a hang only past three times hang_after; a link that moves nothing is named at hang_after."""
    settings = Settings(hang_after_s=6, silent_after_s=10)
    _in_transit(migrated, "slow-wire", mb_s=1.0, ends_s=None)
    ctx = RunContext.load("slow-wire", migrated.query_arrow, settings)
    assert [hang.detect(replace(ctx, until_ns=T0 + t * S)) for t in (14, 20, 23)] == [[]] * 3
    (stuck,) = hang.detect(replace(ctx, until_ns=T0 + 26 * S))
    assert stuck.ranks == (0, 2) and stuck.evidence["hosts_moving_bytes_s"] == {"node-0": 1_000_000, "node-1": 1_000_000}, stuck.evidence
    assert "inside operations every member entered for 20 s while their hosts still move 1.00 MB/s or more" in stuck.summary, stuck.summary
    _in_transit(migrated, "dead-wire", mb_s=0.0, ends_s=None)
    (dead,) = hang.detect(replace(RunContext.load("dead-wire", migrated.query_arrow, settings), until_ns=T0 + 14 * S))
    assert dead.ranks == (0, 2) and "hosts_moving_bytes_s" not in dead.evidence, dead.evidence
    _in_transit(migrated, "slow-step", mb_s=1.0, ends_s=20)  # the transfer done in 14 s: no hang, live or replayed
    ctx = RunContext.load("slow-step", migrated.query_arrow, settings)
    assert [hang.detect(replace(ctx, until_ns=T0 + t * S)) for t in range(13, 20)] == [[]] * 7
    assert [i for i in postmortem.replay("slow-step", migrated.query_arrow, settings, over=True) if i.finding.kind == "hang"] == []

@pytest.mark.parametrize("entered_s", [30, 3], ids=["entered-after", "stopped-inside"])
def test_a_stopped_rank_is_placed_by_its_rows_and_its_stack_taken_by_its_host_mate_attached(migrated: Store, entered_s: int) -> None:  # noqa: F811
    """Rank 2 stopped (SIGSTOP) in step 4: its last heartbeat said step 3, its stored backward of step 4
    and its waiters place it in step 4; rank 3's dump of pid 1002 (rank 2's, on node-1) is its stack.
    Stopped inside the all-reduce the others wait in (its row of it stored: seed 111028093, whose row
    came only after it resumed, named live and not offline), silent, it is still what they wait on."""
    _stall_resolved(migrated, "frozen", frozen=True, entered_s=entered_s)
    found = postmortem.replay("frozen", migrated.query_arrow, Settings(hang_after_s=6, silent_after_s=10), over=True)
    assert [(i.finding.kind, i.finding.ranks) for i in found] == [("hang", (2,))], found
    hang = found[0].finding
    assert "rank 2 (node-1) in step 4 (its last stored span: backward of step 4; its last heartbeat: forward at step 3) is silent" in hang.summary
    assert hang.summary.endswith("stack taken from outside (rank 2's by rank 3)"), hang.summary
    assert hang.evidence["stacks_from_outside"] == {"2": {"method": "py-spy", "text": "Process 1002: python ddp_job.py\n", "taken_by": 3}}


def test_a_stall_before_or_in_the_first_step_is_given_start_up_time() -> None:
    """Three times --hang-after before step 1 and in step 1 while no step before it sets a pace (ranks
    in step 1 waiting for one still starting); after that --hang-after, or two steps at the pace."""
    s = Settings(hang_after_s=10.0)
    began = 100 * 10**9
    assert hang.stall_after_ns(s, 0, None, None) == hang.stall_after_ns(s, 1, began, (0, began - 10**9)) == 30 * 10**9
    assert hang.stall_after_ns(s, 1, began, None) == 30 * 10**9
    assert hang.stall_after_ns(s, 2, began, None) == 10 * 10**9
    assert hang.stall_after_ns(s, 3, began, (2, began - 10**9)) == 10 * 10**9
    assert hang.stall_after_ns(s, 3, began, (2, began - 8 * 10**9)) == 16 * 10**9  # two steps at 8 s a step
