"""Self-healing: the policy's verdicts, and drills on real namespace hosts where a fault from outside
(kill, freeze, throttle) must end with the job finished without the bad host, nobody involved."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from rankscope.common.incidents import INCIDENTS_SQL
from rankscope.healing import driver, node_life, verdict
from rankscope.harness import healing_drills as scenarios
from rankscope.harness import slurm_drills
from rankscope.healing.policy import Policy, Verdict
from rankscope.testbed import hosts, slurm

HOSTS = ["node0", "node1", "node2"]


def test_a_lost_host_is_evicted_unchecked_and_the_others_are_checked_first() -> None:
    policy = Policy(min_hosts=2)
    assert policy.verdict("lost_host", ["node1"], 0, HOSTS)[:2] == (Verdict.EVICT, ["node1"])
    for kind in ("crash", "hang"):
        assert policy.verdict(kind, ["node1"], 0, HOSTS)[:2] == (Verdict.CHECK, ["node1"])


def test_a_straggler_waits_its_steps_and_nothing_shrinks_the_job_below_its_minimum() -> None:
    policy = Policy(min_hosts=2, straggler_steps=3)
    assert policy.verdict("straggler", ["node1"], 2, HOSTS)[0] is Verdict.WAIT
    assert policy.verdict("straggler", ["node1"], 3, HOSTS)[0] is Verdict.CHECK
    verdict, _, why = policy.verdict("hang", ["node1"], 0, ["node0", "node1"])
    assert verdict is Verdict.IGNORE and "fewer than 2 hosts" in why
    assert policy.verdict("crash", ["node1"], 0, ["node0", "node2"])[0] is Verdict.IGNORE  # evicted already
    assert Policy(act_on=("lost_host",)).verdict("straggler", ["node1"], 9, HOSTS)[0] is Verdict.IGNORE


def test_a_policy_refuses_kinds_that_name_no_host() -> None:
    with pytest.raises(ValueError, match="cannot act on nan"):
        Policy(act_on=("nan",))


@dataclass
class Cluster:
    """What the driver sees of a job, set by the test: the store's answers, the launchers' exits, the
    workers; and what it did (the actions it stored, the hosts it fenced, the workers it signalled)."""

    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    exits: dict[str, int] = field(default_factory=dict)
    fenced: list[str] = field(default_factory=list)
    killed: set[tuple[str, int]] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    actions: list[tuple[str, list[str], str]] = field(default_factory=list)
    #: the node_states rows it stored: (host, state, reason)
    states: list[tuple[str, str, str]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    #: where a self-check would run: nowhere here (a check fails to run; tests replace the re-check)
    runner: Any = None

    # the collector's client
    def query(self, sql: str, params: dict[str, object] | None = None) -> pa.Table:
        return pa.Table.from_pylist(self.rows.get(sql, []))

    def send(self, batch: Any) -> bool:
        if batch.WhichOneof("payload") == "node_state":
            self.states.append((batch.node_state.host, batch.node_state.state, batch.node_state.reason))
        elif batch.WhichOneof("payload") == "action":
            self.actions.append((batch.action.action, list(batch.action.hosts), batch.action.reason))
        return True

    # the fleet
    def hosts(self) -> list[str]:
        return [*HOSTS, "node3"]

    def workers(self, hosts: Any) -> set[tuple[str, int]]:
        return {("node0", 101), ("node2", 102)}

    def signal(self, workers: Any, sig: signal.Signals) -> int:
        self.killed |= set(workers)
        return len(set(workers))

    def fence(self, host: str, reason: str) -> str:
        self.fenced.append(host)
        self.reasons.append(reason)
        return f"killed {host}"

    def release(self, host: str) -> str:
        self.released.append(host)
        return f"resumed {host}"

    #: set once the job's launchers (but the waiting spares') have ended
    done: bool = False
    stopped: list[str] = field(default_factory=list)

    # the job
    def finished(self, but: Any = ()) -> bool:
        return self.done

    def exited(self) -> dict[str, int]:
        return dict(self.exits)

    def wait(self, timeout_s: float) -> dict[str, int]:
        return dict(self.exits)

    def stop(self, grace_s: float = 5.0, hosts: Any = None) -> None:
        self.stopped += list(hosts)


def _driver(cluster: Cluster) -> driver.Driver:
    return driver.Driver("run", cluster, cluster, Policy(min_hosts=2), cluster, restart_grace_s=0.0, log=lambda line: None,  # type: ignore[arg-type]
                         spares=["node3"], join=cluster.joined.append)  # fmt: skip


def _attempt(attempt: int, on: list[str]) -> dict[str, Any]:
    return {"attempt": attempt, "hosts": on, "ranks": 2 * len(on), "registered_ns": 0}


def test_a_spare_waits_in_the_rendezvous_from_the_first_attempt_and_joins_the_survivors_restart() -> None:
    """The spare's launcher starts once this launch's first attempt registered (not before: it would take a
    starting host's place), joins the round the survivors restart in without node0 (torchrun's redundancy
    list), and counts as a host of the job from then on: the eviction that follows starts no second one."""
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, HOSTS)]})  # registered before this launch: a requeued run's
    heal = _driver(cluster)
    heal.poll()
    assert cluster.joined == []
    cluster.rows[driver.ATTEMPTS_SQL] = [{**_attempt(0, HOSTS), "registered_ns": time.time_ns()}]
    heal.poll()
    heal.poll()
    assert cluster.joined == ["node3"] and heal.spares == ["node3"] and heal.remaining == HOSTS  # waiting, once
    cluster.rows[driver.ATTEMPTS_SQL].append({**_attempt(1, ["node1", "node3"]), "registered_ns": time.time_ns()})
    heal.poll()
    assert heal.spares == ["node3"]  # attempt 1 still registering: node2's ranks are not in yet
    cluster.rows[driver.ATTEMPTS_SQL][-1]["hosts"] = ["node1", "node2", "node3"]
    cluster.rows[driver.STEPS_SQL] = [{"attempt": 1, "first_step": 5, "last_step": 5, "first_step_ns": time.time_ns()}]
    heal.poll()
    spare = [a for a in cluster.actions if a[0] == "spare"]
    assert spare == [("spare", ["node3"], "node3 joined attempt 1 in place of node0")] and heal.spares == []
    cluster.rows[INCIDENTS_SQL] = [{"incident_id": "lost:host=node0", "kind": "lost_host", "hosts": ["node0"], "first_seen_ns": time.time_ns(),
                                    "status": "open", "summary": "every rank of node0 went silent"}]  # fmt: skip
    heal.poll()
    assert cluster.fenced == ["node0"] and cluster.joined == ["node3"] and heal.remaining == ["node1", "node2", "node3"]


def test_a_spare_the_job_never_needed_is_stopped_when_the_job_ends_and_its_exit_is_not_the_jobs() -> None:
    cluster = Cluster(exits={"node0": 0, "node1": 0, "node2": 0, "node3": -15})
    heal = _driver(cluster)
    cluster.rows[driver.ATTEMPTS_SQL] = [{**_attempt(0, HOSTS), "registered_ns": time.time_ns()}]
    heal.poll()
    assert cluster.joined == ["node3"]
    cluster.done = True
    assert heal.run() == {"node0": 0, "node1": 0, "node2": 0} and cluster.stopped == ["node3"]
    assert [a for a, *_ in cluster.actions][-1] == "finished"


def test_a_spare_that_joined_while_a_fence_held_the_driver_is_the_jobs_when_it_ends() -> None:
    """The survivors restarted with the waiting spare and finished while the driver's loop was held by a
    fence (11 s under Slurm): at the end the spare is one of the job's hosts, its exit the job's, not a
    spare it never needed (the Slurm drill: "the job did not need node3: stopped", "finished on node0, node2")."""
    cluster = Cluster(exits={"node0": 0, "node1": -9, "node2": 0, "node3": 0})
    heal = _driver(cluster)
    cluster.rows[driver.ATTEMPTS_SQL] = [{**_attempt(0, HOSTS), "registered_ns": time.time_ns()}]
    heal.poll()
    assert cluster.joined == ["node3"]
    cluster.rows[driver.ATTEMPTS_SQL].append({**_attempt(1, ["node0", "node2", "node3"]), "registered_ns": time.time_ns()})
    cluster.rows[driver.STEPS_SQL] = [{"attempt": 1, "first_step": 11, "last_step": 24, "first_step_ns": time.time_ns()}]
    cluster.done = True
    assert heal.run() == {"node0": 0, "node1": -9, "node2": 0, "node3": 0} and cluster.stopped == []
    assert [hosts for action, hosts, _ in cluster.actions if action == "finished"] == [["node0", "node2", "node3"]]


def test_a_waiting_spare_whose_launcher_failed_is_started_again_only_in_an_evicted_hosts_place() -> None:
    """Not in a loop while it waits (a broken spare would fail again, and a job's end closes the rendezvous);
    its exit is not the job's."""
    cluster = Cluster()
    heal = _driver(cluster)
    cluster.rows[driver.ATTEMPTS_SQL] = [{**_attempt(0, HOSTS), "registered_ns": time.time_ns()}]
    heal.poll()
    cluster.exits["node3"] = 1
    heal.poll()
    heal.poll()
    assert cluster.joined == ["node3"] and heal.spares == ["node3"]
    cluster.rows[INCIDENTS_SQL] = [{"incident_id": "lost:host=node0", "kind": "lost_host", "hosts": ["node0"], "first_seen_ns": time.time_ns(),
                                    "status": "open", "summary": "every rank of node0 went silent"}]  # fmt: skip
    heal.poll()
    assert cluster.fenced == ["node0"] and cluster.joined == ["node3", "node3"] and heal.remaining == ["node1", "node2", "node3"]


def test_the_exit_of_a_spare_whose_launcher_failed_is_not_the_jobs() -> None:
    cluster = Cluster()
    heal = _driver(cluster)
    cluster.rows[driver.ATTEMPTS_SQL] = [{**_attempt(0, HOSTS), "registered_ns": time.time_ns()}]
    heal.poll()
    cluster.exits = {"node0": 0, "node1": 0, "node2": 0, "node3": 1}
    heal.poll()
    cluster.done = True
    assert heal.run() == {"node0": 0, "node1": 0, "node2": 0} and cluster.stopped == []


def test_a_lost_rank_that_becomes_its_hosts_loss_is_considered_again() -> None:
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, HOSTS)]})
    heal = _driver(cluster)
    incident = {"incident_id": "lost:rank=0", "kind": "lost_rank", "hosts": ["node0"], "summary": "rank 0 went silent"}
    cluster.rows[INCIDENTS_SQL] = [incident]
    heal.poll()
    heal.poll()
    assert [a for a, *_ in cluster.actions] == ["incident"] and not cluster.fenced  # ignored once, not again
    cluster.rows[INCIDENTS_SQL] = [{**incident, "kind": "lost_host", "summary": "every rank of node0 went silent"}]
    heal.poll()
    assert cluster.fenced == ["node0"] and cluster.joined == ["node3"]
    assert cluster.reasons == ["rankscope: lost_host lost:rank=0: every rank of node0 went silent"]  # what Slurm's drain says
    assert heal.remaining == ["node1", "node2", "node3"]


def test_a_host_the_job_restarted_without_is_evicted_and_the_restarted_workers_are_left_alone() -> None:
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, HOSTS)]}, exits={"node0": -9})
    heal = _driver(cluster)
    heal.poll()
    assert not cluster.fenced  # its launcher ended, and nothing shows that the job went on without it yet
    cluster.rows[driver.ATTEMPTS_SQL].append(_attempt(1, ["node1", "node2"]))
    heal.poll()
    heal.poll()
    assert cluster.fenced == ["node0"] and heal.evicted == ["node0"] and cluster.joined == ["node3"]
    evict = next(a for a in cluster.actions if a[0] == "evict")
    assert "attempt 1 went on without it" in evict[2] and "code -9" in evict[2]
    assert cluster.reasons == [f"rankscope: {evict[2]}"]
    assert not cluster.killed  # the survivors restarted by themselves: their workers are attempt 1's


def test_survivors_that_restarted_before_the_fence_are_not_killed_after_it() -> None:
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, HOSTS), _attempt(1, ["node1", "node2"])]})
    heal = _driver(cluster)
    cluster.rows[INCIDENTS_SQL] = [{"incident_id": "lost:host=node0", "kind": "lost_host", "hosts": ["node0"], "first_seen_ns": time.time_ns(),
                                    "status": "open", "summary": "every rank of node0 went silent"}]  # fmt: skip
    heal.poll()
    heal.poll()
    assert cluster.fenced == ["node0"] and cluster.joined == ["node3"]
    assert not cluster.killed  # attempt 1 went on without node0 before the fence: its workers are the job's now
    assert "restart" not in [a for a, *_ in cluster.actions]


def test_survivors_still_running_after_the_fence_are_killed_so_that_they_restart() -> None:
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, HOSTS)]})
    heal = _driver(cluster)
    cluster.rows[INCIDENTS_SQL] = [{"incident_id": "lost:host=node0", "kind": "lost_host", "hosts": ["node0"], "first_seen_ns": time.time_ns(),
                                    "status": "open", "summary": "every rank of node0 went silent"}]  # fmt: skip
    heal.poll()
    heal.poll()
    assert cluster.fenced == ["node0"] and cluster.killed == {("node0", 101), ("node2", 102)}
    assert [reason for action, _, reason in cluster.actions if action == "restart"] == [
        "2 workers of the survivors still ran 0 s after the fence: killed, so that torchrun restarts them"
    ]


def test_too_few_hosts_left_hands_the_job_back_to_its_scheduler_when_the_policy_requeues() -> None:
    policy = Policy(min_hosts=3, requeue=True)
    assert policy.verdict("lost_host", ["node1"], 0, HOSTS)[0] is Verdict.REQUEUE
    assert policy.verdict("lost_host", ["node1"], 0, HOSTS, spares=1)[0] is Verdict.EVICT  # a spare takes its place
    assert Policy(min_hosts=3).verdict("lost_host", ["node1"], 0, HOSTS)[0] is Verdict.IGNORE
    assert policy.verdict("crash", ["node1"], 0, HOSTS)[0] is Verdict.CHECK  # checked first: it may pass
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, [*HOSTS, "node3"])]})
    requeued: list[bool] = []
    heal = driver.Driver("run", cluster, cluster, Policy(min_hosts=4, requeue=True), cluster, log=lambda line: None,  # type: ignore[arg-type]
                         requeue=lambda: requeued.append(True))  # fmt: skip
    cluster.rows[INCIDENTS_SQL] = [{"incident_id": "lost:host=node1", "kind": "lost_host", "hosts": ["node1"], "summary": "every rank of node1 went silent"}]
    heal.poll()
    assert cluster.fenced == ["node1"] and requeued == [True] and heal.requeued  # drained first: the scheduler places the job elsewhere
    assert [a for a, *_ in cluster.actions] == ["incident", "evict", "fenced", "requeue"]
    assert cluster.reasons == ["rankscope: lost_host lost:host=node1: every rank of node1 went silent"]


def test_silence_while_the_driver_paused_the_workers_is_not_a_lost_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A straggler's self-check pauses every worker: their ranks go silent and the diagnosis names
    lost hosts. Those that are heard again once the pause settled are ignored; one still silent is evicted."""
    monkeypatch.setattr(driver, "PAUSE_SETTLE_NS", 0)
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, HOSTS)], driver.CURRENT_STEP_SQL: [{"step": 5}]})
    heal = _driver(cluster)
    straggler = {"incident_id": "straggler:rank=5", "kind": "straggler", "hosts": ["node2"], "summary": "rank 5 slower",
                 "first_seen_ns": time.time_ns(), "status": "open"}  # fmt: skip
    cluster.rows[INCIDENTS_SQL] = [straggler]
    heal.poll()
    cluster.rows[driver.CURRENT_STEP_SQL] = [{"step": 9}]
    heal.poll()  # checked: the workers were paused (the check itself cannot run here)
    assert cluster.killed == {("node0", 101), ("node2", 102)} and len(heal._pauses) == 1
    during = heal._pauses[0][0] + 1
    lost = [{"incident_id": f"lost:host={h}", "kind": "lost_host", "hosts": [h], "summary": f"every rank of {h} went silent",
             "first_seen_ns": during, "status": status} for h, status in (("node0", "closed"), ("node1", "open"))]  # fmt: skip
    cluster.rows[INCIDENTS_SQL] = [straggler, *lost]
    heal.poll()
    assert cluster.fenced == ["node1"]
    assert any(a[0] == "incident" and a[1] == ["node0"] and "paused the workers" in a[2] for a in cluster.actions)


def test_a_straggler_raised_late_counts_the_slow_steps_its_diagnosis_saw() -> None:
    """Under load the straggler incident may open many steps after the rank became slow: those steps count."""
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, HOSTS)], driver.CURRENT_STEP_SQL: [{"step": 24}]})
    heal = _driver(cluster)
    late = {"incident_id": "straggler:host=node1", "kind": "straggler", "hosts": ["node1"], "summary": "slower since step 8",
            "evidence": json.dumps({"since_step": 8}), "first_seen_ns": time.time_ns()}  # fmt: skip
    fresh = {**late, "incident_id": "straggler:host=node2", "hosts": ["node2"], "evidence": json.dumps({"since_step": 23})}
    cluster.rows[INCIDENTS_SQL] = [late, fresh]
    heal.poll()
    verdicts = [(h, r.split(":")[0]) for a, h, r in cluster.actions if a == "incident"]
    assert verdicts == [(["node1"], "check"), (["node2"], "wait")]


def test_a_node_s_life_is_stored_suspect_checking_drained_and_back_after_it_passes_again(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, HOSTS)]})
    heal = driver.Driver("run", cluster, cluster, Policy(min_hosts=2, recheck_s=0.01), cluster, log=lambda line: None,  # type: ignore[arg-type]
                         join=cluster.joined.append)  # fmt: skip
    crash = {"incident_id": "crash:rank=2", "kind": "crash", "hosts": ["node1"], "summary": "rank 2 (node1) died", "first_seen_ns": time.time_ns()}
    cluster.rows[INCIDENTS_SQL] = [crash]
    heal.poll()  # the check cannot run here (the fake fleet has no runner): the node stays a suspect, in the job
    assert cluster.states[:2] == [("node1", "suspect", "crash: rank 2 (node1) died"), ("node1", "checking", "self-check against 3 other hosts")]
    assert cluster.states[2][:2] == ("node1", "suspect") and cluster.states[2][2].startswith("the self-check could not run") and not cluster.fenced
    lost = {"incident_id": "lost:host=node2", "kind": "lost_host", "hosts": ["node2"], "summary": "every rank of node2 went silent",
            "first_seen_ns": time.time_ns()}  # fmt: skip
    cluster.rows[INCIDENTS_SQL] = [crash, lost]
    cluster.states.clear()
    heal.poll()
    assert cluster.states == [("node2", "suspect", "lost_host: every rank of node2 went silent"),
                              ("node2", "drained", "rankscope: lost_host lost:host=node2: every rank of node2 went silent")]  # fmt: skip
    # a re-check that fails leaves it drained; one that passes takes it back as a spare
    verdicts = iter([False, True])
    monkeypatch.setattr(driver.node_life, "recheck", lambda host, *a, **k: verdict.HostResult(host, next(verdicts), "figures", ()))
    monkeypatch.setattr(driver.node_life, "reference", lambda client, host: {})
    cluster.states.clear()
    time.sleep(0.02)
    heal.poll()
    assert not cluster.states and cluster.actions[-1][:2] == ("recheck", ["node2"]) and "still fails" in cluster.actions[-1][2]
    time.sleep(0.02)
    heal.poll()
    assert cluster.states == [("node2", "healthy", "passed its self-check again: figures")] and cluster.released == ["node2"]
    assert heal.spares == ["node2"]
    cluster.rows[INCIDENTS_SQL] = [crash, lost, {**lost, "incident_id": "lost:host=node0", "hosts": ["node0"]}]
    heal.poll()
    assert cluster.joined == ["node2"] and heal.remaining == ["node1", "node3", "node2"]  # it took node0's place


def test_a_node_drained_twice_within_the_hour_stays_drained_for_a_person(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, HOSTS)], node_life.NODES_SQL: [
        {"host": "node2", "state": "drained", "drains": 2, "run_id": "run", "incident_id": "x", "reason": "", "actor": "rankscope launch"}]})  # fmt: skip
    heal = driver.Driver("run", cluster, cluster, Policy(min_hosts=2, recheck_s=0.01), cluster, log=lambda line: None)  # type: ignore[arg-type]
    monkeypatch.setattr(driver.node_life, "recheck", lambda *a, **k: pytest.fail("a held node is not checked again"))
    cluster.rows[INCIDENTS_SQL] = [{"incident_id": "lost:host=node2", "kind": "lost_host", "hosts": ["node2"], "summary": "silent"}]
    heal.poll()
    time.sleep(0.02)
    heal.poll()
    heal.poll()
    rechecks = [a for a in cluster.actions if a[0] == "recheck"]
    assert len(rechecks) == 1 and "stays drained until a person resumes it" in rechecks[0][2] and not cluster.released


def test_an_incident_raised_before_this_launch_is_left_to_the_driver_of_its_time() -> None:
    """A requeued job's driver reads the run's incidents of the allocation before: decided there, not acted on again."""
    cluster = Cluster(rows={driver.ATTEMPTS_SQL: [_attempt(0, HOSTS)]})
    heal = _driver(cluster)
    cluster.rows[INCIDENTS_SQL] = [{"incident_id": "lost:host=node1", "kind": "lost_host", "hosts": ["node1"], "summary": "silent",
                                    "first_seen_ns": heal._since_ns - 1}]  # fmt: skip
    heal.poll()
    heal.poll()
    assert not cluster.fenced and not cluster.states
    assert [(a, h) for a, h, _ in cluster.actions] == [("incident", ["node1"])] and "raised before this launch" in cluster.actions[0][2]


#: the drill in the suite: under Slurm, a node killed with the job requeued; the spare drill and the test-bed
#: drill (a host killed) are docs/healing.md's, run as written by tests/test_docs.py. The frozen and throttled
#: nodes' drills (3-4 min each on 2 cores) are left to `benchmarks/healing.py`, which runs every drill: their
#: parts are the suite's elsewhere (the self-check as Slurm job steps and a drained node's return:
#: tests/test_testbed_slurm.py; the check of frozen and throttled hosts: tests/test_selfcheck.py and
#: docs/selfcheck.md; the driver's incident -> self-check -> evict: the fleet-less tests above)
SLURM_IN_TESTS = [slurm_drills.DRILLS["kill-node-requeue"]]


@pytest.mark.slow
@pytest.mark.foreground  # the self-check compares the nodes' speeds, and a starved job would read as a hang
@pytest.mark.timeout(540)
@pytest.mark.parametrize("drill", SLURM_IN_TESTS, ids=[d.name for d in SLURM_IN_TESTS])
def test_under_slurm_the_bad_node_is_drained_with_its_incident_and_the_job_finishes(drill: scenarios.Drill, tmp_path: Path) -> None:
    if lacking := slurm.missing():
        pytest.skip(f"no Slurm on this machine: {', '.join(lacking)} missing (make slurm installs them as root)")
    outcome, story = _healed(slurm_drills.run, drill, tmp_path, "*.out")
    evict = outcome.first("evict")
    acted = next(a for a in outcome.actions if a["incident_id"] == evict["incident_id"] and a["action"] == "incident")
    kind = json.loads(acted["evidence"])["kind"]
    assert outcome.fenced_as.startswith(f"rankscope: {kind} {evict['incident_id']}: "), outcome.fenced_as  # sinfo -R names the incident
    expected = ["launched", "incident", *(["selfcheck"] if kind != "lost_host" else []), "evict", *(["requeue"] if drill.requeue else []),
                "restart", "resumed", "finished"]  # fmt: skip
    told = [a["action"] for a in outcome.actions if a["action"] in expected]
    assert sorted(set(told), key=told.index) == expected, story  # the story, in order, nobody else acting
    assert outcome.node_states[outcome.target][0] == "suspect" and outcome.node_states[outcome.target][-1] == "drained", outcome.node_states
    resumed = json.loads(outcome.first("resumed")["evidence"])
    assert resumed["resumed_step"] > 1 and resumed["steps_lost"] >= 0  # from a checkpoint, not from scratch
    for host in outcome.final_hosts if drill.relays else ():  # each node's ranks sent through a relay of its own, stopped with the job
        log = (tmp_path / "launch" / f"{host}.log").read_text(errors="replace")
        assert re.search(rf"batches received from ranks, by run: {outcome.run_id} [1-9]", log), f"{host}:\n{log[-3000:]}"
    if drill.requeue:  # the dead node declared DOWN by the driver: Slurm did not hold the job COMPLETING until it gave up on it itself
        relaunched = [a["time_ns"] for a in outcome.actions if a["action"] == "launched"][-1]
        assert (relaunched - outcome.first("requeue")["time_ns"]) / 1e9 < slurm.SLURMD_TIMEOUT_S, story
    if kind != "lost_host":  # a node still there (frozen, throttled) was self-checked and failed, its peers passed
        check = json.loads(outcome.first("selfcheck")["evidence"])["passed"]
        assert check[outcome.target] is False and all(check[h] for h in check if h != outcome.target), story


def _healed(play: Callable[..., scenarios.Outcome], drill: scenarios.Drill, tmp_path: Path, logs: str) -> tuple[scenarios.Outcome, str]:
    """``play(drill)``'s outcome, asserted healed (with the job's ``logs`` files when not), and its story."""
    try:
        outcome = play(drill, workdir=tmp_path, log=lambda line: None)
    except hosts.TestbedError as e:
        pytest.skip(f"no test bed on this machine: {e}")
    story = "\n".join(f"{a['action']} {a['hosts']} {a['reason']}" for a in outcome.actions)
    said = "\n".join(f"--- {p} ---\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp_path.rglob(logs)))
    assert outcome.healed, f"{outcome.exits} final hosts {outcome.final_hosts} status {outcome.status}\n{story}\n{said}"
    return outcome, story


def test_rankscope_launch_refuses_what_cannot_run_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # outside any allocation
        return subprocess.run([sys.executable, "-m", "rankscope.cli.main", "launch", *args], capture_output=True, text=True, timeout=60, env=env)

    refused = launch("--collector", "127.0.0.1:7777", "--", "-m", "rankscope.trainer")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "rankscope launch: --collector must be unix:/PATH (the hosts' networks reach nothing else)"
    )
    missing = launch("--collector", f"unix:{tmp_path}/c.sock")
    assert missing.returncode == 2 and missing.stderr.startswith("rankscope launch: name a program after --")
    unknown = launch("--collector", f"unix:{tmp_path}/c.sock", "--testbed", "no-such-bed", "--", "-m", "rankscope.trainer")
    assert unknown.returncode == 2 and unknown.stderr.startswith("rankscope launch: no test bed 'no-such-bed'"), unknown.stderr
    outside = launch("--slurm", "--collector", "127.0.0.1:7777", "--", "-m", "rankscope.trainer")  # any address: a cluster's nodes reach it
    assert outside.returncode == 2 and outside.stderr.strip() == (
        "rankscope launch: not inside a Slurm allocation (SLURM_JOB_ID is not set): run it from a batch script (sbatch) or salloc"
    ), outside.stderr
    requeue = launch("--requeue", "--collector", f"unix:{tmp_path}/c.sock", "--", "-m", "rankscope.trainer")
    assert requeue.returncode == 2 and requeue.stderr.strip() == "rankscope launch: --requeue needs --slurm (a test bed has no scheduler to requeue the job)"
    both = launch("--slurm", "--testbed", "rsheal", "--collector", "127.0.0.1:7777", "--", "-m", "rankscope.trainer")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
