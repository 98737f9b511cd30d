"""`rankscope diagnose`'s postmortem on a real store: an episode that opened and closed during the run
is replayed (one pass at the end would not see it), silence is judged when the live passes last
looked, the live incidents are compared, and window reads come in pages under the result limit.
The same, on real runs with real faults: tests/test_diagnosis_scenarios.py, tests/test_testbed_scenarios.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_detector_registry import RUN, _first_attempt
from test_store import T0, migrated, sample_rows, store  # noqa: F401 (fixtures)

from rankscope.collector.diagnosis import postmortem, registry
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
