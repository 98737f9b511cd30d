"""The seam between the diagnosis engine and its detectors, on a real store: a detector registered
is run in its lane and its place, live and offline, and its findings become incidents; what it
heeds and the stack dumps it wants are its own to say; the built-ins run in precedence order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pytest
from test_store import migrated, sample_rows, store  # noqa: F401 (fixtures)

from rankscope.collector.diagnosis import crash, hang, lane_process, registry
from rankscope.collector.diagnosis.detector import FunctionDetector, Scan, Urgency
from rankscope.collector.diagnosis.engine import THOROUGH, URGENT, LiveDiagnosis, diagnose, write_to
from rankscope.collector.store.base import Store
from rankscope.common.incidents import INCIDENTS_SQL, Finding, Incident, from_rows
from rankscope.common.settings import Settings

RUN = "job-0"
HEARD_SQL = (
    "SELECT rank, any(host) AS host, toUnixTimestamp64Nano(min(time)) AS first_ns, toUnixTimestamp64Nano(max(time)) AS last_ns "
    "FROM heartbeats WHERE run_id = {run:String} AND attempt = {attempt:UInt16} GROUP BY rank ORDER BY rank"
)


@dataclass
class Probe:
    """A detector of the test's own, no ``FunctionDetector``: the protocol is all the engine needs. It
    names each rank the store heard from (while ``finds``) and keeps what each pass handed it."""

    name: str
    kinds: tuple[str, ...]
    lane: Urgency = "thorough"
    heeds: tuple[str, ...] = ()
    stack_dumps: str | None = None
    finds: bool = True
    scans: list[Scan] = field(default_factory=list)

    def detect(self, scan: Scan) -> list[Finding]:
        self.scans.append(scan)
        if not self.finds:
            return []
        kind = self.kinds[0]
        return [Finding(kind, f"{kind}:rank={r['rank']}", "warning", (r["rank"],), (r["host"],), r["first_ns"], r["last_ns"],
                        f"rank {r['rank']} probed") for r in scan.ctx.query(HEARD_SQL, {"run": scan.ctx.run_id}).to_pylist()]  # fmt: skip


def _first_attempt(rows: pa.Table) -> pa.Table:
    return rows.set_column(rows.schema.get_field_index("attempt"), "attempt", pa.array([0] * rows.num_rows, pa.uint16()))


def _two_ranks_heard_now(store: Store) -> int:
    """A running run of two ranks on one host, registered a minute ago, heard from now, with a stack
    dump of each stored a second later; returns when it was last heard from (ns)."""
    now = time.time_ns()
    store.insert_arrow("runs", sample_rows("runs", 1, run_id="job", start_ns=now))
    store.insert_arrow("ranks", _first_attempt(sample_rows("ranks", 2, run_id=RUN, start_ns=now - 60 * 10**9)))
    store.insert_arrow("heartbeats", _first_attempt(sample_rows("heartbeats", 2, run_id=RUN, start_ns=now)))
    store.insert_arrow("stacks", _first_attempt(sample_rows("stacks", 2, run_id=RUN, start_ns=now + 10**9)))
    return now + 1_000_003  # the second heartbeat


def _incidents(store: Store) -> list[Incident]:
    return from_rows(store.query_arrow(INCIDENTS_SQL, {"run": RUN}).to_pylist())


def test_a_registered_detector_runs_in_its_lane_and_its_findings_become_incidents(migrated: Store) -> None:  # noqa: F811
    _two_ranks_heard_now(migrated)
    probe = Probe("probe", ("probe",))
    timed: list[str] = []
    live = LiveDiagnosis(migrated.query_arrow, write_to(migrated.insert_arrow), lambda run, rank, reason: None, Settings(),
                         on_detector=lambda name, seconds: timed.append(name))  # fmt: skip
    with registry.added(probe):
        assert THOROUGH.names[-1] == "probe" and "probe" not in URGENT.names
        live.pass_once(URGENT)
        assert probe.scans == [] and timed == ["hang", "crash"]  # not its lane
        live.pass_once(THOROUGH)
        assert timed[2:] == ["straggler", "nan", "slow_link", "gpu", "probe"]  # after the built-ins of its lane, timed
        assert [(i.incident_id, i.status, i.finding.ranks, i.finding.hosts) for i in _incidents(migrated)] == [
            ("probe:rank=0", "open", (0,), ("node-00",)), ("probe:rank=1", "open", (1,), ("node-00",))]  # fmt: skip
        probe.finds = False  # the fault is gone: the urgent lane does not own the kind, its own lane closes it
        live.pass_once(URGENT)
        assert {i.status for i in _incidents(migrated)} == {"open"}
        live.pass_once(THOROUGH)
        assert {i.status for i in _incidents(migrated)} == {"closed"}
        probe.finds = True  # offline, every lane: the probe too
        assert [f.key for f in diagnose(RUN, migrated.query_arrow, Settings()) if f.kind == "probe"] == ["probe:rank=0", "probe:rank=1"]
    passes = len(probe.scans)
    timed.clear()
    live.pass_once()
    assert len(probe.scans) == passes and "probe" not in timed and "probe" not in THOROUGH.names  # unregistered on leaving


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_detector_registered_in_the_collector_runs_in_its_lane_process(migrated: Store) -> None:  # noqa: F811
    """The collector runs each lane in a process of its own: a detector registered in the collector travels
    there (pickled; the test module imports there too) and its findings are written through the collector's
    store; one that cannot travel (a lambda) is named in a warning, not a failure."""
    _two_ranks_heard_now(migrated)
    unpicklable = FunctionDetector("lambda_probe", ("lambda_probe",), "thorough", lambda scan: [])
    with registry.added(Probe("travelled", ("travelled",))), registry.added(unpicklable):
        assert [d.name for d in lane_process._own_detectors()] == ["travelled"]
        asyncio.run(_lanes_until(migrated, lambda: any(i.finding.kind == "travelled" for i in _incidents(migrated))))
    assert sorted(i.finding.ranks for i in _incidents(migrated) if i.finding.kind == "travelled") == [(0,), (1,)]


async def _lanes_until(db: Store, done: Callable[[], bool], timeout_s: float = 90) -> None:
    """The lane processes over ``db`` (as the collector runs them) until ``done()``."""
    services = lane_process.Services(
        query=db.query_arrow, insert_incidents=lambda table: db.insert_arrow("incidents", table), request_stack=lambda *_: None,
        stored=lambda run: (0, 0), heard=lambda run, attempt, ranks: dict.fromkeys(ranks, time.time_ns()), forget=lambda run: None,
        passed=lambda lane, s: None, detected=lambda name, s: None,
    )  # fmt: skip
    stop = asyncio.Event()
    lanes = asyncio.create_task(lane_process.LaneProcesses(services, Settings(), 0.5, None, lambda lane: None).run(stop))
    deadline = time.monotonic() + timeout_s
    try:
        while not await asyncio.to_thread(done):
            assert time.monotonic() < deadline and not lanes.done(), "no finding of the registered detector was written"
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        await lanes


def test_what_a_detector_heeds_and_the_stack_dumps_it_wants_are_its_own_to_say(migrated: Store) -> None:  # noqa: F811
    _two_ranks_heard_now(migrated)
    root = Probe("root", ("stall",), "urgent", stack_dumps="stall root")
    echo = Probe("echo", ("echo",), "urgent", heeds=("stall",), finds=False)
    with pytest.raises(ValueError, match="heeds"):
        registry.register(echo)  # no detector before it names a stall
    asked: list[tuple[str, int, str]] = []
    live = LiveDiagnosis(migrated.query_arrow, write_to(migrated.insert_arrow), lambda run, rank, reason: asked.append((run, rank, reason)),
                         Settings())  # fmt: skip
    with registry.added(root), registry.added(echo):
        with pytest.raises(ValueError, match="heed its kinds"):
            registry.unregister(root)
        live.pass_once(URGENT)
        assert asked == [(RUN, 0, "stall root"), (RUN, 1, "stall root")]  # the ranks it named, asked for their stacks
        assert [f.key for f in echo.scans[-1].heeded] == ["stall:rank=0", "stall:rank=1"]  # handed the stalls of this pass
        stalls = [i for i in _incidents(migrated) if i.finding.kind == "stall"]
        assert [sorted(i.finding.evidence["stacks"]) for i in stalls] == [["0"], ["1"]]  # the stored dumps attached
        assert all(i.finding.summary.endswith("; stack dump attached") for i in stalls)
        live.pass_once(URGENT)
        assert len(asked) == 2  # asked once
    assert [d.name for d in registry.registered()] == [d.name for d in registry.BUILT_IN]


def test_the_built_ins_run_in_precedence_order_a_hang_before_the_crashes_it_causes(
    migrated: Store, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """The order docs/diagnosis.md gives; the crash detector is handed the hang of the same pass, and the
    hang gets its root's stack dump attached, as when the engine named them itself."""
    assert [d.name for d in registry.registered()] == ["hang", "crash", "straggler", "nan", "slow_link", "gpu"]
    assert (URGENT.names, THOROUGH.names) == (("hang", "crash"), ("straggler", "nan", "slow_link", "gpu"))
    with pytest.raises(ValueError, match="registered already"):
        registry.register(hang.DETECTOR)
    with pytest.raises(ValueError, match="'crash'"):
        registry.register(Probe("lost", ("lost_rank",)))  # one detector per kind: a lane closes its own kinds only
    last_heard_ns = _two_ranks_heard_now(migrated)
    hung = Finding("hang", "hang", "critical", (1,), ("node-00",), last_heard_ns - 10**9, last_heard_ns, "hang: rank 1 never reached the all-reduce")
    monkeypatch.setattr(hang, "detect", lambda ctx: [hung])
    handed: list[tuple[Finding | None, int]] = []
    monkeypatch.setattr(crash, "detect", lambda ctx, *, now_ns, hang=None, heard=None: (handed.append((hang, now_ns)), [])[1])
    found = diagnose(RUN, migrated.query_arrow, Settings())
    (handed_hang, now_ns), = handed
    assert handed_hang == found[0]
    assert last_heard_ns <= now_ns <= time.time_ns()  # a run heard just now: offline's now is the clock, as live's
    assert found[0].evidence["stacks"]["1"]["method"] == "py-spy" and set(found[0].evidence["stacks"]) == {"1"}
