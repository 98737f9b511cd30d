"""Runs the detectors over a run and turns their findings into incidents.

``diagnose`` is one pass over one run through any ``query`` function: the collector calls it
live every few seconds for the runs that are active, ``rankscope diagnose`` once, offline.
Order matters: a hang is looked for before crashes, because the ranks that time out after a
hang are its consequences, not crashes of their own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from rankscope.collector.diagnosis import crash, gpu, hang, nan, slow_link, straggler
from rankscope.collector.diagnosis.context import Query, RunContext, Settings
from rankscope.collector.ingest import LastHeard
from rankscope.collector.diagnosis.incidents import INCIDENTS_SQL, Finding, Incident, Ledger, from_rows, to_arrow

log = logging.getLogger("rankscope.diagnosis")

#: default seconds between two passes (a pass is tens of queries, each with a fixed cost)
DIAGNOSE_EVERY_S = 5.0
#: seconds an ended run is still diagnosed (late rows of its last moments may still come in)
CONCLUDE_AFTER_S = 10.0

LAST_DATA_SQL = (
    "SELECT greatest((SELECT toUnixTimestamp64Nano(max(last_heartbeat)) FROM rank_state WHERE run_id = {run:String} AND attempt = {attempt:UInt16}), "
    "(SELECT toUnixTimestamp64Nano(max(time)) FROM exits WHERE run_id = {run:String} AND attempt = {attempt:UInt16})) AS ns"
)
STACK_SQL = (
    "SELECT rank, text, method, toUnixTimestamp64Nano(time) AS time_ns FROM stacks WHERE run_id = {run:String} AND attempt = {attempt:UInt16} "
    "AND rank IN {ranks:Array(UInt32)} AND time >= fromUnixTimestamp64Nano({since:Int64}) ORDER BY time DESC LIMIT 1 BY rank"
)
# The runs heard from lately, by every rank's latest heartbeat: a store's heartbeats of today are
# millions of rows, its ranks' latest a row each.
ACTIVE_RUNS_SQL = (
    "SELECT run_id, argMax(status, updated) AS status FROM runs GROUP BY run_id "
    "HAVING run_id IN (SELECT run_id FROM rank_state GROUP BY run_id "
    "HAVING max(last_heartbeat) >= now64(9) - toIntervalSecond({recent_s:UInt32})) OR status = 'running'"
)


def diagnose(
    run_id: str, query: Query, settings: Settings, *, now_ns: int | None = None, ctx: RunContext | None = None,
    heard: Mapping[int, int] | None = None, on_detector: Callable[[str, float], None] | None = None,
) -> list[Finding]:  # fmt: skip
    """Every detector's findings for ``run_id``; ``now_ns`` defaults to the run's last data (offline),
    ``ctx`` to the run's topology read now; ``heard``: rank -> when the collector last heard from it
    (live: its own clock, ahead of what it has stored when it lags); ``on_detector(name, seconds)``
    hears how long each detector took."""
    ctx = ctx or RunContext.load(run_id, query, settings)
    if now_ns is None:
        now_ns = int(ctx.query(LAST_DATA_SQL, {"run": run_id}).to_pylist()[0]["ns"] or 0)
    timed = _Timed(on_detector)
    hangs = timed("hang", lambda: _with_stacks(ctx, hang.detect(ctx)))
    findings = list(hangs)
    findings += timed("crash", lambda: crash.detect(ctx, now_ns=now_ns, hang=hangs[0] if hangs else None, heard=heard))
    for detector in (straggler, nan, slow_link, gpu):
        findings += timed(detector.__name__.rsplit(".", 1)[-1], lambda: detector.detect(ctx))  # noqa: B023 (called at once)
    return findings


class _Timed:
    """Calls a detector and tells ``on_detector`` how long it took (nothing when there is no listener)."""

    def __init__(self, on_detector: Callable[[str, float], None] | None):
        self.on_detector = on_detector

    def __call__(self, name: str, detect: Callable[[], list[Finding]]) -> list[Finding]:
        began = time.perf_counter()
        try:
            return detect()
        finally:
            if self.on_detector is not None:
                self.on_detector(name, time.perf_counter() - began)


def _with_stacks(ctx: RunContext, findings: list[Finding]) -> list[Finding]:
    """Attach the newest stack dump of each root rank taken since the hang began."""
    out = []
    for f in findings:
        rows = ctx.query(STACK_SQL, {"run": ctx.run_id, "ranks": list(f.ranks), "since": f.first_seen_ns}).to_pylist()
        if rows:
            stacks = {str(r["rank"]): {"method": r["method"], "text": r["text"]} for r in rows}
            f = replace(f, evidence={**f.evidence, "stacks": stacks}, summary=f.summary + "; stack dump attached")
        out.append(f)
    return out


class LiveDiagnosis:
    """The collector's diagnosis loop: active runs every ``interval_s``, incidents written as they change.

    ``request_stack(run_id, rank, reason)`` asks a rank's agent for a stack dump (the hang root's).
    ``stored(run_id)``, when given, counts the batches of the run stored so far and the
    registrations among them (the collector's writer keeps them). A pass costs tens of queries,
    and it shares the machine with training where the collector runs beside it, so a run is
    passed over while nothing of it was stored since its last pass, until ``recheck_s`` (what
    only time reveals, such as ranks gone silent all at once, and what other collectors of the
    same store wrote); its topology is read again after a rank registered, or ``recheck_s``.
    A pass longer than ``interval_s`` (a run of 100,000 ranks) is followed by a rest as long as
    itself: the passes hold the interpreter half the time at most, and ingest keeps up.
    ``on_pass(seconds)`` hears how long each pass took, ``on_detector(name, seconds)`` each detector
    of it (the collector's metrics).
    """

    def __init__(
        self,
        query: Query,
        write: Callable[[list[Incident]], None],
        request_stack: Callable[[str, int, str], None],
        settings: Settings,
        *,
        interval_s: float = DIAGNOSE_EVERY_S,
        webhook: str | None = None,
        stored: Callable[[str], tuple[int, int]] | None = None,
        heard: LastHeard | None = None,
        on_pass: Callable[[float], None] | None = None,
        on_detector: Callable[[str, float], None] | None = None,
    ) -> None:
        self.query = query
        self.write = write
        self.request_stack = request_stack
        self.settings = settings
        self.interval_s = interval_s
        self.webhook = webhook
        self.stored = stored
        self.heard = heard
        self.on_pass = on_pass
        self.on_detector = on_detector
        self.recheck_s = max(interval_s, settings.silent_after_s / 3)
        self.ledgers: dict[str, Ledger] = {}
        self._passed: dict[str, tuple[tuple[int, int], float]] = {}  # run -> stored() and time.monotonic() at its last pass
        self._contexts: dict[str, tuple[int, float, RunContext]] = {}  # run -> registrations stored, time read, topology
        self._seen: dict[tuple[str, int], dict[str, Any]] = {}  # (run, attempt) -> what passes keep of it (RunContext.seen)
        self._asked: set[tuple[str, int]] = set()
        self._ended: dict[str, float] = {}  # run -> time.monotonic() when first seen ended
        self._warned: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                await asyncio.to_thread(self.pass_once)
            except Exception as e:  # diagnosis must never take the collector down
                self._warn_once("pass", f"rankscope diagnosis: a pass failed: {e}")
            took = time.monotonic() - started
            if self.on_pass is not None:
                self.on_pass(took)
            if took > self.interval_s:
                self._warn_once("slow", f"rankscope diagnosis: a pass took {took:.1f} s, more than the {self.interval_s:g} s between "
                                "passes; faults are named later (rankscope_diagnosis_pass_seconds on --metrics-port tracks it)")  # fmt: skip
            delay = max(0.1, self.interval_s - took, took)  # a long pass is followed by as long a rest: ingest gets its turn
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass

    def pass_once(self) -> list[Incident]:
        """Diagnose every active run once; returns the incidents written."""
        written: list[Incident] = []
        recent_s = int(max(60, 3 * self.settings.silent_after_s))
        active = self.query(ACTIVE_RUNS_SQL, {"recent_s": recent_s}).to_pylist()
        # An ended run stays in the recent window for a minute: its final passes go on only while
        # rows written just before its end may still arrive (a run that starts again under its id
        # says "running" and is diagnosed again).
        now = time.monotonic()
        ended = {run["run_id"] for run in active if run["status"] in ("finished", "failed")}
        self._ended = {run: self._ended.get(run, now) for run in ended}
        for run in active:
            run_id = run["run_id"]
            if now - self._ended.get(run_id, now) <= CONCLUDE_AFTER_S and self._due(run_id, now):
                written += self._run(run_id, final=run_id in ended, now=now)
        for gone in set(self._passed) - {run["run_id"] for run in active}:
            self._passed.pop(gone)
            self._contexts.pop(gone, None)
            self._seen = {key: kept for key, kept in self._seen.items() if key[0] != gone}
        return written

    def _due(self, run_id: str, now: float) -> bool:
        """Whether ``run_id`` gets a pass now: new rows of it were stored, or ``recheck_s`` passed."""
        if self.stored is None:
            return True
        stored = self.stored(run_id)
        last = self._passed.get(run_id)
        if last is not None and last[0] == stored and now - last[1] < self.recheck_s:
            return False
        self._passed[run_id] = (stored, now)
        return True

    def _context(self, run_id: str, now: float) -> RunContext:
        """The run's topology, read again when a rank registered since, or after ``recheck_s``."""
        if self.stored is None:
            return RunContext.load(run_id, self.query, self.settings, self._seen)
        registrations = self.stored(run_id)[1]
        cached = self._contexts.get(run_id)
        if cached is None or cached[0] != registrations or now - cached[1] >= self.recheck_s:
            cached = self._contexts[run_id] = (registrations, now, RunContext.load(run_id, self.query, self.settings, self._seen))
        return cached[2]

    def _run(self, run_id: str, final: bool, now: float) -> list[Incident]:
        ledger = self.ledgers.get(run_id)
        if ledger is None:
            ledger = self.ledgers[run_id] = Ledger(run_id, from_rows(self.query(INCIDENTS_SQL, {"run": run_id}).to_pylist()))
        ctx = self._context(run_id, now)
        heard = self.heard.of(run_id, ctx.attempt) if self.heard is not None else None
        findings = diagnose(run_id, self.query, self.settings, now_ns=time.time_ns(), ctx=ctx, heard=heard, on_detector=self.on_detector)
        for f in findings:
            if f.kind == "hang":
                for rank in f.ranks:
                    if (run_id, rank) not in self._asked:
                        self._asked.add((run_id, rank))
                        self.request_stack(run_id, rank, "hang root")
        changed, new = ledger.update(findings, final=final)
        if changed:
            self.write(changed)
        for incident in new:
            log.warning("incident: %s", incident.finding.summary)
            self._alert(incident)
        if final:
            self.ledgers.pop(run_id, None)
            if self.heard is not None:
                self.heard.forget(run_id)
            self._asked = {(run, rank) for run, rank in self._asked if run != run_id}
        return changed

    def _alert(self, incident: Incident) -> None:
        if not self.webhook:
            return
        body = json.dumps(incident.as_json(), default=str).encode()
        request = urllib.request.Request(self.webhook, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5):
                pass
        except OSError as e:
            self._warn_once("webhook", f"rankscope diagnosis: alert webhook {self.webhook} failed: {e}")

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)


def write_to(insert: Callable[[str, object], None]) -> Callable[[list[Incident]], None]:
    """Incident writer over a store's ``insert_arrow``."""
    return lambda incidents: insert("incidents", to_arrow(incidents))
