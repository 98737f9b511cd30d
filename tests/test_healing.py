"""Self-healing: the policy's verdicts, and drills on real namespace hosts where a fault from outside
(kill, freeze, throttle) must end with the job finished without the bad host, nobody involved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankscope.healing import scenarios
from rankscope.healing.policy import Policy, Verdict
from rankscope.testbed import hosts

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


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("drill", scenarios.DRILLS.values(), ids=list(scenarios.DRILLS))
def test_the_job_finishes_without_the_faulty_host(drill: scenarios.Drill, tmp_path: Path) -> None:
    try:
        outcome = scenarios.run(drill, workdir=tmp_path, log=lambda line: None)
    except hosts.TestbedError as e:
        pytest.skip(f"no test bed on this machine: {e}")
    logs = "\n".join(f"--- {p} ---\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp_path.rglob("*.log")))
    story = "\n".join(f"{a['action']} {a['hosts']} {a['reason']}" for a in outcome.actions)
    assert outcome.healed, f"{outcome.exits} final hosts {outcome.final_hosts} status {outcome.status}\n{story}\n{logs}"
    evict = outcome.first("evict")
    assert evict["hosts"] == [outcome.target] and evict["incident_id"], story  # the decision names its incident
    survivors = {h: code for h, code in outcome.exits.items() if h != outcome.target}
    assert survivors and all(code == 0 for code in survivors.values()), outcome.exits
    resumed = json.loads(outcome.first("resumed")["evidence"])
    assert resumed["resumed_step"] > 1 and resumed["steps_lost"] >= 0  # from a checkpoint, not from scratch
    if not drill.name.startswith("kill-host"):  # a host still there (frozen, throttled) was self-checked and failed
        check = json.loads(outcome.first("selfcheck")["evidence"])["passed"]
        assert check[outcome.target] is False and all(check[h] for h in check if h != outcome.target), story


def test_rankscope_launch_refuses_what_cannot_run_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rankscope.cli.main", "launch", *args], capture_output=True, text=True, timeout=60)

    refused = launch("--collector", "127.0.0.1:7777", "--", "-m", "rankscope.trainer")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "rankscope launch: --collector must be unix:/PATH (the hosts' networks reach nothing else)"
    )
    missing = launch("--collector", f"unix:{tmp_path}/c.sock")
    assert missing.returncode == 2 and missing.stderr.startswith("rankscope launch: name a program after --")
    unknown = launch("--collector", f"unix:{tmp_path}/c.sock", "--testbed", "no-such-bed", "--", "-m", "rankscope.trainer")
    assert unknown.returncode == 2 and unknown.stderr.startswith("rankscope launch: no test bed 'no-such-bed'"), unknown.stderr
