"""The test bed: namespace hosts with their own address and host name, a job across them with one
torchrun agent per host, and nothing left behind, also when a test fails in the middle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import running, use_this_conftest

from rankscope.testbed import host_faults, hosts
from rankscope.testbed.job import launch

pytestmark = pytest.mark.timeout(180)

#: one line per rank: what the rank's own machine says it is and where gloo reached its peers
PROBE = """
import os, socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {socket.gethostname()} sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_hosts_have_their_own_address_and_name_and_go_without_a_trace(testbed: hosts.Testbed) -> None:
    for host in testbed.hosts:
        seen = subprocess.run(["ip", "-n", host.namespace, "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True, check=True)
        assert f"{host.address}/24" in seen.stdout
        assert host.cgroup("cpu").is_dir() and host.cgroup("freezer").is_dir()
    hosts.destroy(testbed.name)
    assert hosts.leftovers(testbed.name) == []
    hosts.destroy(testbed.name)  # idempotent: the fixture calls it again


MAKE_IN_GROUP = """
import json, os, sys
from rankscope.testbed import hosts
open(os.path.join(sys.argv[1], "cgroup.procs"), "w").write(str(os.getpid()))
bed = hosts.create(2)
print(json.dumps([bed.name, [str(h.cgroup("cpu")) for h in bed.hosts], [str(h.cgroup("freezer")) for h in bed.hosts]]))
"""


def test_a_test_bed_made_in_a_cpu_group_has_its_hosts_in_it_and_another_process_removes_them(tmp_path: Path) -> None:
    """Hosts get no more CPU weight than the process that made them (the suite's background lane
    makes test beds that yield to its foreground): their cpu groups nest in the maker's group, and
    `destroy` from elsewhere still finds and removes them."""
    maker = hosts.CGROUP_ROOT / "cpu" / f"rsmaker{os.getpid()}"
    try:
        maker.mkdir()
    except OSError as e:
        pytest.skip(f"no cpu cgroup can be made here: {e}")
    name = ""
    try:
        made = subprocess.run([sys.executable, "-c", MAKE_IN_GROUP, str(maker)], capture_output=True, text=True, timeout=60)
        if made.returncode != 0 and "TestbedError" in made.stderr:
            pytest.skip(f"no test bed on this machine: {made.stderr.strip().splitlines()[-1]}")
        assert made.returncode == 0, made.stderr
        name, cpu_groups, freezer_groups = json.loads(made.stdout)
        assert cpu_groups == [str(maker / "rankscope" / f"{name}-h{i}") for i in range(2)]
        assert freezer_groups == [str(hosts.CGROUP_ROOT / "freezer" / "rankscope" / f"{name}-h{i}") for i in range(2)]
        assert sorted(hosts.leftovers(name)) == sorted([*cpu_groups, *freezer_groups, *[f"netns {name}-h{i}" for i in range(2)],
                                                          f"netns {name}-sw", *[str(hosts.NETNS_ETC / f"{name}-h{i}") for i in range(2)]])
        hosts.destroy(name)
        assert hosts.leftovers(name) == []
        assert not (maker / "rankscope").exists()  # the parent group went with its last test bed
    finally:
        if name:
            hosts.destroy(name)
        maker.rmdir()


@pytest.mark.slow
def test_a_job_spans_the_hosts_each_rank_on_its_own_named_host(testbed: hosts.Testbed, tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    job = launch(testbed, [str(script)], run_id="probe", workdir=tmp_path / "logs")
    try:
        placement = job.placement()
        exits = job.wait(120)
    finally:
        job.stop()
    assert set(exits.values()) == {0}, job.output()
    lines = sorted(line for line in job.output(tail=100_000).splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r} of 3 on {placement[r].host.name} sum 3" for r in range(3)], job.output()
    assert sorted(r.host.name for r in placement.values()) == ["node0", "node1", "node2"]


#: node0 sends 1 MB to node1 over TCP and prints the seconds it took (node1 reads it all first)
SINK = "import socket; s = socket.create_server(('0.0.0.0', 7000)); print('ready', flush=True); c, _ = s.accept(); n = 0\n" \
       "while (b := c.recv(65536)): n += len(b)\nc.sendall(str(n).encode())"
SEND = "import socket, sys, time; c = socket.create_connection((sys.argv[1], 7000), timeout=30); t = time.monotonic()\n" \
       "c.sendall(b'x' * 1_000_000); c.shutdown(socket.SHUT_WR); assert c.recv(64) == b'1000000'; print(time.monotonic() - t)"


def test_a_limited_link_carries_its_rate_until_the_limit_is_lifted(testbed: hosts.Testbed, proc_runner) -> None:
    """The bandwidth fault (tbf on both ends of the host's link) really throttles a transfer to the host
    and is gone with ``undo``; the slow-link diagnosis of such a link is the scenario's
    (``rankscope scenario run testbed-slow-link``)."""
    sender, sink = testbed.host("node0"), testbed.host("node1")

    def send() -> float:
        server = proc_runner.start(hosts.command_on(sink, [sys.executable, "-c", SINK]), name="sink")
        server.wait_for("ready", timeout=30)
        done = subprocess.run(hosts.command_on(sender, [sys.executable, "-c", SEND, sink.address]), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and server.wait(30) == 0, done.stderr + server.output()
        return float(done.stdout)

    free = send()
    applied = host_faults.limit_bandwidth(testbed, sink, 20.0)  # 8 Mbit at 20 Mbit/s: 0.4 s
    try:
        limited = send()
    finally:
        applied.undo()
    lifted = send()
    print(f"1 MB: {free:.3f} s free, {limited:.3f} s at 20 Mbit/s, {lifted:.3f} s lifted")
    assert 0.3 < limited < 3 and free < 0.2 and lifted < 0.2, (free, limited, lifted)


def test_a_slowed_host_runs_at_its_share_of_what_it_used(testbed: hosts.Testbed, proc_runner) -> None:
    """``slow_cpu`` cuts what the host's processes used, not what the host has: a busy loop runs at half
    its speed after a 2x cut, whatever share of the host's quota it got before, and at full speed again
    after ``undo``. An idle host is refused (a cut of nothing would stop it), or waited for."""
    host = testbed.host("node0")
    proc_runner.start(hosts.command_on(host, [sys.executable, "-c", "import sys; print('spinning', flush=True)\nwhile True: pass"]),
                      name="spin").wait_for("spinning", timeout=30)  # fmt: skip
    before = host_faults.cores_used(testbed, host, 1.0)
    applied = host_faults.slow_cpu(testbed, host, 2.0, over_s=1.0)
    try:
        slowed = host_faults.cores_used(testbed, host, 1.5)
    finally:
        applied.undo()
    after = host_faults.cores_used(testbed, host, 1.0)
    print(f"{applied.what}; cores used: {before:.2f} before, {slowed:.2f} slowed, {after:.2f} after")
    assert before > 0.1 and 0.3 < slowed / before < 0.7 and after > 0.8 * before, (before, slowed, after)
    with pytest.raises(hosts.TestbedError, match="node1 used 0 of its .* cores: it is idle"):  # nothing runs there
        host_faults.slow_cpu(testbed, testbed.host("node1"), 2.0, over_s=0.2)
    # set before the host's job starts (``--wait``), the cut waits for it
    said: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(host_faults.slow_cpu, testbed, testbed.host("node1"), 2.0, over_s=0.2, wait_s=30, log=said.append)
        deadline = time.monotonic() + 20
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        proc_runner.start(hosts.command_on(testbed.host("node1"), [sys.executable, "-c", "while True: pass"]), name="spin1")
        waited = waiting.result(timeout=30)
    waited.undo()
    assert said == ["node1 is idle: waiting up to 30 s for its processes to use CPU"] and "node1: CPU cut 2x" in waited.what, (said, waited)


@pytest.mark.slow
def test_a_failed_test_leaves_no_namespace_cgroup_or_process(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """The fixture's teardown runs when the test fails with a job running on the test bed."""
    record = tmp_path / "name"
    use_this_conftest(pytester)
    pytester.makepyfile(
        f"""
        from pathlib import Path
        from rankscope.testbed.job import launch

        def test_fails_mid_job(testbed, tmp_path):
            script = tmp_path / "sleep.py"
            script.write_text("import time; time.sleep(1000)")
            job = launch(testbed, [str(script)], run_id="left", workdir=tmp_path)
            job.placement()  # every rank runs
            pids = [pid for host in testbed.hosts for pid in testbed.pids(host)]
            Path({str(record)!r}).write_text(testbed.name + " " + " ".join(map(str, pids)))
            raise AssertionError("failed on purpose")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    name, *pids = record.read_text().split()
    assert len(pids) >= 6  # a launcher and a rank per host at least
    assert [pid for pid in pids if running(int(pid))] == []
    assert hosts.leftovers(name) == []
    assert name not in hosts.running()


@pytest.mark.slow
@pytest.mark.foreground  # a saved test bed: beside a docs page, that page's commands that name none would find two
def test_the_command_brings_a_test_bed_up_and_down(tmp_path: Path) -> None:
    rankscope = [sys.executable, "-m", "rankscope.cli.main", "testbed"]
    name = f"rscli{tmp_path.name[-4:].replace('_', '')}"
    try:
        up = subprocess.run([*rankscope, "up", "--hosts", "2", "--ranks-per-host", "1", "--name", name], capture_output=True, text=True, timeout=60)
        if up.returncode != 0 and "needs root" in up.stderr:
            pytest.skip(up.stderr)
        assert up.returncode == 0 and "node1" in up.stdout, up
        assert name in subprocess.run([*rankscope, "list"], capture_output=True, text=True, timeout=60).stdout
        again = subprocess.run([*rankscope, "up", "--hosts", "2", "--name", name], capture_output=True, text=True, timeout=60)
        assert again.returncode == 1 and f"test bed '{name}' exists already" in again.stderr, again  # and it stays up:
        bad = subprocess.run([*rankscope, "up", "--hosts", "2", "--name", "heal"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "a test bed's name is 'rs' and 1 to 12" in bad.stderr and hosts.leftovers("heal") == [], bad
        (tmp_path / "probe.py").write_text(PROBE)
        run = subprocess.run([*rankscope, "run", "--testbed", name, "--workdir", str(tmp_path), "--", str(tmp_path / "probe.py")],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert run.returncode == 0 and "node0: exit 0" in run.stdout, (run, (tmp_path / "node0.log").read_text())
    finally:
        down = subprocess.run([*rankscope, "down", name], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and hosts.leftovers(name) == [], down

