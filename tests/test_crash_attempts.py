"""A restart faster than the silence that names a dead host: the attempt before the newest is judged
as it ended, live and offline alike.

A job of two hosts (ranks 0, 1 on node-a; 2, 3 on node-b). node-b's ranks fall silent without a last
word; node-a's are stopped by their launcher a second later; 3 s after the silence the job runs
again (attempt 1), before the 5 s that make a rank silent. The newest attempt alone shows nothing.
"""

from __future__ import annotations

import time

import pytest
from test_diagnosis_state import rows
from test_store import migrated, store  # noqa: F401 (fixtures)

from rankscope.collector.diagnosis import postmortem
from rankscope.collector.diagnosis.engine import LiveDiagnosis, write_to
from rankscope.collector.store.base import Store
from rankscope.common.settings import Settings

pytestmark = pytest.mark.timeout(120)

RUN = "restarted"
SETTINGS = Settings(silent_after_s=5.0, hang_after_s=10.0)
S = 10**9


def _restarted(db: Store, now: int, hosts_after: tuple[str, str]) -> int:
    """The run, its attempt 0 over and attempt 1 (on ``hosts_after``) beating now; returns when attempt 1 began."""
    silent_ns, began_ns = now - 12 * S, now - 9 * S
    db.insert_arrow("runs", rows("runs", 1, run_id=RUN, start_time=now - 60 * S, world_size=4, status="running", updated=now - 60 * S))
    hosts = ["node-a", "node-a", "node-b", "node-b"]
    db.insert_arrow("ranks", rows("ranks", 4, run_id=RUN, rank=[0, 1, 2, 3], host=hosts, attempt=0, registered=now - 60 * S, world="w/4"))
    db.insert_arrow("heartbeats", rows("heartbeats", 4, run_id=RUN, rank=[0, 1, 2, 3], host=hosts, attempt=0, step=7, phase="forward",
                                       status="running", time=[silent_ns + S // 2] * 2 + [silent_ns] * 2, last_progress=silent_ns))  # fmt: skip
    db.insert_arrow("exits", rows("exits", 2, run_id=RUN, rank=[0, 1], host="node-a", attempt=0, time=silent_ns + S, reason="signal",
                                  exit_code=-15, signal=15, message="SIGTERM"))  # fmt: skip
    after = [hosts_after[0]] * 2 + [hosts_after[1]] * 2
    db.insert_arrow("ranks", rows("ranks", 4, run_id=RUN, rank=[0, 1, 2, 3], host=after, attempt=1, registered=began_ns, world="w/4"))
    db.insert_arrow("heartbeats", rows("heartbeats", 4, run_id=RUN, rank=[0, 1, 2, 3], host=after, attempt=1, step=5, phase="forward",
                                       status="running", time=now - S // 2, last_progress=now - S // 2))  # fmt: skip
    return began_ns


def _live_then_offline(db: Store) -> tuple[list[tuple[str, tuple[int, ...], tuple[str, ...], str]], postmortem.Comparison]:
    """What a live pass names (kind, ranks, hosts, summary), then the postmortem beside what was raised live."""
    written: list = []
    store_incidents = write_to(db.insert_arrow)
    LiveDiagnosis(db.query_arrow, lambda i: (written.extend(i), store_incidents(i)), lambda run, rank, why: None, SETTINGS).pass_once()
    named = [(i.finding.kind, i.finding.ranks, i.finding.hosts, i.finding.summary) for i in written]
    offline = postmortem.replay(RUN, db.query_arrow, SETTINGS, over=False)
    return named, postmortem.compare(offline, postmortem.live(RUN, db.query_arrow))


def test_a_host_lost_just_before_a_fast_restart_is_named_live_and_offline(migrated: Store) -> None:  # noqa: F811
    now = time.time_ns()
    began = _restarted(migrated, now, ("node-a", "node-c"))  # node-c, a spare, in node-b's place
    named, comparison = _live_then_offline(migrated)
    assert [(kind, ranks, hosts) for kind, ranks, hosts, _ in named] == [("lost_host", (2, 3), ("node-b",))]
    assert [(i.finding.kind, i.finding.hosts, i.finding.last_seen_ns) for i in comparison.offline] == [("lost_host", ("node-b",), began)]
    assert comparison.agrees, comparison


def test_a_host_whose_ranks_died_and_that_is_in_the_restart_had_a_crash(migrated: Store) -> None:  # noqa: F811
    _restarted(migrated, time.time_ns(), ("node-a", "node-b"))
    named, comparison = _live_then_offline(migrated)
    assert [(kind, ranks, hosts) for kind, ranks, hosts, _ in named] == [("crash", (2, 3), ("node-b",))]
    assert "it is in the next attempt" in named[0][3]
    assert comparison.agrees and len(comparison.offline) == 1, comparison


@pytest.mark.parametrize(("evicted_s", "named"), [(-13, []), (-5, [("lost_host", (2, 3), ("node-b",))])])
def test_a_host_the_driver_fenced_before_the_restart_is_its_incident_s(
    migrated: Store, evicted_s: int, named: list  # noqa: F811
) -> None:
    """Evicted (a straggler, say) 1 s before its ranks went silent: the driver's fence killed them, on an
    incident already raised; nothing more is named. Evicted after the restart: the eviction acted on
    the lost host, which stays named."""
    now = time.time_ns()
    _restarted(migrated, now, ("node-a", "node-c"))
    migrated.insert_arrow("actions", rows("actions", 1, run_id=RUN, time=now + evicted_s * S, action="evict", hosts=[["node-b"]],
                                          incident_id="straggler:host=node-b", evidence="{}"))  # fmt: skip
    found, comparison = _live_then_offline(migrated)
    assert [(kind, ranks, hosts) for kind, ranks, hosts, _ in found] == named
    assert comparison.agrees, comparison
