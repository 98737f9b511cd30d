"""The self-healing loop: watch a running job's incidents and act on them, with no person involved.

Every poll the driver reads the run's incidents through the collector and asks the policy about
each new one: evict its hosts at once (a lost host), self-check them against the other hosts
first (crash, hang root, straggler; the workers are paused while a straggler's hosts are
measured, so that training does not share the CPU with the check), or leave it. A host that fails
is fenced (``Fleet.fence``); the survivors' connections to it break, their workers fail, and
torchrun's elastic agents restart them without it, from the last complete checkpoint (the
trainer re-plans its data-parallel size). The driver then watches the run's attempts: a new
attempt is a restart, its first step is the resumption, and the steps the previous attempt ran
past its checkpoint are lost work. Everything decided and done is a row of ``actions``, with the
self-check figures in ``selfchecks``: the run's history stays one run, its restarts attempts of it.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from rankscope.collector.client import Client, QueryFailed
from rankscope.common.incidents import INCIDENTS_SQL
from rankscope.healing import node_life, record
from rankscope.healing.fleet import Fleet, Worker
from rankscope.healing.node_life import CHECKING, DRAINED, HEALTHY, SUSPECT
from rankscope.healing.policy import Policy, Verdict
from rankscope.healing.selfcheck import check_hosts
from rankscope.protos.v1 import ingest_pb2

CURRENT_STEP_SQL = (
    "SELECT max(step) AS step FROM heartbeats WHERE run_id = {run:String} "
    "AND attempt = (SELECT max(attempt) FROM ranks WHERE run_id = {run:String})"
)
ATTEMPTS_SQL = (
    "SELECT attempt, groupUniqArray(host) AS hosts, count() AS ranks, toUnixTimestamp64Nano(min(newest)) AS registered_ns "
    "FROM (SELECT rank, attempt, argMax(host, registered) AS host, max(registered) AS newest FROM ranks "
    "WHERE run_id = {run:String} GROUP BY rank, attempt) GROUP BY attempt ORDER BY attempt"
)
#: each attempt's completed steps (step_time_s is reported when a step ends)
STEPS_SQL = (
    "SELECT attempt, min(step) AS first_step, max(step) AS last_step, toUnixTimestamp64Nano(argMin(time, step)) AS first_step_ns "
    "FROM (SELECT attempt, step, min(time) AS time FROM step_metrics WHERE run_id = {run:String} AND name = 'step_time_s' "
    "GROUP BY attempt, step) GROUP BY attempt ORDER BY attempt"
)
#: every step once (the last attempt that completed it), with the median step time of its ranks
PRODUCTIVE_SQL = (
    "SELECT count() AS steps, sum(seconds) AS seconds FROM (SELECT step, argMax(seconds, attempt) AS seconds FROM "
    "(SELECT attempt, step, median(value) AS seconds FROM step_metrics WHERE run_id = {run:String} AND name = 'step_time_s' "
    "GROUP BY attempt, step) GROUP BY step)"
)

#: when the run was first launched: a requeued job's driver is a new process of the same run
FIRST_LAUNCH_SQL = (
    "SELECT toUnixTimestamp64Nano(min(time)) AS ns FROM actions WHERE run_id = {run:String} AND action = 'launched'"
)

#: incidents a pause of the workers causes by itself: they go silent and stop advancing
PAUSE_SILENCES = ("lost_rank", "lost_host", "hang")
#: a silence that began this long before a pause began may be the pause's (the last heartbeat before it)
PAUSE_MARGIN_NS = 5_000_000_000
#: how long after a pause its silences have to end (heartbeats back, a diagnosis pass) before they count
PAUSE_SETTLE_NS = 8_000_000_000
#: who the driver's rows of ``node_states`` say decided
ACTOR = "rankscope launch"


class Job(Protocol):
    """The running job: whether its launchers have all ended, and how."""

    def finished(self, but: Collection[str] = ()) -> bool: ...

    def exited(self) -> dict[str, int]: ...

    def wait(self, timeout_s: float) -> dict[str, int]: ...

    def stop(self, grace_s: float = 5.0, hosts: Collection[str] | None = None) -> None: ...


@dataclass
class Driver:
    """Acts on the incidents of run ``run_id`` until ``job`` ends; ``run`` returns the hosts' exit codes."""

    run_id: str
    client: Client
    fleet: Fleet
    policy: Policy
    job: Job
    ranks_per_host: int = 1
    poll_s: float = 1.0
    #: the most a self-check's test may take on one host (a frozen host answers never)
    check_timeout_s: float = 20.0
    #: how long the survivors may take to restart by themselves after a fence before their workers are killed
    restart_grace_s: float = 10.0
    log: Callable[[str], None] = print
    #: hosts that wait outside the job (``join`` starts a host's launcher): in its rendezvous once an attempt of
    #: this launch registered, or on an eviction before that
    spares: list[str] = field(default_factory=list)
    join: Callable[[str], None] | None = None
    #: when this launch started the job's launchers: an attempt registered since is this launch's
    launched_ns: int = field(default_factory=time.time_ns)
    #: hands the whole job back to its scheduler to place anew (the policy's ``requeue``): this
    #: allocation ends, and the job comes back as the next attempt of the same run
    requeue: Callable[[], None] | None = None
    requeued: bool = False
    evicted: list[str] = field(default_factory=list)
    #: incident id -> the kind it had and the verdict on it (an incident may change kind: a lost
    #: rank whose host-mates fall silent too becomes a lost host, and is considered again)
    _decided: dict[str, tuple[str, Verdict]] = field(default_factory=dict)
    _opened_at_step: dict[str, int] = field(default_factory=dict)
    _attempts: dict[int, dict[str, Any]] = field(default_factory=dict)
    _resumed: set[int] = field(default_factory=set)
    #: when the last fence was, and the survivors' workers then
    _fenced: tuple[float, set[Worker]] | None = None
    _started_ns: int = field(default_factory=time.time_ns)
    _active: list[str] = field(default_factory=list)
    _outbox: list[ingest_pb2.Batch] = field(default_factory=list)
    _warned: set[type] = field(default_factory=set)
    #: (start, end) ns of each time the workers were paused for a self-check
    _pauses: list[tuple[int, int]] = field(default_factory=list)
    #: when this driver started: an incident first seen before was the previous launch's to act on
    _since_ns: int = field(default_factory=time.time_ns)
    #: the hosts this driver drained, and when it last looked at each (a re-check brings them back)
    _drained: dict[str, float] = field(default_factory=dict)
    #: the spares whose launcher runs: they wait in the job's rendezvous (``_warm_spares``)
    _hot: set[str] = field(default_factory=set)
    #: the spares whose launcher failed while they waited: started again only to take an evicted host's place
    _failed_spares: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._active = [h for h in self.fleet.hosts() if h not in self.spares]

    def run(self) -> dict[str, int]:
        self._safely(self._first_launch)
        self._act("launched", self._active, reason=f"{len(self._active)} hosts, {len(self.spares)} spares",
                  evidence={"spares": self.spares, "policy": vars(self.policy)})  # fmt: skip
        while True:
            while not self.job.finished(but=self._waiting()):
                self._safely(self.poll)
                if self.requeued:  # the scheduler ends this allocation: the run goes on in the next one
                    return self.job.exited()
                time.sleep(self.poll_s)
            # a spare that joined while a fence held the loop (seconds under Slurm) is the job's, not one it did not need
            self._safely(lambda: self._seat_spares(self._read_attempts()))
            if self.job.finished(but=self._waiting()):
                break
        if unused := self._waiting():  # spares the job never needed: their launchers would wait on a closed rendezvous
            self.job.stop(hosts=unused)
            self.log(f"[rankscope launch] the job did not need {', '.join(unused)}: stopped")
        exits = {host: code for host, code in self.job.wait(0).items() if host not in self.spares}  # a spare's end is not the job's
        self._safely(self.poll)
        self._safely(lambda: self._conclude(exits))
        deadline = time.monotonic() + 30
        while self._outbox and time.monotonic() < deadline:  # the last records, while the collector comes back
            time.sleep(1)
            self._send()
        return exits

    def _first_launch(self) -> None:
        """The run's wall time counts from its first launch (a requeue starts the driver again)."""
        rows = self._query(FIRST_LAUNCH_SQL)
        if rows and rows[0]["ns"]:
            self._started_ns = min(self._started_ns, int(rows[0]["ns"]))

    def _safely(self, work: Callable[[], None]) -> None:
        """Run one poll; a collector that does not answer for a while stops nothing (said once per kind)."""
        try:
            work()
        except QueryFailed as e:
            self._warn(e)

    def _warn(self, e: QueryFailed) -> None:
        if type(e) not in self._warned:
            self._warned.add(type(e))
            self.log(f"[rankscope launch] the collector did not answer ({e}); still watching, what it did not store is kept")

    @property
    def remaining(self) -> list[str]:
        """The hosts in the job now: those it started on, less the evicted, plus the spares that joined."""
        return list(self._active)

    def poll(self) -> None:
        """One look at the run: its attempts, then every incident not yet decided."""
        self._send()
        self._watch_attempts()
        self._drop_departed()
        for incident in self._query(INCIDENTS_SQL):
            decided = self._decided.get(incident["incident_id"])
            if decided is None or decided[1] is Verdict.WAIT or decided[0] != incident["kind"]:
                self._consider(incident)
        self._recheck()
        if self._fenced is not None and time.monotonic() - self._fenced[0] > self.restart_grace_s:
            stale, self._fenced = self._fenced[1] & self.fleet.workers(self.remaining), None
            killed = self.fleet.signal(stale, signal.SIGKILL) if stale else 0
            if killed:  # the survivors' workers of before the fence had not failed by themselves: now they have
                self._act("restart", self.remaining, reason=f"{killed} workers of the survivors still ran {self.restart_grace_s:.0f} s "
                          "after the fence: killed, so that torchrun restarts them")  # fmt: skip

    # --- incidents ---------------------------------------------------------------------------

    def _consider(self, incident: dict[str, Any]) -> None:
        key = incident["incident_id"]
        if self._paused_silence(incident) or self._stale(incident):
            return
        step = self._current_step()
        opened = self._opened_at_step.setdefault(key, min(step, _slow_since(incident, step)))
        verdict, suspects, why = self.policy.verdict(incident["kind"], list(incident["hosts"]), step - opened, self.remaining,
                                                     len(self.spares) if self.join is not None else 0)  # fmt: skip
        first = self._decided.get(key, ("", verdict))[0] != incident["kind"]
        self._decided[key] = (incident["kind"], verdict)
        if verdict is Verdict.WAIT and not first:
            return
        self._act("incident", suspects or list(incident["hosts"]), key, f"{verdict.value}: {why}",
                  {"kind": incident["kind"], "summary": incident["summary"], "verdict": verdict.value})  # fmt: skip
        self.log(f"[rankscope launch] {incident['kind']}: {incident['summary']} -> {verdict.value} ({why})")
        if first and verdict is not Verdict.IGNORE:
            for host in suspects:
                self._node(host, SUSPECT, key, f"{incident['kind']}: {incident['summary']}")
        if verdict in (Verdict.EVICT, Verdict.REQUEUE):
            self._evict(suspects, key, why, _reason(incident))
        elif verdict is Verdict.CHECK:
            self._check(incident, suspects)

    def _paused_silence(self, incident: dict[str, Any]) -> bool:
        """Whether ``incident`` is a silence that began while the driver paused the workers: undecided
        until the pause has settled, then ignored if it ended (the pause's doing), considered if not."""
        if not self._pauses or incident["kind"] not in PAUSE_SILENCES:
            return False
        began = int(incident["first_seen_ns"])
        pause = next(((start, end) for start, end in self._pauses if start - PAUSE_MARGIN_NS <= began <= end), None)
        if pause is None:
            return False
        if time.time_ns() < pause[1] + PAUSE_SETTLE_NS:
            return True  # asked again at the next poll
        if incident["status"] == "open":
            return False  # still silent after the workers went on: a real one
        self._decided[incident["incident_id"]] = (incident["kind"], Verdict.IGNORE)
        self._act("incident", list(incident["hosts"]), incident["incident_id"],
                  "ignore: the ranks were silent while the driver paused the workers for a self-check, and are heard again",
                  {"kind": incident["kind"], "summary": incident["summary"], "verdict": Verdict.IGNORE.value})  # fmt: skip
        return True

    def _stale(self, incident: dict[str, Any]) -> bool:
        """Whether ``incident`` was first seen before this driver started: a requeued job's driver finds
        the previous allocation's incidents, decided and acted on there; it records them and leaves them."""
        if int(incident.get("first_seen_ns") or self._since_ns) >= self._since_ns:
            return False
        self._decided[incident["incident_id"]] = (incident["kind"], Verdict.IGNORE)
        self._act("incident", list(incident["hosts"]), incident["incident_id"], "ignore: raised before this launch of the run, "
                  "and decided by the driver of its time", {"kind": incident["kind"], "summary": incident["summary"], "verdict": Verdict.IGNORE.value})  # fmt: skip
        return True

    def _check(self, incident: dict[str, Any], suspects: list[str]) -> None:
        """Self-check every remaining host (the suspects judged against the others); evict the suspects that fail."""
        key = incident["incident_id"]
        for host in suspects:
            self._node(host, CHECKING, key, f"self-check against {len(self.remaining) - 1} other hosts")
        # A straggler's hosts compute slowly: measure them without the job's load.
        paused = self.fleet.workers(self.remaining) if incident["kind"] == "straggler" else set()
        self.fleet.signal(paused, signal.SIGSTOP)
        paused_at = time.time_ns()
        try:
            try:
                report = check_hosts(self.remaining, self.fleet.runner, ranks=self.ranks_per_host, timeout_s=self.check_timeout_s)
            except Exception as e:  # a check that cannot run at all decides nothing
                self._act("selfcheck", suspects, key, f"the self-check could not run: {e}")
                for host in suspects:
                    self._node(host, SUSPECT, key, f"the self-check could not run: {e}")
                return
            self._outbox += [result.batch(self.run_id) for result in report.hosts]
            self._act("selfcheck", suspects, key, "; ".join(f"{h.host}: {h.summary}" for h in report.hosts),
                      {"passed": {h.host: h.passed for h in report.hosts}})  # fmt: skip
            failed = [h for h in suspects if h in report.failed]
            if failed:
                self._evict(failed, key, "; ".join(report.host(h).summary for h in failed), _reason(incident))
            for host in suspects:
                if host not in failed:
                    self._node(host, HEALTHY, key, f"passed its self-check: {report.host(host).summary}")
            if not failed:
                self._act("kept", suspects, key, "the suspects passed their self-check: they stay in the job")
        finally:
            self.fleet.signal(paused, signal.SIGCONT)  # whatever happened, no worker stays stopped
            if paused:
                self._pauses.append((paused_at, time.time_ns()))

    def _evict(self, hosts: list[str], incident_id: str, why: str, reason: str = "", *, restarted: bool = False) -> None:
        """Fence ``hosts`` (``reason``: what the cluster is told, by default ``why``) and put spares in
        their place; unless the survivors ``restarted`` already, their workers of now are killed if
        they still run ``restart_grace_s`` later. Too few hosts left, and the policy requeues: the
        hosts are fenced and the job handed back to its scheduler."""
        spares = len(self.spares) if self.join is not None else 0
        requeue = self.requeue is not None and self.policy.requeue and self.policy.short(len(self._active), len(hosts), spares)
        for host in hosts:
            told = reason or f"rankscope: {why}"
            self.evicted.append(host)
            self._active.remove(host)
            self._hot.discard(host)  # its launcher is fenced with it: a spare again (a re-check) starts it anew
            # stored before the fence: the crash detector leaves the ranks it kills to this incident, even
            # when the survivors restart before the fence returns
            self._act("evict", [host], incident_id, why, {"remaining": self.remaining})
            done = self.fleet.fence(host, told)
            self._drained[host] = time.monotonic()
            self._node(host, DRAINED, incident_id, told)
            self._act("fenced", [host], incident_id, done)
            beside = f" and {', '.join(waiting)}, waiting in its rendezvous" if (waiting := self._waiting()) else ""
            goes = "goes back to its scheduler" if requeue else f"goes on with {', '.join(self.remaining)}{beside}"
            self.log(f"[rankscope launch] evicted {host} ({why}); the job {goes}")
        if requeue:
            self._act("requeue", self.remaining, incident_id, f"{len(self.remaining)} hosts left, fewer than {self.policy.min_hosts}: "
                      "the job goes back to its scheduler, to resume on healthy hosts from its last checkpoint")  # fmt: skip
            self.log(f"[rankscope launch] requeued: {len(self.remaining)} hosts left, fewer than {self.policy.min_hosts}")
            self.requeue()  # type: ignore[misc]
            self.requeued = True
            return
        if not (restarted or self._went_on_without(hosts)):
            self._fenced = (time.monotonic(), self.fleet.workers(self.remaining))
        waiting = self._waiting()  # each takes a place in the survivors' next round by itself (``_seat_spares``)
        for host in hosts[len(waiting):]:
            cold = [s for s in self.spares if s not in self._hot]
            if not cold or self.join is None:
                break
            self.spares.remove(cold[0])
            self.join(cold[0])
            self._failed_spares.discard(cold[0])
            self._active.append(cold[0])
            self._act("spare", [cold[0]], incident_id, f"{cold[0]} joins the job in place of {host}")
            self.log(f"[rankscope launch] {cold[0]} joins the job in place of {host}")

    def _went_on_without(self, hosts: list[str]) -> bool:
        """Whether the survivors restarted by themselves before ``hosts`` were fenced: the newest attempt
        is a restart that none of them joined. Its workers are not the ones to kill: a snapshot of them
        at the fence, killed ``restart_grace_s`` later, cost a restart (a Slurm drill's small model
        restarted on node1's loss before the lost host was raised, session 36)."""
        if not self._attempts:
            return False
        newest = self._attempts[max(self._attempts)]
        return int(newest["attempt"]) > 0 and not set(hosts) & set(newest["hosts"])

    def _recheck(self) -> None:
        """Self-check again each host drained at least ``policy.recheck_s`` ago; one that passes (judged
        against its healthy peers' stored figures) takes jobs again and waits as a spare. A host drained
        too often lately stays drained for a person (``node_life.held``)."""
        if not self.policy.recheck_s:
            return
        due = [h for h, at in self._drained.items() if time.monotonic() - at >= self.policy.recheck_s]
        if not due:
            return
        states = {row["host"]: row for row in node_life.nodes(self.client)}
        for host in due:
            self._drained[host] = time.monotonic()
            if host in states and node_life.held(states[host]):
                del self._drained[host]
                self._act("recheck", [host], reason=f"drained {states[host]['drains']} times within {node_life.HOLD_WINDOW_S // 60} minutes: "
                          "it stays drained until a person resumes it (rankscope node resume)")  # fmt: skip
                continue
            try:
                result = node_life.recheck(host, self.fleet.runner, node_life.reference(self.client, host), ranks=self.ranks_per_host,
                                           timeout_s=self.check_timeout_s)  # fmt: skip
            except Exception as e:  # a check that cannot run decides nothing: the host stays drained
                self._act("recheck", [host], reason=f"the self-check could not run: {e}")
                continue
            self._outbox.append(result.batch(self.run_id))
            if not result.passed:
                self._act("recheck", [host], reason=f"still fails its self-check: {result.summary}")
                continue
            del self._drained[host]
            done = self.fleet.release(host)
            self.spares.append(host)
            self._node(host, HEALTHY, reason=f"passed its self-check again: {result.summary}")
            self._act("recheck", [host], reason=f"passed its self-check again ({result.summary}): {done}; it waits as a spare",
                      evidence={"spares": self.spares})  # fmt: skip
            self.log(f"[rankscope launch] {host} passed its self-check again: a spare now")

    def _node(self, host: str, state: str, incident_id: str = "", reason: str = "") -> None:
        """Store that ``host`` is now ``state`` (``node_states``), with the actions."""
        self._outbox.append(record.node_state_batch(self.run_id, host, state, actor=ACTOR, incident_id=incident_id, reason=reason))
        self._send()

    # --- attempts ----------------------------------------------------------------------------

    def _watch_attempts(self) -> None:
        self._seat_spares(self._read_attempts())
        self._warm_spares()

    def _read_attempts(self) -> dict[int, dict[str, Any]]:
        """The run's attempts as stored (each restart recorded once, and how it resumed); returns each
        attempt's steps."""
        steps = {r["attempt"]: r for r in self._query(STEPS_SQL)}
        for row in self._query(ATTEMPTS_SQL):
            attempt = row["attempt"]
            if attempt > 0 and attempt not in self._attempts:
                self._fenced = None  # the survivors restarted
            self._attempts[attempt] = row
            if attempt > 0 and attempt in steps and attempt not in self._resumed:
                self._resumed.add(attempt)  # every rank of it registered before its first step ended
                self._act("restart", sorted(row["hosts"]), reason=f"attempt {attempt}: {row['ranks']} ranks on {', '.join(sorted(row['hosts']))}",
                          evidence={"world_size": row["ranks"]}, attempt=attempt, time_ns=row["registered_ns"])  # fmt: skip
                self._resume(attempt, steps)
        return steps

    def _waiting(self) -> list[str]:
        """The spares whose launcher runs, not in the job yet."""
        return [s for s in self.spares if s in self._hot]

    def _warm_spares(self) -> None:
        """Start each spare's launcher once an attempt of this launch has registered (its rendezvous round
        complete): it waits in the rendezvous (torchrun's redundancy list) and takes a place in the first
        round with a place free. The survivors' own restart after a host is lost takes it in, where a spare
        started once the host was named made them restart a second time (the Slurm drill's first step after the
        restart came 60.7 s after the fault, 31.9 s with the spare waiting). Started before the first round
        completed, a spare could take the place of a host the job starts on."""
        if self.join is None or not any(a["registered_ns"] >= self.launched_ns for a in self._attempts.values()):
            return
        exited = self.job.exited()
        for spare in [s for s in self._waiting() if exited.get(s, 0) != 0]:  # 0: the job ended and closed its rendezvous
            self._hot.discard(spare)
            self._failed_spares.add(spare)
            self.log(f"[rankscope launch] {spare}'s launcher ended with code {exited[spare]} while it waited; "
                     "it is started again only to take an evicted host's place")
        for spare in [s for s in self.spares if s not in self._hot | self._failed_spares]:
            self.join(spare)
            self._hot.add(spare)
            self.log(f"[rankscope launch] {spare} waits in the job's rendezvous, a spare")

    def _seat_spares(self, steps: dict[int, dict[str, Any]]) -> None:
        """A waiting spare in the newest attempt has joined the job: one of its hosts from now on. Read once
        the attempt completed a step (every rank of it registered: a row read before lacks some hosts)."""
        if not self._attempts or max(self._attempts) not in steps:
            return
        newest = self._attempts[max(self._attempts)]
        before = [self._attempts[a]["hosts"] for a in sorted(self._attempts) if a < newest["attempt"]][-1:]
        gone = sorted(h for hosts in before for h in hosts if h not in newest["hosts"])  # evicted already, or not yet
        for spare in [s for s in self._waiting() if s in newest["hosts"]]:
            self.spares.remove(spare)
            self._active.append(spare)
            said = f"{spare} joined attempt {newest['attempt']} in place of {', '.join(gone) or 'a host'}"
            self._act("spare", [spare], reason=said, attempt=newest["attempt"], time_ns=newest["registered_ns"])
            self.log(f"[rankscope launch] {said}")

    def _drop_departed(self) -> None:
        """Evict the hosts whose launcher ended while the job went on without them in a later attempt.

        torchrun's rendezvous drops a host whose launcher died (all its processes killed) before
        diagnosis may have named it: the job heals itself, and the host is recorded as evicted (and
        fenced, and replaced by a spare) like one the driver evicted."""
        if not self._attempts or max(self._attempts) == 0:
            return
        attempt = max(self._attempts)
        exited = self.job.exited()
        gone = [h for h in self.remaining if h in exited and exited[h] != 0 and h not in self._attempts[attempt]["hosts"]]
        for host in gone:
            self._evict([host], "", f"attempt {attempt} went on without it: its launcher ended with code {exited[host]}", restarted=True)

    def _resume(self, attempt: int, steps: dict[int, dict[str, Any]]) -> None:
        first = steps[attempt]["first_step"]
        lost = _steps_lost(steps, attempt)
        at_ns = steps[attempt]["first_step_ns"]
        evidence = {"resumed_step": first, "checkpoint_step": first - 1, "steps_lost": lost, "seconds_since_launch": (at_ns - self._started_ns) / 1e9}
        self._act("resumed", sorted(self._attempts[attempt]["hosts"]), reason=f"attempt {attempt} completed step {first}: "
                  f"resumed from the checkpoint of step {first - 1}, {lost} steps lost", evidence=evidence, attempt=attempt, time_ns=at_ns)  # fmt: skip
        self.log(f"[rankscope launch] attempt {attempt} resumed at step {first} ({lost} steps lost)")

    def _conclude(self, exits: dict[str, int]) -> None:
        wall_s = (time.time_ns() - self._started_ns) / 1e9
        rows = self._query(PRODUCTIVE_SQL)
        productive_s = float(rows[0]["seconds"] or 0.0) if rows else 0.0
        steps = {r["attempt"]: r for r in self._query(STEPS_SQL)}
        lost = sum(_steps_lost(steps, attempt) for attempt in steps if attempt > 0)
        survivors = {h: c for h, c in exits.items() if h in self._active}
        ok = bool(survivors) and all(c == 0 for c in survivors.values())
        evidence = {
            "exits": exits, "evicted": self.evicted, "attempts": len(self._attempts), "steps_lost": lost,
            "productive_s": round(productive_s, 3), "wall_s": round(wall_s, 3),
            "effective_ratio": round(productive_s / wall_s, 4) if wall_s > 0 else 0.0,
        }  # fmt: skip
        what = "finished" if ok else "gave_up"
        self._act(what, sorted(survivors), reason=f"{'finished' if ok else 'failed'} on {', '.join(sorted(survivors)) or 'no host'}"
                  f" after {len(self._attempts)} attempts; evicted: {', '.join(self.evicted) or 'none'}", evidence=evidence)  # fmt: skip
        self.log(f"[rankscope launch] {what}: {json.dumps(evidence)}")

    # --- plumbing ----------------------------------------------------------------------------

    def _current_step(self) -> int:
        rows = self._query(CURRENT_STEP_SQL)
        return int(rows[0]["step"] or 0) if rows else 0

    def _query(self, sql: str) -> list[dict[str, Any]]:
        return self.client.query(sql, {"run": self.run_id}).to_pylist()

    def _act(
        self, action: str, hosts: list[str] | None = None, incident_id: str = "", reason: str = "",
        evidence: dict[str, Any] | None = None, *, attempt: int | None = None, time_ns: int | None = None,
    ) -> None:  # fmt: skip
        attempt = max(self._attempts, default=0) if attempt is None else attempt
        self._outbox.append(record.action_batch(self.run_id, action, attempt=attempt, hosts=hosts or [], incident_id=incident_id,
                                                reason=reason, evidence=evidence, time_ns=time_ns))  # fmt: skip
        self._send()

    def _send(self) -> None:
        """Store the records not yet stored, in order; what the collector refuses now waits for the next
        poll (a record sent twice is stored once: its batch id stays)."""
        while self._outbox:
            try:
                self.client.send(self._outbox[0])
            except QueryFailed as e:
                self._warn(e)
                return
            self._outbox.pop(0)


def _steps_lost(steps: dict[int, dict[str, Any]], attempt: int) -> int:
    """The completed steps the attempts before ``attempt`` ran past the checkpoint it resumed from."""
    before = [s["last_step"] for a, s in steps.items() if a < attempt]
    return max(0, max(before, default=0) - (steps[attempt]["first_step"] - 1))


def _slow_since(incident: dict[str, Any], default: int) -> int:
    """The step a straggler has been slow since, as its diagnosis says (``since_step``): under load an
    incident may open many slow steps late, and those steps count."""
    try:
        return int(json.loads(incident.get("evidence") or "{}").get("since_step", default))
    except (ValueError, TypeError, AttributeError):
        return default


def _reason(incident: dict[str, Any]) -> str:
    """What a fenced node is marked with where the cluster keeps a reason (a drained Slurm node's)."""
    return f"rankscope: {incident['kind']} {incident['incident_id']}: {incident['summary']}"
