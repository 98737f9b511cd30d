"""The Slurm test bed (rankscope.testbed.slurm): the namespace hosts as a real Slurm cluster whose
job steps run as the hosts' own processes, a drained node that keeps a job waiting, and a test bed
that goes without a trace, its daemons with it. On it, the healing driver's Slurm fleet
(rankscope.healing.slurm_fleet) finds, pauses and fences a real job's workers, and runs the
self-check on its nodes, through Slurm alone."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ProcRunner, start_collector

from rankscope.harness.orchestration import CLI
from rankscope.healing.slurm_fleet import SlurmFleet
from rankscope.testbed import hosts, slurm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm.Slurm]:
    """Three namespace hosts made a Slurm cluster, shared by the module's tests; skips where no test
    bed can be made or Slurm is missing (``make slurm`` installs it)."""
    if lacking := slurm.missing():
        pytest.skip(f"no Slurm on this machine: {', '.join(lacking)} missing (make slurm installs them as root)")
    try:
        bed = hosts.create(3)
    except hosts.TestbedError as e:
        pytest.skip(f"no test bed on this machine: {e}")
    try:
        yield slurm.start(dataclasses.replace(bed, slurm=True))
    finally:
        hosts.destroy(bed.name)


def test_every_host_is_a_node_whose_job_steps_run_as_the_host_s_own_processes(cluster: slurm.Slurm) -> None:
    assert cluster.nodes() == {"node0": ("idle", ""), "node1": ("idle", ""), "node2": ("idle", "")}
    step = "hostname; ip -4 -o addr show eth0 | awk '{print $4}'; grep -E '^[0-9]+:cpu:' /proc/self/cgroup; getent hosts node2"
    out = cluster.run(["srun", "--nodes=3", "--label", "sh", "-c", step], timeout_s=60).stdout
    lines: dict[str, list[str]] = {}
    for line in out.splitlines():
        task, _, text = line.partition(": ")
        lines.setdefault(task.strip(), []).append(text.strip())
    for host in cluster.bed.hosts:
        name, address, cpu_group, node2 = lines[str(host.index)]
        assert (name, address) == (host.name, f"{host.address}/24")
        # in the host's cpu cgroup: its quota (and a throttle from outside) reaches what Slurm runs there
        assert cpu_group.split(":", 2)[2] == "/" + str(host.cgroup("cpu").relative_to(hosts.CGROUP_ROOT / "cpu"))
        assert node2.split() == [cluster.bed.host("node2").address, "node2"]  # the other hosts resolve by name


def test_a_drained_node_keeps_a_job_that_needs_it_waiting_until_it_is_resumed(cluster: slurm.Slurm) -> None:
    reason = "rankscope: crash inc-1: rank 3 (node1) died"
    cluster.wait_idle()  # the module's earlier jobs have left node1 (a node that still runs one is "draining")
    cluster.run(["scontrol", "update", "NodeName=node1", "State=DRAIN", f"Reason={reason}"])
    try:
        assert cluster.nodes()["node1"] == ("drained", reason)
        assert cluster.run(["sinfo", "--list-reasons", "--noheader", "--format=%E|%N"]).stdout == f"{reason}|node1\n"
        job = cluster.run(["sbatch", "--parsable", "--nodes=3", "--output=/dev/null", "--wrap=true"]).stdout.strip()
        time.sleep(2)  # a scheduling pass: the job must still be waiting after it
        assert _job(cluster, job)["JobState"] == "PENDING"
    finally:
        cluster.run(["scontrol", "update", "NodeName=node1", "State=RESUME"])
    deadline = time.monotonic() + 60
    while (state := _job(cluster, job)["JobState"]) != "COMPLETED":
        assert state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") and time.monotonic() < deadline, state
        time.sleep(0.2)
    assert cluster.nodes()["node1"] == ("idle", "")


def _job(cluster: slurm.Slurm, job: str) -> dict[str, str]:
    out = cluster.run(["scontrol", "show", "job", "--oneliner", job]).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def test_up_with_slurm_and_down_leave_no_daemon_behind() -> None:
    """The command line: up --slurm, a Slurm command through the test bed, down; no slurmd, slurmctld
    or munged of that test bed is left, nor its files."""
    if lacking := slurm.missing():
        pytest.skip(f"no Slurm on this machine: {', '.join(lacking)} missing (make slurm installs them as root)")
    name = "rsslurmcli"
    cli = [sys.executable, "-m", "rankscope.cli.main", "testbed"]
    up = subprocess.run([*cli, "up", "--slurm", "--hosts", "1", "--name", name], capture_output=True, text=True, timeout=120)
    if up.returncode != 0 and "needs root" in up.stderr:
        pytest.skip(up.stderr.strip())
    try:
        assert up.returncode == 0, up.stderr
        assert f"test bed {name} is up" in up.stdout and "Slurm partition bed" in up.stdout
        sinfo = subprocess.run([*cli, "slurm", "--testbed", name, "--", "sinfo", "--noheader", "--Node", "--format=%N %T"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert (sinfo.returncode, sinfo.stdout) == (0, "node0 idle\n"), sinfo.stderr
        directory = hosts.load(name).directory
        assert _daemons(directory)  # the check below would pass vacuously otherwise
    finally:
        down = subprocess.run([*cli, "down", name], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert _daemons(directory) == [] and hosts.leftovers(name) == []


def _daemons(directory: object) -> list[str]:
    """The command lines of processes that name ``directory`` (the test bed's Slurm daemons do)."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=10).stdout
    return [line for line in out.splitlines() if str(directory) in line]


#: one torchrun agent a node, each a job step of its own (as an elastic job under Slurm runs), with one sleeping worker
BATCH = """#!/bin/sh
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  srun --nodes=1 --ntasks=1 --nodelist="$node" {python} -m torch.distributed.run --standalone --nproc-per-node=1 {script} &
done
wait
"""


@pytest.fixture
def job(cluster: slurm.Slurm, tmp_path: Path) -> Iterator[str]:
    """A 3-node job of the cluster with a torchrun worker on every node; cancelled, and its nodes resumed, at the end."""
    (tmp_path / "worker.py").write_text("import time\ntime.sleep(600)\n")
    (tmp_path / "job.sh").write_text(BATCH.format(python=sys.executable, script=tmp_path / "worker.py"))
    job_id = cluster.run(["sbatch", "--parsable", "--nodes=3", f"--output={tmp_path / 'job.log'}", str(tmp_path / "job.sh")]).stdout.strip()
    try:
        deadline = time.monotonic() + 60
        while (state := _job(cluster, job_id)["JobState"]) != "RUNNING":
            assert state == "PENDING" and time.monotonic() < deadline, state
            time.sleep(0.2)
        yield job_id
    finally:
        cluster.run(["scancel", job_id], check=False)
        cluster.run(["scontrol", "update", "NodeName=node[0-2]", "State=RESUME"], check=False)


def test_a_slurm_fleet_finds_pauses_and_fences_a_job_s_workers_through_slurm(cluster: slurm.Slurm, job: str) -> None:
    fleet = SlurmFleet(job, cluster.command)
    deadline = time.monotonic() + 120
    while len(workers := fleet.workers(["node0", "node1", "node2"])) < 3:  # torchrun starts its worker
        assert time.monotonic() < deadline, f"workers found: {workers}; unreachable: {fleet.unreachable}"
        time.sleep(0.5)
    assert fleet.hosts() == ["node0", "node1", "node2"]
    ((host, pid),) = fleet.workers(["node1"])
    assert host == "node1" and _namespace(pid) == cluster.bed.host("node1").namespace  # the worker, not its agent
    assert fleet.signal({(host, pid)}, signal.SIGSTOP) == 1 and _state(pid) == "T"
    assert fleet.signal({(host, pid)}, signal.SIGCONT) == 1 and _state(pid) != "T"

    reason = "rankscope: crash crash:rank=1: rank 1 (node1) died"
    done = fleet.fence("node1", reason)
    state, why = cluster.nodes()["node1"]
    assert state in ("draining", "drained") and why == reason  # draining while the job still holds it
    assert "drained node1" in done and "cancelled" in done
    deadline = time.monotonic() + 30
    while _state(pid) is not None:
        assert time.monotonic() < deadline, "node1's worker still runs after the fence"
        time.sleep(0.2)
    assert {h for h, _ in fleet.workers(["node0", "node1", "node2"])} == {"node0", "node2"}  # the others go on


def test_the_self_check_runs_on_the_nodes_as_job_steps(cluster: slurm.Slurm, job: str) -> None:
    from rankscope.healing.selfcheck import check_hosts

    fleet = SlurmFleet(job, cluster.command)
    assert fleet.runner.addresses == {h.name: h.address for h in cluster.bed.hosts}
    report = check_hosts(fleet.hosts(), fleet.runner, timeout_s=60)
    assert [h.host for h in report.hosts] == ["node0", "node1", "node2"]
    for result in report.hosts:
        checks = {f.check for f in result.figures}
        assert {"matmul", "memory_bandwidth"} <= checks and {f"link_rtt:{peer}" for peer in ("node0", "node1", "node2") if peer != result.host} <= checks
        assert all(f.passed or "not judged" in f.detail for f in result.figures if not f.check.startswith("link")), result.summary


def _namespace(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True, timeout=10).stdout.strip()


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    return None if state == "Z" else state


@pytest.mark.timeout(420)  # three self-checks of hosts in the background lane: 180 s ran out in the second (session 34)
def test_a_drained_node_comes_back_only_after_it_passes_its_self_check_again(cluster: slurm.Slurm, proc_runner: ProcRunner, tmp_path: Path) -> None:
    """``rankscope node resume``, as an operator runs it on the cluster: the node is held by a reservation
    and checked as a task in it against its healthy peers' stored figures. Throttled hard it fails
    and stays drained with the finding as its reason; given its CPU back it passes and takes jobs."""
    from rankscope.collector.client import Client
    from rankscope.healing import node_life, record
    from rankscope.healing.selfcheck import check_hosts
    from rankscope.healing.slurm_fleet import SlurmRunner, addresses
    from rankscope.testbed import host_faults

    collector = start_collector(proc_runner, tmp_path / "store", listen=f"unix:{tmp_path / 'c.sock'}")
    cluster.wait_idle()
    peers = check_hosts(["node0", "node2"], SlurmRunner((), cluster.command, addresses(cluster.command, ["node0", "node2"])), links=False, timeout_s=60)
    assert peers.passed, peers.as_json()
    reason = "rankscope: crash crash:rank=1: rank 1 (node1) died"
    with Client(collector.target) as client:
        for host in peers.hosts:
            client.send(host.batch("run-1"))
        client.send(record.node_state_batch("run-1", "node1", node_life.DRAINED, actor="rankscope launch", incident_id="crash:rank=1", reason=reason))
    cluster.run(["scontrol", "update", "NodeName=node1", "State=DRAIN", f"Reason={reason}"])

    def resume() -> subprocess.CompletedProcess[str]:
        return subprocess.run(cluster.command([*CLI, "node", "resume", "node1", "--slurm", "--collector", collector.target]),
                              capture_output=True, text=True, timeout=150)  # fmt: skip

    throttled = host_faults.throttle_cpu(cluster.bed, cluster.bed.host("node1"), 0.1)
    try:
        failed = resume()
    finally:
        throttled.undo()
    assert failed.returncode == 1 and "node1 stays drained: failed its self-check again" in failed.stdout, failed.stdout + failed.stderr
    deadline = time.monotonic() + 30
    while (state := cluster.nodes()["node1"])[0] != "drained":  # draining while the check's task completes
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert state[1].startswith("rankscope: failed its self-check again: "), state
    assert "rankscope-check" not in cluster.run(["scontrol", "show", "reservation"]).stdout  # nothing holds it but the drain

    passed = resume()
    assert passed.returncode == 0 and "node1 is back" in passed.stdout and "against 2 healthy peers' figures" in passed.stdout, passed.stdout + passed.stderr
    assert cluster.nodes()["node1"] == ("idle", "")
    listed = subprocess.run([*CLI, "node", "list", "--collector", collector.target], capture_output=True, text=True, timeout=60).stdout
    row = next(line for line in listed.splitlines() if line.startswith("node1"))
    assert row.split()[1] == "healthy" and "resumed by root after its self-check" in row, listed
    with Client(collector.target) as client:
        history = client.query("SELECT state FROM node_states WHERE host = 'node1' ORDER BY time").column("state").to_pylist()
    assert history == ["drained", "checking", "drained", "checking", "healthy"]
