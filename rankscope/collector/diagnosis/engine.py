"""Runs the registered detectors over a run and turns their findings into incidents.

``diagnose`` is one pass over one run through any ``query`` function: the collector calls it
live every few seconds for the runs that are active, ``rankscope diagnose`` once, offline. It
names no detector: the registry (``rankscope.collector.diagnosis.registry``) says which run and
in which order, each detector what it needs of the pass (``rankscope.collector.diagnosis.detector``).

Live, the detectors run in two lanes, each on its own schedule (``Lane``) and in a process of its
own (``lane_process``): hangs and crashes stop a job and are cheap to look for; stragglers, NaNs,
slow links and GPU faults can take seconds a pass at scale (a straggler's critical-path cost at
100,000 ranks) and must hold up neither them nor the collector's ingest.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from rankscope.collector.diagnosis.context import Query, RunContext
from rankscope.collector.diagnosis.detector import Detector, Scan
from rankscope.collector.diagnosis.ledger import Ledger, to_arrow
from rankscope.collector.diagnosis.registry import EVERY, THOROUGH, URGENT, Lane
from rankscope.collector.liveness import LastHeard
from rankscope.common.incidents import INCIDENTS_SQL, Finding, Incident, from_rows
from rankscope.common.settings import Settings

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
    heard: Mapping[int, int] | None = None, on_detector: Callable[[str, float], None] | None = None, lane: Lane = EVERY,
) -> list[Finding]:  # fmt: skip
    """The findings of ``lane``'s detectors (every one by default) for ``run_id``; ``now_ns`` defaults
    to when the live diagnosis last looked at the run (offline: ``offline_now``), ``ctx`` to the run's topology read now; ``heard``: rank -> when
    the collector last heard from it (live: its own clock, ahead of what it has stored when it lags);
    ``on_detector(name, seconds)`` hears how long each detector took."""
    ctx = ctx or RunContext.load(run_id, query, settings)

    @functools.cache
    def now() -> int:  # offline, a query made only when a detector asks
        return now_ns if now_ns is not None else offline_now(ctx)

    timed = _Timed(on_detector)
    findings: list[Finding] = []
    for detector in lane.detectors:
        heeded = tuple(f for f in findings if f.kind in detector.heeds)
        findings += timed(detector, Scan(ctx, heard, heeded, now))
    return findings


def listening_s(settings: Settings) -> float:
    """How long the live diagnosis goes on passing a run after its newest heartbeat (``ACTIVE_RUNS_SQL``)."""
    return max(60.0, 3 * settings.silent_after_s)


def offline_now(ctx: RunContext) -> int:
    """The pass's now offline: when the live diagnosis last looked at the run. While the run is heard from
    that is the clock; after it, its last data plus ``listening_s``. Not the last data itself: a rank
    killed without a last word is silent from its last heartbeat on, and its peers' last words come
    seconds later, long before its silence counts; the live passes went on and saw it (0: no data)."""
    last = int(ctx.query(LAST_DATA_SQL, {"run": ctx.run_id}).to_pylist()[0]["ns"] or 0)
    return last and min(time.time_ns(), last + int(listening_s(ctx.settings) * 1e9))


class _Timed:
    """Runs a detector, its stack dumps attached, and tells ``on_detector`` how long that took (nothing
    when there is no listener)."""

    def __init__(self, on_detector: Callable[[str, float], None] | None):
        self.on_detector = on_detector

    def __call__(self, detector: Detector, scan: Scan) -> list[Finding]:
        began = time.perf_counter()
        try:
            found = detector.detect(scan)
            return _with_stacks(scan.ctx, found) if detector.stack_dumps else found
        finally:
            if self.on_detector is not None:
                self.on_detector(detector.name, time.perf_counter() - began)


def _with_stacks(ctx: RunContext, findings: list[Finding]) -> list[Finding]:
    """Attach the newest stack dump of each rank of a finding taken since it began (asked for live)."""
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

    ``request_stack(run_id, rank, reason)`` asks a rank's agent for a stack dump (the ranks named by a
    detector that wants them: ``Detector.stack_dumps``, the hang's root).
    ``stored(run_id)``, when given, counts the batches of the run stored so far and the
    registrations among them (the collector's writer keeps them). A pass costs tens of queries,
    and it shares the machine with training where the collector runs beside it, so a run is
    passed over while nothing of it was stored since its last pass, until ``recheck_s`` (what
    only time reveals, such as ranks gone silent all at once, and what other collectors of the
    same store wrote); its topology is read again after a rank registered, or ``recheck_s``.
    ``run`` passes each ``Lane`` (``URGENT``, ``THOROUGH``) on its own schedule, every ``interval_s``
    or as soon as the last pass ended; the collector runs each lane in a process of its own
    (``lane_process``), so a long straggler pass holds up neither ingest nor the hang's pass. ``on_pass(lane, seconds)`` hears how
    long each pass took, ``on_detector(name, seconds)`` each detector of it (the collector's metrics).
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
        on_pass: Callable[[str, float], None] | None = None,
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
        self._lock = threading.Lock()  # the lanes' threads share the ledgers and topologies
        self._loading: dict[str, threading.Lock] = {}  # run -> held while its topology is read (by one lane)
        self._passed: dict[tuple[str, str], tuple[tuple[int, int], float]] = {}  # (lane, run) -> stored() and time at its last pass
        self._contexts: dict[str, tuple[int, float, RunContext]] = {}  # run -> registrations stored, time read, topology
        self._seen: dict[tuple[str, int], dict[str, Any]] = {}  # (run, attempt) -> what passes keep of it (RunContext.seen)
        self._asked: set[tuple[str, int]] = set()
        self._ended: dict[str, float] = {}  # run -> time.monotonic() when first seen ended
        self._warned: set[str] = set()

    async def run(self, stop: asyncio.Event, lanes: tuple[Lane, ...] = (URGENT, THOROUGH)) -> None:
        """Pass ``lanes`` (both by default; the collector runs each in a process of its own:
        ``lane_process``) until ``stop``, each on its own schedule."""
        await asyncio.gather(*(self._lane(lane, stop) for lane in lanes))

    async def _lane(self, lane: Lane, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                await asyncio.to_thread(self.pass_once, lane)
            except Exception as e:  # diagnosis must never take the collector down
                self._warn_once("pass", f"rankscope diagnosis: a pass failed: {e}")
            took = time.monotonic() - started
            if self.on_pass is not None:
                self.on_pass(lane.name, took)
            if took > self.interval_s:
                self._warn_once(f"slow {lane.name}", f"rankscope diagnosis: a pass of the {lane.name} lane ({', '.join(lane.names)}) took "
                                f"{took:.1f} s, more than the {self.interval_s:g} s between passes; what it looks for is named later "
                                "(rankscope_diagnosis_pass_seconds on --metrics-port tracks it)")  # fmt: skip
            delay = max(0.1, self.interval_s - took)  # in a process of its own (``lane_process``): ingest never waits for it
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass

    def pass_once(self, lane: Lane = EVERY) -> list[Incident]:
        """Diagnose every active run once with ``lane``'s detectors; returns the incidents written."""
        written: list[Incident] = []
        recent_s = int(listening_s(self.settings))
        active = self.query(ACTIVE_RUNS_SQL, {"recent_s": recent_s}).to_pylist()
        # An ended run stays in the recent window for a minute: its final passes go on only while
        # rows written just before its end may still arrive (a run that starts again under its id
        # says "running" and is diagnosed again).
        now = time.monotonic()
        ended = {run["run_id"] for run in active if run["status"] in ("finished", "failed")}
        with self._lock:
            self._ended = {run: self._ended.get(run, now) for run in ended}
            ended_at = dict(self._ended)
        for run in active:
            run_id = run["run_id"]
            if now - ended_at.get(run_id, now) <= CONCLUDE_AFTER_S and self._due(lane, run_id, now):
                written += self._run(lane, run_id, final=run_id in ended, now=now)
        self._forget({run["run_id"] for run in active})
        return written

    def _forget(self, active: set[str]) -> None:
        """What was kept of the runs no longer active: an ended run is gone a minute after its end."""
        with self._lock:
            kept = {run for _, run in self._passed} | {run for run, _ in self._seen} | set(self._contexts) | set(self.ledgers)
            for gone in kept - active:
                self._passed = {key: kept for key, kept in self._passed.items() if key[1] != gone}
                self._contexts.pop(gone, None)
                self._loading.pop(gone, None)
                self._seen = {key: kept for key, kept in self._seen.items() if key[0] != gone}
                self.ledgers.pop(gone, None)
                self._asked = {(run, rank) for run, rank in self._asked if run != gone}
                if self.heard is not None:
                    self.heard.forget(gone)

    def _due(self, lane: Lane, run_id: str, now: float) -> bool:
        """Whether ``run_id`` gets a pass of ``lane`` now: new rows of it were stored, or ``recheck_s`` passed."""
        if self.stored is None:
            return True
        stored = self.stored(run_id)
        with self._lock:
            last = self._passed.get((lane.name, run_id))
            if last is not None and last[0] == stored and now - last[1] < self.recheck_s:
                return False
            self._passed[(lane.name, run_id)] = (stored, now)
        return True

    def _context(self, run_id: str, now: float) -> RunContext:
        """The run's topology, read again when a rank registered since, or after ``recheck_s``; read by
        one lane while the other waits for it (at 100,000 ranks it is seconds)."""
        if self.stored is None:
            return RunContext.load(run_id, self.query, self.settings, self._seen)
        registrations = self.stored(run_id)[1]
        with self._lock:
            loading = self._loading.setdefault(run_id, threading.Lock())
        with loading:
            cached = self._contexts.get(run_id)
            if cached is None or cached[0] != registrations or now - cached[1] >= self.recheck_s:
                cached = self._contexts[run_id] = (registrations, now, RunContext.load(run_id, self.query, self.settings, self._seen))
        return cached[2]

    def _run(self, lane: Lane, run_id: str, final: bool, now: float) -> list[Incident]:
        ctx = self._context(run_id, now)
        heard = self.heard.of(run_id, ctx.attempt, ctx.host) if self.heard is not None else None
        findings = diagnose(run_id, self.query, self.settings, now_ns=time.time_ns(), ctx=ctx, heard=heard, on_detector=self.on_detector, lane=lane)
        why = {kind: d.stack_dumps for d in lane.detectors if d.stack_dumps for kind in d.kinds}
        named = {(run_id, rank): why[f.kind] for f in findings if f.kind in why for rank in f.ranks}
        with self._lock:
            ask = {key: reason for key, reason in named.items() if key not in self._asked}
            self._asked |= set(ask)
        for (_, rank), reason in sorted(ask.items()):
            self.request_stack(run_id, rank, reason)
        with self._lock:  # one lane at a time folds its findings in and stores what changed
            ledger = self.ledgers.get(run_id)
            if ledger is None:
                ledger = self.ledgers[run_id] = Ledger(run_id, from_rows(self.query(INCIDENTS_SQL, {"run": run_id}).to_pylist()))
            changed, new = ledger.update(findings, final=final, owns=lane.owns)
            if changed:
                self.write(changed)
        for incident in new:
            log.warning("incident: %s", incident.finding.summary)
            self._alert(incident)
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
