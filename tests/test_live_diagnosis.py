"""The collector's live diagnosis loop on a real store: which runs each pass looks at."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace

import pyarrow as pa
import pytest
from test_store import migrated, sample_rows, store  # noqa: F401 (fixtures)

from rankscope.collector.decode import Decoded
from rankscope.collector.diagnosis import engine
from rankscope.collector.diagnosis.engine import LiveDiagnosis
from rankscope.collector.liveness import REJOIN_S, LastHeard
from rankscope.collector.store.base import Store
from rankscope.common.settings import Settings


def test_an_ended_run_is_concluded_after_its_last_passes_a_running_one_goes_on(
    migrated: Store, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    now = time.time_ns()
    runs = sample_rows("runs", 2, run_id="job", start_ns=now)
    runs = runs.set_column(runs.schema.get_field_index("status"), "status", pa.array(["finished", "running"]))
    migrated.insert_arrow(f"{migrated.database}.runs", runs)
    for run_id in ("job-0", "job-1"):  # both heard from within the recent window
        migrated.insert_arrow(f"{migrated.database}.heartbeats", sample_rows("heartbeats", 2, run_id=run_id, start_ns=now))
    seen: list[str] = []

    def query(sql: str, params: dict[str, object]) -> pa.Table:
        if "run" in params:
            seen.append(str(params["run"]))
        return migrated.query_arrow(sql, params)

    monkeypatch.setattr(engine, "CONCLUDE_AFTER_S", 0.5)
    timed: list[tuple[str, str]] = []
    live = LiveDiagnosis(query, lambda incidents: None, lambda run, rank, reason: None, Settings(),
                         on_detector=lambda name, seconds: timed.append((name, type(seconds).__name__)))  # fmt: skip
    live.pass_once()
    assert set(seen) == {"job-0", "job-1"}  # the ended run gets its final passes too
    detectors = [("hang", "float"), ("crash", "float"), ("straggler", "float"), ("nan", "float"), ("slow_link", "float"), ("gpu", "float")]
    assert timed == detectors * 2  # each detector of each run's pass, timed
    time.sleep(0.6)
    seen.clear()
    live.pass_once()
    assert set(seen) == {"job-1"}  # concluded: no more queries about it


def test_a_run_with_nothing_new_stored_is_passed_over_until_the_recheck(migrated: Store) -> None:  # noqa: F811
    now = time.time_ns()
    migrated.insert_arrow(f"{migrated.database}.runs", sample_rows("runs", 2, run_id="job", start_ns=now))
    for run_id in ("job-0", "job-1"):
        migrated.insert_arrow(f"{migrated.database}.heartbeats", sample_rows("heartbeats", 2, run_id=run_id, start_ns=now))
    stored = {"job-0": (3, 1), "job-1": (3, 1)}  # what the writer counts: batches, registrations among them
    seen: list[tuple[str, str]] = []

    def query(sql: str, params: dict[str, object]) -> pa.Table:
        if "run" in params:
            seen.append((str(params["run"]), "topology" if "FROM ranks" in sql else "detector"))
        return migrated.query_arrow(sql, params)

    settings = Settings(silent_after_s=9.0)  # rechecked every 3 s without new rows
    live = LiveDiagnosis(query, lambda incidents: None, lambda run, rank, reason: None, settings, interval_s=0.1, stored=stored.__getitem__)
    live.pass_once()
    assert {run for run, _ in seen} == {"job-0", "job-1"}
    seen.clear()
    live.pass_once()
    assert seen == []  # nothing new stored: no queries at all about either run
    stored["job-1"] = (4, 1)  # a data batch of job-1
    live.pass_once()
    assert {run for run, _ in seen} == {"job-1"} and ("job-1", "topology") not in seen  # its topology is kept
    seen.clear()
    stored["job-1"] = (5, 2)  # a rank (re)registered
    live.pass_once()
    assert ("job-1", "topology") in seen
    seen.clear()
    time.sleep(3.0)
    live.pass_once()
    assert {run for run, _ in seen} == {"job-0", "job-1"}  # the recheck: silence shows only with time,
    assert ("job-0", "topology") in seen  # and ranks that registered with another collector of the store


def test_a_host_finding_continues_the_incident_of_its_first_straggler_rank() -> None:
    """A straggler rank is named first; once its whole host is slow the same incident names the host."""
    from rankscope.collector.diagnosis.ledger import Ledger
    from rankscope.common.incidents import Finding

    rank = Finding("straggler", "straggler:rank=5", "warning", (5,), ("node2",), 10, 20, "rank 5 (node2): backward 180% slower")
    host = Finding("straggler", "straggler:host=node2", "warning", (4, 5), ("node2",), 12, 30, "host node2: ranks 4, 5 are all slower",
                   absorbs=("straggler:rank=5", "straggler:rank=4"))  # fmt: skip
    ledger = Ledger("run")
    _, new = ledger.update([rank])
    assert [i.incident_id for i in new] == ["straggler:rank=5"]
    stored, new = ledger.update([host])
    assert new == [] and [(i.incident_id, i.finding.ranks, i.status) for i in stored] == [("straggler:rank=5", (4, 5), "open")]
    assert stored[0].finding.first_seen_ns == 10  # the fault's first sighting stays
    stored, _ = ledger.update([host], final=True)
    assert [(i.incident_id, i.status) for i in stored] == [("straggler:rank=5", "closed")]
    assert [i.incident_id for i in ledger.incidents.values()] == ["straggler:rank=5"]
    _, new = Ledger("run").update([host])  # nothing to continue: the host's own id
    assert [i.incident_id for i in new] == ["straggler:host=node2"]
    # a host named first, then one of its ranks alone (its host-mate's slowness dipped): one incident still
    ledger = Ledger("run")
    ledger.update([host])
    alone = Finding("straggler", "straggler:rank=5", "warning", (5,), ("node2",), 10, 40, "rank 5 (node2): backward 180% slower",
                    absorbs=("straggler:host=node2",))  # fmt: skip
    stored, new = ledger.update([alone])
    assert new == [] and [(i.incident_id, i.finding.ranks) for i in stored] == [("straggler:host=node2", (5,))]


def test_a_host_named_slow_stays_named_while_a_rank_of_it_is_still_slow(migrated: Store) -> None:  # noqa: F811
    """node2 (ranks 4, 5) throttled: both slow, the host is named; then rank 4 dips under the bar and rank 5
    alone is slow: still the host (the test bed's page: named live as the host for 40 s, then as rank 5
    alone to the end, and `rankscope diagnose` printed rank 5). Once none of it is slow, the episode is
    over: a rank of it slow later is named alone."""
    from rankscope.collector.diagnosis import straggler
    from rankscope.collector.diagnosis.context import RunContext

    ranks = {4: "node2", 5: "node2", 6: "node3", 7: "node3"}
    ctx = RunContext("held", lambda sql, params: migrated.query_arrow(sql, {"attempt": 0, **params}), Settings(), host=ranks,
                     stage=dict.fromkeys(ranks, 1), ranks_of_host={"node2": [4, 5], "node3": [6, 7]})  # fmt: skip

    def slow(*which: int) -> dict[int, dict]:
        return {r: {"segment": "step compute", "segments": ["forward"], "measure": "wall time", "ratio": 3.0 + r / 10, "threshold": 2.0,
                    "since_step": 12, "since_ns": 1, "last_ns": 2, "steps": [{"step": 20}]} for r in which}  # fmt: skip

    named = [(f.key, f.ranks) for f in straggler._findings(ctx, slow(4, 5), {})]  # noqa: SLF001
    assert named == [("straggler:host=node2", (4, 5))]
    (held,) = straggler._findings(ctx, slow(5), {})  # noqa: SLF001
    assert (held.key, held.ranks) == ("straggler:host=node2", (4, 5)) and held.summary.startswith("host node2: ranks 4, 5 were all slower than their stage peers, rank 5 still is;"), held.summary
    ctx.seen.pop(straggler.HOSTS_NAMED)  # what a pass with no slow rank does (``detect``)
    assert [(f.key, f.ranks) for f in straggler._findings(ctx, slow(5), {})] == [("straggler:rank=5", (5,))]  # noqa: SLF001


def test_a_host_finding_merges_the_incidents_of_its_ranks_named_alone_in_turn() -> None:
    """Rank 5 named alone, then rank 4 alone (rank 5's slowness dipped), then their host: one fault,
    one incident listed; rank 4's stays stored as merged into it, and rank 4 named alone later goes on with it."""
    from rankscope.collector.diagnosis.ledger import Ledger
    from rankscope.common.incidents import Finding

    def alone(rank: int, host: str = "node2") -> Finding:
        return Finding("straggler", f"straggler:rank={rank}", "warning", (rank,), (host,), 10 + rank, 20, f"rank {rank} slower",
                       absorbs=(f"straggler:host={host}",))  # fmt: skip

    host = Finding("straggler", "straggler:host=node2", "warning", (4, 5), ("node2",), 12, 30, "host node2: ranks 4, 5 are all slower",
                   absorbs=("straggler:rank=5", "straggler:rank=4"))  # fmt: skip
    ledger = Ledger("run")
    ledger.update([alone(5)])
    ledger.update([alone(4)])
    stored, new = ledger.update([host])
    assert new == [] and sorted((i.incident_id, i.status, i.finding.evidence.get("merged_into")) for i in stored) == [
        ("straggler:rank=4", "merged", "straggler:rank=5"), ("straggler:rank=5", "open", None)]  # fmt: skip
    stored, new = ledger.update([alone(4)])
    assert new == [] and [(i.incident_id, i.status, i.finding.ranks) for i in stored] == [("straggler:rank=5", "open", (4,))]
    # Two ranks of a host of three named alone in one pass: each keeps its own incident, none is lost.
    ledger = Ledger("run")
    ledger.update([replace(host, key="straggler:host=node7", absorbs=())])
    stored, new = ledger.update([alone(1, "node7"), alone(2, "node7")])
    assert sorted(i.incident_id for i in stored if i.status == "open") == ["straggler:host=node7", "straggler:rank=2"]
    assert [i.incident_id for i in new] == ["straggler:rank=2"]


SILENT_AFTER_5S = Settings(silent_after_s=5.0, hang_after_s=10.0)  # silence settled after 15 s (crash._settled)


def _two_ranks_stored_until(db: Store, beat_ns: int) -> pa.Table:
    """A run of two ranks on one host, started a minute ago, whose stored heartbeats are of ``beat_ns``: those heartbeats."""
    now = time.time_ns()

    def first_attempt(rows: pa.Table) -> pa.Table:
        return rows.set_column(rows.schema.get_field_index("attempt"), "attempt", pa.array([0] * rows.num_rows, pa.uint16()))

    db.insert_arrow(f"{db.database}.runs", sample_rows("runs", 1, run_id="job", start_ns=now))
    db.insert_arrow(f"{db.database}.ranks", first_attempt(sample_rows("ranks", 2, run_id="job-0", start_ns=now - 60 * 10**9)))
    beats = first_attempt(sample_rows("heartbeats", 2, run_id="job-0", start_ns=beat_ns))
    db.insert_arrow(f"{db.database}.heartbeats", beats)
    return beats


def _lost(db: Store, heard: LastHeard | None) -> list[str]:
    """The kinds of incident one live pass names, with ranks silent after 5 s."""
    written: list = []
    LiveDiagnosis(db.query_arrow, written.extend, lambda run, rank, reason: None, SILENT_AFTER_5S, heard=heard).pass_once()
    return [i.finding.kind for i in written]


def test_ranks_are_lost_by_when_the_collector_last_heard_them_not_by_what_it_stored(migrated: Store) -> None:  # noqa: F811
    """A collector that lags stores heartbeats late: by its store, every rank is a minute silent."""
    now = time.time_ns()
    beats = _two_ranks_stored_until(migrated, now - 60 * 10**9)
    assert _lost(migrated, None) == ["lost_host"]  # the store alone: a minute of silence
    heard = LastHeard(stale_ns=5 * 10**9)
    for rank in range(2):  # a heartbeat of each rank arrived just now, carrying a time of a moment ago
        fresh = beats.slice(rank, 1).set_column(beats.schema.get_field_index("time"), "time", pa.array([now - 10**9], pa.timestamp("ns")))
        heard.note(Decoded("heartbeats", {"heartbeats": fresh}), now)
    assert _lost(migrated, heard) == []
    # a spool replayed now, its heartbeats a minute old, to a collector listening for two minutes: no news
    replayed = LastHeard(stale_ns=5 * 10**9, started_ns=now - 120 * 10**9)
    for rank in range(2):
        replayed.note(Decoded("heartbeats", {"heartbeats": beats.slice(rank, 1)}), now)
    assert _lost(migrated, replayed) == ["lost_host"]


def test_every_rank_silent_at_once_is_named_only_past_the_patience_for_a_hang(migrated: Store) -> None:  # noqa: F811
    """Every rank of the run silent for 10 s (past the 5 s bar), none ended: the collector may be the
    one that cannot hear (starved, the calls unread in its sockets), so nothing is named before the
    silence outlasts the patience for a hang (15 s; the tests around: 20 s and more, a lost host)."""
    _two_ranks_stored_until(migrated, time.time_ns() - 10 * 10**9)
    assert _lost(migrated, None) == []


def test_a_lost_rank_found_to_have_crashed_is_one_incident(migrated: Store) -> None:  # noqa: F811
    """Rank 1 silent while rank 0 of its host beats: a lost rank. Then rank 0 ends (its launcher stopped it
    after rank 1 died): a crash, which goes on with the lost rank's incident, not a second one beside it
    (testbed-kill-rank named both when the others' ends came after rank 1's silence was judged)."""
    now = time.time_ns()
    beats = _two_ranks_stored_until(migrated, now - 100 * 10**9)  # past the patience for a hang (15 s)
    heard = LastHeard(stale_ns=5 * 10**9, started_ns=now - 120 * 10**9)
    heard.note(Decoded("heartbeats", {"heartbeats": beats.slice(0, 1).set_column(
        beats.schema.get_field_index("time"), "time", pa.array([now - 10**9], pa.timestamp("ns")))}), now)  # fmt: skip
    written: list = []
    live = LiveDiagnosis(migrated.query_arrow, written.extend, lambda run, rank, reason: None, SILENT_AFTER_5S, heard=heard)
    live.pass_once()
    assert [(i.incident_id, i.finding.kind) for i in written] == [("lost:rank=1", "lost_rank")]
    ended = sample_rows("exits", 1, run_id="job-0", start_ns=now)
    migrated.insert_arrow(f"{migrated.database}.exits", ended.set_column(ended.schema.get_field_index("reason"), "reason", pa.array(["normal"])))
    written.clear()
    live.pass_once()
    assert [(i.incident_id, i.finding.kind, i.finding.ranks, i.status) for i in written] == [("lost:rank=1", "crash", (1,), "open")]


def test_a_rank_whose_host_mate_ended_after_its_last_heartbeat_crashed_however_late_that_heartbeat_was_answered(migrated: Store) -> None:  # noqa: F811
    """Rank 1's last heartbeat, of 100 s ago, answered 3 s after it was sent (a lagging collector); rank 0,
    on its host, ended 1 s after it: by the host's clock rank 1 died first, a crash, as offline says.
    Judged by when the collector heard rank 1 it was a lost rank (seed 594157657: both raised live)."""
    now = time.time_ns()
    beats = _two_ranks_stored_until(migrated, now - 100 * 10**9)
    heard = LastHeard(stale_ns=5 * 10**9, started_ns=now - 120 * 10**9)
    heard.note(Decoded("heartbeats", {"heartbeats": beats.slice(1, 1)}), now - 100 * 10**9 + 10**8, answered_ns=now - 97 * 10**9)
    ended = sample_rows("exits", 1, run_id="job-0", start_ns=now - 99 * 10**9)
    migrated.insert_arrow(f"{migrated.database}.exits", ended.set_column(ended.schema.get_field_index("reason"), "reason", pa.array(["normal"])))
    assert _lost(migrated, heard) == ["crash"]


def test_the_time_before_the_collector_started_is_no_rank_s_silence(migrated: Store) -> None:  # noqa: F811
    """A collector killed and restarted: its ranks, not heard yet or heard by a spool replaying
    heartbeats of before its start, are not lost for its downtime, nor for the time their agents
    take to come back (a call's deadline and a probe: REJOIN_S); silent from the run's first fresh call."""
    now = time.time_ns()
    beats = _two_ranks_stored_until(migrated, now - 60 * 10**9)
    restarted = LastHeard(stale_ns=5 * 10**9, started_ns=now - 10**9)
    restarted.note(Decoded("heartbeats", {"heartbeats": beats.slice(1, 1)}), now)
    assert _lost(migrated, restarted) == []
    assert _lost(migrated, LastHeard(stale_ns=5 * 10**9, started_ns=now - 10 * 10**9)) == []  # its agents may still be on their way
    rejoined = LastHeard(stale_ns=5 * 10**9, started_ns=now - 20 * 10**9)
    rejoined.sent(now - 20 * 10**9, now - 20 * 10**9 + 10**6, "job-0")  # a call of the run, fresh: its agents are back
    rejoined.sent(now - 200 * 10**9, now, "job-0")  # a replay of old batches says nothing
    assert _lost(migrated, rejoined) == ["lost_host"]  # silent 20 s since
    assert _lost(migrated, LastHeard(stale_ns=5 * 10**9, started_ns=now - int((REJOIN_S + 20) * 1e9))) == ["lost_host"]  # never back


def test_the_time_the_collector_stalled_is_no_rank_s_silence(migrated: Store) -> None:  # noqa: F811
    """Heard 20 s ago, then the collector's event loop stopped for 20 s (SIGSTOP, a starved CPU): the
    ranks' calls waited unread, so nobody is silent, during the stall (a pass can run before the
    loop catches up) or after it; a loop that ticked all along hears the same silence as silence."""
    heard_ns, tick = time.time_ns() - 20 * 10**9, time.monotonic_ns()
    beats = _two_ranks_stored_until(migrated, heard_ns)

    def heard_then(last_tick_ns: int) -> LastHeard:
        heard = LastHeard(stale_ns=5 * 10**9, started_ns=heard_ns - 10**9)  # listening since before it heard them
        heard.listening(last_tick_ns)
        heard.sent(heard_ns, heard_ns, "job-0")
        heard.note(Decoded("heartbeats", {"heartbeats": beats}), heard_ns)
        return heard

    stalled = heard_then(tick - 21 * 10**9)  # its last tick just after it heard them
    assert _lost(migrated, stalled) == []  # the stall in progress
    stalled.listening()  # the loop runs again
    assert _lost(migrated, stalled) == []
    steady = heard_then(tick - 21 * 10**9)
    for second in range(20, -1, -1):
        steady.listening(tick - second * 10**9)
    assert _lost(migrated, steady) == ["lost_host"]


def test_a_collector_waiting_for_a_cpu_between_on_time_ticks_still_hears_a_silence(migrated: Store, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """Heard 20 s ago, then a loop that ticked every second on time but waited 0.9 s of each for a CPU (a
    collector at nice 10 beside a busy job): its calls are taken up on time, so the silence is one, and
    the host is lost; the wait is said, once."""
    heard_ns, tick = time.time_ns() - 20 * 10**9, time.monotonic_ns()
    beats = _two_ranks_stored_until(migrated, heard_ns)
    waited = itertools.count(0, int(0.9e9))
    heard = LastHeard(stale_ns=5 * 10**9, started_ns=heard_ns - 10**9, cpu_wait=lambda: next(waited))
    heard.listening(tick - 21 * 10**9)
    heard.sent(heard_ns, heard_ns, "job-0")
    heard.note(Decoded("heartbeats", {"heartbeats": beats}), heard_ns)
    with caplog.at_level(logging.WARNING, logger="rankscope.collector"):
        for second in range(20, -1, -1):
            heard.listening(tick - second * 10**9)
    assert _lost(migrated, heard) == ["lost_host"]
    assert [r.getMessage() for r in caplog.records if "for a CPU" in r.getMessage()] == [
        "rankscope collector: its event loop waited 0.9 s of the last 1.0 s for a CPU (short of CPU? see --nice): "
        "a rank's silence is judged by how late its calls are taken up"]  # fmt: skip


def test_after_a_long_deafness_the_ranks_have_the_time_an_agent_takes_to_come_back(migrated: Store) -> None:  # noqa: F811
    """Heard 60 s ago, then the collector stalled 40 s and has listened on time for 10 s since, hearing
    nobody: their calls may have outlived their deadline (30 s), and an agent comes back by its next
    probe, so nobody is lost before REJOIN_S has passed. After a stall of 10 s, they are."""
    heard_ns, tick = time.time_ns() - 60 * 10**9, time.monotonic_ns()
    beats = _two_ranks_stored_until(migrated, heard_ns)

    def stalled_for(stall_s: int) -> LastHeard:
        heard = LastHeard(stale_ns=5 * 10**9, started_ns=heard_ns - 10**9, cpu_wait=lambda: None)
        heard.listening(tick - (stall_s + 11) * 10**9)
        heard.sent(heard_ns, heard_ns, "job-0")
        heard.note(Decoded("heartbeats", {"heartbeats": beats}), heard_ns)
        for second in range(10, -1, -1):  # the first tick after the stall, then on time
            heard.listening(tick - second * 10**9)
        return heard

    assert _lost(migrated, stalled_for(40)) == []
    assert _lost(migrated, stalled_for(10)) == ["lost_host"]


def test_the_time_calls_wait_for_a_collector_behind_them_is_no_rank_s_silence(migrated: Store) -> None:  # noqa: F811
    """A loop that ticks on time but takes up each call 20 s after it was sent (a starved collector's
    backlog): heartbeats said 20 s ago arrive now, stale, so the ranks are heard 20 s ago: not lost while
    every call waits that long, lost once the calls come in on time again and the ranks stay quiet."""
    now = time.time_ns()
    beats = _two_ranks_stored_until(migrated, now - 20 * 10**9)
    heard = LastHeard(stale_ns=5 * 10**9, started_ns=now - 60 * 10**9)
    for late_by in (2, 1):  # two seconds of calls, each 20 s late (a replayed one: its own send is stamped anew)
        heard.sent(now - (late_by + 20) * 10**9, now - late_by * 10**9)
        heard.sent(now - late_by * 10**9 - 10**8 - 10**9 * 60, now - late_by * 10**9 + 10**8)
    heard.note(Decoded("heartbeats", {"heartbeats": beats}), now)
    assert heard.behind_ns() == 20 * 10**9
    assert _lost(migrated, heard) == []
    heard.sent(now, now + 10**6)  # on time again: a new second ends the late one
    heard.sent(now + 10**9, now + 10**9 + 10**6)
    assert heard.behind_ns() == 0 and _lost(migrated, heard) == ["lost_host"]


def test_the_time_the_collector_keeps_calls_waiting_for_their_answer_is_no_rank_s_silence(migrated: Store) -> None:  # noqa: F811
    """Calls taken up at once but answered 20 s later (a flush behind a flood of replays): the agents
    could not send their heartbeats meanwhile, so ranks heard 20 s ago are not lost while a call waits
    that long, nor for a while after its answer; with no call kept waiting, they are."""
    now = time.time_ns()
    beats = _two_ranks_stored_until(migrated, now - 20 * 10**9)

    def heard_20_s_ago() -> LastHeard:
        heard = LastHeard(stale_ns=5 * 10**9, started_ns=now - 60 * 10**9)
        heard.sent(now - 21 * 10**9, now - 21 * 10**9, "job-0")
        heard.note(Decoded("heartbeats", {"heartbeats": beats}), now - 20 * 10**9)
        return heard

    assert _lost(migrated, heard_20_s_ago()) == ["lost_host"]
    waiting = heard_20_s_ago()
    answered = waiting.answering(now - 20 * 10**9)
    assert waiting.kept_waiting_ns() >= 20 * 10**9 and _lost(migrated, waiting) == []
    answered()
    assert waiting.kept_waiting_ns() >= 20 * 10**9 and _lost(migrated, waiting) == []  # answered just now, 20 s late
    assert waiting.kept_waiting_ns(time.time_ns() + 6 * 10**9) < 10**9  # 5 s on, a slow answer is history


def test_a_lane_closes_only_the_incidents_of_its_own_kinds() -> None:
    """The urgent lane finds no straggler because it does not look for one: that closes nothing."""
    from rankscope.collector.diagnosis.ledger import Ledger
    from rankscope.common.incidents import Finding

    slow = Finding("straggler", "straggler:rank=5", "warning", (5,), ("node2",), 10, 20, "rank 5 (node2): backward 180% slower")
    hung = Finding("hang", "hang", "critical", (3,), ("node1",), 30, 40, "hang: rank 3 never reached the all-reduce")
    ledger = Ledger("run")
    ledger.update([slow], owns=engine.THOROUGH.owns)
    stored, new = ledger.update([hung], owns=engine.URGENT.owns)
    assert [i.incident_id for i in new] == ["hang"] and [i.incident_id for i in stored] == ["hang"]  # the straggler stays open
    stored, _ = ledger.update([], owns=engine.THOROUGH.owns)
    assert [(i.incident_id, i.status) for i in stored] == [("straggler:rank=5", "closed")]  # the hang stays open
    stored, _ = ledger.update([], final=True, owns=engine.URGENT.owns)
    assert [(i.incident_id, i.status) for i in stored] == [("hang", "closed")]
    every_kind = {kind for detector in engine.EVERY.detectors for kind in detector.kinds}
    assert all(engine.URGENT.owns(k) != engine.THOROUGH.owns(k) and engine.EVERY.owns(k) for k in every_kind)  # one lane each


@pytest.mark.timeout(60)
def test_a_long_thorough_pass_does_not_hold_up_the_urgent_lane(migrated: Store, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """At 100,000 ranks a straggler pass took tens of seconds and the hang waited behind it: the lanes
    pass on their own schedules, so hangs and crashes are looked for meanwhile."""
    import asyncio

    from rankscope.collector.diagnosis import straggler

    now = time.time_ns()
    migrated.insert_arrow(f"{migrated.database}.runs", sample_rows("runs", 1, run_id="job", start_ns=now))
    migrated.insert_arrow(f"{migrated.database}.heartbeats", sample_rows("heartbeats", 2, run_id="job-0", start_ns=now))
    detect = straggler.detect
    monkeypatch.setattr(straggler, "detect", lambda ctx: (time.sleep(3.0), detect(ctx))[1])  # a straggler pass of 3 s
    passes: list[tuple[str, float]] = []
    live = LiveDiagnosis(migrated.query_arrow, lambda incidents: None, lambda run, rank, reason: None, Settings(), interval_s=0.2,
                         on_pass=lambda lane, seconds: passes.append((lane, seconds)))  # fmt: skip

    async def for_a_while() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(live.run(stop))
        await asyncio.sleep(2.5)
        stop.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(for_a_while())
    urgent = [seconds for lane, seconds in passes if lane == "urgent"]
    assert len(urgent) >= 3 and max(urgent) < 2.0, passes  # during the thorough lane's first pass
    assert [lane for lane, _ in passes].count("thorough") == 1 and min(s for lane, s in passes if lane == "thorough") >= 3.0
