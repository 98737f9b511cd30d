"""The Slurm test bed (rankscope.testbed.slurm): the namespace hosts as a real Slurm cluster whose
job steps run as the hosts' own processes, a drained node that keeps a job waiting, and a test bed
that goes without a trace, its daemons with it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

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
