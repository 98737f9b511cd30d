"""``rankscope selfcheck``: the verdict (pure), the orchestration with timeouts (fake probes), the
probes themselves on this machine, the command line, and one real test bed with a throttled and a
frozen host."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from rankscope.cli import selfcheck as cli
from rankscope.cli.main import main
from rankscope.healing import probes, selfcheck, verdict
from rankscope.healing.record import Figure
from rankscope.healing.selfcheck import LocalRunner, check_hosts, run_on
from rankscope.healing.verdict import judge
from rankscope.testbed import hosts as testbed_hosts
from rankscope.testbed.healing_fleet import TestbedRunner

NAN = math.nan


def local(matmul: float = 100.0, memory: float = 10.0, allreduce: float = 2.0) -> list[Figure]:
    return [Figure("matmul", matmul, "GFLOP/s"), Figure("memory_bandwidth", memory, "GB/s"), Figure("loopback_allreduce", allreduce, "ms")]


def links(host: str, hosts: Sequence[str], mbit: Mapping[str, float] | None = None, rtt: float = 0.1) -> list[Figure]:
    """Link figures from ``host`` to every other host: ``mbit`` per peer (default 1000)."""
    out = []
    for peer in hosts:
        if peer != host:
            out += [Figure(f"link_throughput:{peer}", (mbit or {}).get(peer, 1000.0), "Mbit/s"), Figure(f"link_rtt:{peer}", rtt, "ms")]
    return out


# --- the verdict ---------------------------------------------------------------------------------


def test_equal_hosts_pass_against_their_peers_median() -> None:
    report = judge({h: local() for h in ("a", "b", "c")})
    assert report.passed and report.failed == []
    for host in report.hosts:
        assert host.judged and host.summary == "every figure within 2x of its peers' median"
        assert [f.reference for f in host.figures] == [100.0, 10.0, 2.0]
        assert all("1.00x the peers' median" in f.detail for f in host.figures)


def test_a_slow_host_fails_on_the_figure_it_is_slow_in_and_only_that_host() -> None:
    report = judge({"a": local(), "b": local(matmul=40.0), "c": local(matmul=120.0), "d": local()})
    assert report.failed == ["b"]
    b = report.host("b")
    assert [f.check for f in b.failed] == ["matmul"]
    assert b.figure("matmul").reference == 100.0  # the median of a, c, d
    assert b.summary == "matmul 40 GFLOP/s is 0.40x the peers' median 100"
    # with the slow host among its peers, the others' median moves but stays within the factor
    assert report.host("a").figure("matmul").reference == 100.0 and report.host("a").passed


def test_throughputs_fail_below_half_and_times_above_twice_their_peers() -> None:
    at_the_line = judge({"a": local(matmul=50.0, allreduce=4.0), "b": local(), "c": local()})
    assert at_the_line.passed  # exactly 0.5x and 2x: not worse by more than the factor
    beyond = judge({"a": local(matmul=49.0, allreduce=4.1), "b": local(), "c": local()})
    assert [f.check for f in beyond.host("a").failed] == ["matmul", "loopback_allreduce"]
    looser = judge({"a": local(matmul=49.0, allreduce=4.1), "b": local(), "c": local()}, factor=3)
    assert looser.passed
    faster = judge({"a": local(matmul=1000.0, memory=100.0, allreduce=0.1), "b": local(), "c": local(), "d": local()})
    assert faster.passed  # better than the peers is never a failure (and the others' median of three ignores it)


def test_a_worse_time_within_its_noise_floor_passes() -> None:
    """A round trip of 0.1 ms that reads 0.4 ms is 4x, but 0.3 ms is noise on a loaded machine."""
    hosts = ("a", "b", "c")
    figures = {h: links(h, hosts, rtt=0.4 if h == "a" else 0.1) for h in hosts}
    assert judge(figures).passed
    figures["a"] = links("a", hosts, rtt=5.0)
    assert [f.check for f in judge(figures).host("a").failed] == ["link_rtt:b", "link_rtt:c"]


def test_a_test_that_could_not_run_fails_and_a_not_judged_figure_does_not() -> None:
    report = judge({
        "a": [*local()[:2], Figure("loopback_allreduce", NAN, "ms", passed=False, detail="could not run: RuntimeError: gloo")],
        "b": [*local(), Figure("link_rtt:c", NAN, "ms", detail="not judged: c gave no answer")],
        "c": local(),
    })  # fmt: skip
    assert report.failed == ["a"]
    assert report.host("a").summary == "loopback_allreduce could not run: RuntimeError: gloo"
    b = report.host("b")
    assert b.passed and b.figure("link_rtt:c").passed and math.isnan(b.figure("link_rtt:c").reference)
    # the failed figure has no value: it does not count in the peers' median of b and c
    assert report.host("b").figure("loopback_allreduce").reference == 2.0


@pytest.mark.parametrize("n", [4, 8])
def test_a_bad_link_end_fails_and_its_peers_do_not(n: int) -> None:
    """A host with a slow NIC makes its peers' links to it slow too: its links to most peers are
    slow, so it is the slow end; they are compared with the links that touch neither end, and the
    peers' slow links to it are not held against them (at 8 hosts most links do not touch it)."""
    hosts = "abcdefgh"[:n]
    slow = {"a": 100.0}
    figures = {h: [*local(), *links(h, hosts, mbit={p: 100.0 for p in hosts} if h == "a" else slow)] for h in hosts}
    report = judge(figures)
    assert report.failed == ["a"]
    assert [f.check for f in report.host("a").failed] == [f"link_throughput:{p}" for p in hosts[1:]]
    assert report.host("a").figure("link_throughput:b").reference == 1000.0  # b-c, b-d, c-b, ...: none touches a
    b_to_a = report.host("b").figure("link_throughput:a")
    assert b_to_a.passed and b_to_a.reference == 1000.0 and "not held against b: a is slow itself" in b_to_a.detail


def test_a_host_that_fails_its_own_tests_is_the_slow_end_of_its_links() -> None:
    """CI: node1 at a fifth of its CPU; node0's stream to it read 1618 Mbit/s, 0.46x the node1-node2
    links, and node0 failed too. A throttled CPU slows its network: node1 is to blame."""
    mbit = {"node0": {"node1": 1618.0, "node2": 9496.0}, "node1": {"node0": 3507.0, "node2": 3571.0}, "node2": {"node0": 11720.0, "node1": 3494.0}}
    hosts = list(mbit)
    figures = {h: [*local(matmul=12.9 if h == "node1" else 50.0), *links(h, hosts, mbit=mbit[h])] for h in hosts}
    report = judge(figures)
    assert report.failed == ["node1"], report.host("node0").summary
    assert "not held against node0: node1 is slow itself" in report.host("node0").figure("link_throughput:node1").detail
    assert report.host("node0").figure("link_throughput:node2").passed


def test_one_slow_link_between_two_good_hosts_fails_both_ends() -> None:
    """Nothing tells which end of one bad cable is to blame: both fail, on that link alone."""
    hosts = "abcd"
    figures = {h: [*local(), *links(h, hosts, mbit={"b": 100.0} if h == "a" else {"a": 100.0} if h == "b" else None)] for h in hosts}
    report = judge(figures)
    assert report.failed == ["a", "b"]
    assert [f.check for f in report.host("a").failed] == ["link_throughput:b"]
    assert [f.check for f in report.host("b").failed] == ["link_throughput:a"]


def test_with_no_peer_the_figures_are_measured_not_judged() -> None:
    report = judge({"alone": local()})
    host = report.host("alone")
    assert host.passed and not host.judged
    assert host.summary == "no peers to compare with: 3 figures measured, every test ran"
    assert all(math.isnan(f.reference) and "no peers to compare with" in f.detail for f in host.figures)
    failed = judge({"alone": [Figure("matmul", NAN, "GFLOP/s", passed=False, detail="no answer in 5 s")]})
    assert failed.failed == ["alone"]  # a test that could not run fails, peers or not


def test_two_hosts_cannot_blame_a_link_on_either_end() -> None:
    report = judge({"a": [*local(), *links("a", "ab", mbit={"b": 10.0})], "b": [*local(), *links("b", "ab", mbit={"a": 10.0})]})
    assert report.passed
    assert "no peers to compare with" in report.host("a").figure("link_throughput:b").detail


def test_the_factor_must_be_more_than_one() -> None:
    with pytest.raises(ValueError, match="more than 1"):
        judge({"a": local()}, factor=1.0)


def test_figures_come_in_a_fixed_order_and_the_record_carries_them() -> None:
    hosts = ("a", "b")
    report = judge({h: [*reversed(links(h, hosts)), *reversed(local())] for h in hosts})
    assert [f.check for f in report.host("a").figures] == ["matmul", "memory_bandwidth", "loopback_allreduce", "link_throughput:b", "link_rtt:b"]
    batch = report.host("a").batch("run-1")
    assert batch.run_id == "run-1" and batch.selfcheck.host == "a" and batch.selfcheck.passed
    assert [f.check for f in batch.selfcheck.figures] == [f.check for f in report.host("a").figures]
    as_json = json.loads(json.dumps(report.as_json()))  # NaN is null: strict JSON
    assert as_json["hosts"][0]["figures"][3]["reference"] is None


# --- the orchestration: fake probes on fake hosts --------------------------------------------------

FAKE_PROBE = r"""
import json, sys, time
how, argv = json.loads(sys.argv[1]), sys.argv[2:]
time.sleep(how.get("hang", 0))
if how.get("crash"):
    print("Traceback: boom", file=sys.stderr)
    sys.exit(3)
def say(message):
    print("@selfcheck " + json.dumps(message), flush=True)
if "--serve-links" in argv:
    say({"port": 9})
    time.sleep(60)
elif argv[argv.index("--probe") + 1] == "local":
    print("a line that is no answer", flush=True)
    for check, unit in (("memory_bandwidth", "GB/s"), ("loopback_allreduce", "ms"), ("matmul", "GFLOP/s")):
        say({"figures": [{"check": check, "value": how.get(check, 10.0), "unit": unit}]})
else:
    for peer in [argv[i + 1].split("=")[0] for i, a in enumerate(argv) if a == "--peer"]:
        if peer in how.get("unreachable", []):
            say({"checks": [f"link_throughput:{peer}", f"link_rtt:{peer}"], "error": "TimeoutError: timed out"})
            continue
        say({"figures": [{"check": f"link_throughput:{peer}", "value": 1000.0, "unit": "Mbit/s"},
                         {"check": f"link_rtt:{peer}", "value": 0.1, "unit": "ms"}]})
"""


@dataclass
class FakeRunner:
    """Hosts whose probes are FAKE_PROBE: ``how[host]`` makes one slow, silent (hang), crash, or
    unable to reach some peers (``unreachable``)."""

    how: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: how a host's local tests go from their second run on (a machine that was busy only for a while)
    then: dict[str, dict[str, Any]] = field(default_factory=dict)
    started: list[tuple[str, list[str]]] = field(default_factory=list)
    networks: tuple[str, ...] = ("10.200.0.0/24",)

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        local = [a for h, a in self.started if h == host and "local" in a]
        self.started.append((host, list(argv)))
        how = self.then[host] if host in self.then and local and "local" in argv else self.how.get(host, {})
        return [sys.executable, "-c", FAKE_PROBE, json.dumps(how), *argv]

    def address(self, host: str) -> str:
        return f"10.200.0.{ord(host[-1]) - ord('a') + 1}"


def test_every_host_runs_every_test_and_is_judged_against_the_others() -> None:
    runner = FakeRunner({"b": {"matmul": 2.0}})
    report = check_hosts(["a", "b", "c"], runner, timeout_s=20)
    assert report.failed == ["b"] and [f.check for f in report.host("b").failed] == ["matmul"]
    assert [f.check for f in report.host("a").figures] == [
        "matmul", "memory_bandwidth", "loopback_allreduce", "link_throughput:b", "link_throughput:c", "link_rtt:b", "link_rtt:c",
    ]  # fmt: skip
    servers = [(h, argv) for h, argv in runner.started if "--serve-links" in argv]
    assert [(h, argv[argv.index("--bind") + 1]) for h, argv in servers] == [("a", "10.200.0.1"), ("b", "10.200.0.2"), ("c", "10.200.0.3")]
    probe_a = next(argv for h, argv in runner.started if h == "a" and "links" in argv)
    assert [probe_a[i + 1] for i, x in enumerate(probe_a) if x == "--peer"] == ["b=10.200.0.2:9", "c=10.200.0.3:9"]


def test_a_host_slow_once_is_measured_again_and_passes_and_one_slow_twice_fails() -> None:
    runner = FakeRunner({"b": {"loopback_allreduce": 30.0}, "c": {"matmul": 2.0}}, then={"b": {"loopback_allreduce": 11.0}})
    report = check_hosts(["a", "b", "c"], runner, timeout_s=20, links=False)
    assert report.failed == ["c"] and [f.check for f in report.host("c").failed] == ["matmul"]
    assert [h for h, argv in runner.started if "local" in argv] == ["a", "b", "c", "b", "c"]  # the failed ones, once more
    b = report.host("b").figure("loopback_allreduce")
    assert b.passed and b.value == 11.0 and b.detail.startswith("best of 2 runs (the other: 30 ms)"), b
    assert report.host("b").figure("matmul").value == 10.0  # every figure of the better run; no worse than the first's
    assert report.host("c").figure("matmul").detail.startswith("best of 2 runs (the other: 2 GFLOP/s)")


def test_a_host_that_gives_no_answer_fails_within_the_timeout_and_is_left_out_of_the_links() -> None:
    runner = FakeRunner({"c": {"hang": 60}})
    began = time.monotonic()
    report = check_hosts(["a", "b", "c"], runner, timeout_s=1.5)
    assert time.monotonic() - began < 15
    assert report.failed == ["c"]
    c = report.host("c")
    assert c.figure("memory_bandwidth").detail == "no answer in 1.5 s"
    assert c.figure("matmul").detail == "not run: c gave no answer to memory_bandwidth in 1.5 s"
    assert [f.check for f in c.figures] == ["matmul", "memory_bandwidth", "loopback_allreduce"]  # no link tests on it
    a = report.host("a")
    assert a.passed and a.figure("link_rtt:c").detail == "not judged: c gave no answer to memory_bandwidth in 1.5 s"
    assert not any(h == "c" and "--serve-links" in argv for h, argv in runner.started)


def test_a_peer_nobody_reaches_fails_and_a_host_that_reaches_nobody_fails() -> None:
    deaf = check_hosts(["a", "b", "c"], FakeRunner({"a": {"unreachable": ["c"]}, "b": {"unreachable": ["c"]}}), timeout_s=10)
    assert deaf.failed == ["c"]
    assert deaf.host("c").figure("link_server").detail == "unreachable from a, b: could not run: TimeoutError: timed out"
    assert deaf.host("a").figure("link_throughput:c").detail == "not judged: c's link server answers none of its peers"
    cut_off = check_hosts(["a", "b", "c"], FakeRunner({"a": {"unreachable": ["b", "c"]}}), timeout_s=10)
    assert cut_off.failed == ["a"]
    assert [f.check for f in cut_off.host("a").failed] == ["link_throughput:b", "link_throughput:c", "link_rtt:b", "link_rtt:c"]


def test_a_probe_that_dies_fails_its_tests_with_its_last_words() -> None:
    report = check_hosts(["a", "b"], FakeRunner({"b": {"crash": 1}}), timeout_s=10, links=False)
    assert report.failed == ["b"]
    assert report.host("b").figure("memory_bandwidth").detail == "the probe ended (exit 3: Traceback: boom)"
    assert report.host("b").figure("matmul").detail.startswith("not run: the probe ended")


def test_a_loopback_all_reduce_has_two_processes_at_least() -> None:
    runner = FakeRunner()
    check_hosts(["a"], runner, ranks=1)
    (_, argv), = runner.started
    assert argv[argv.index("--ranks") + 1] == "2"


def test_hosts_are_named_once() -> None:
    with pytest.raises(ValueError, match="once"):
        check_hosts(["a", "a"], FakeRunner())


# --- the probes, on this machine -------------------------------------------------------------------


def test_run_on_kills_what_does_not_end_in_time() -> None:
    began = time.monotonic()
    answer = run_on(LocalRunner(), "me", [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], timeout_s=1)
    assert answer.timed_out and answer.stdout == "up\n" and time.monotonic() - began < 5
    done = run_on(LocalRunner(), "me", ["sh", "-c", "echo out; echo err >&2; exit 4"], timeout_s=10)
    assert (done.returncode, done.stdout, done.stderr) == (4, "out\n", "err\n")


def test_the_memory_probe_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert probes.main(["--probe", "local", "--checks", "memory_bandwidth"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    figure = json.loads(line.removeprefix(probes.MARK))["figures"][0]
    assert figure["check"] == "memory_bandwidth" and figure["unit"] == "GB/s" and figure["value"] > 0.1


def test_the_probes_load_nothing_but_the_standard_library() -> None:
    """The probe module starts on every checked host, a throttled one too: no orchestration,
    protobuf, numpy or torch at load."""
    out = subprocess.run([sys.executable, "-c", "import json, sys, rankscope.healing.probes; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    loaded = set(json.loads(out))
    assert {m for m in loaded if m.startswith("rankscope")} == {"rankscope", "rankscope.healing", "rankscope.healing.probes"}
    assert not loaded & {"google.protobuf", "numpy", "torch"}


def test_the_link_probe_measures_a_server_and_contacts_nothing_outside_the_test_bed() -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "rankscope.healing.probes", "--serve-links", "--bind", "127.0.0.1", "--for", "30"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = json.loads(server.stdout.readline().removeprefix(probes.MARK))["port"]  # type: ignore[union-attr]
        probe = [sys.executable, "-m", "rankscope.healing.probes", "--probe", "links", "--seconds", "0.1", "--allow", "10.200.0.0/24", "--allow", "127.0.0.0/8"]
        answer = run_on(LocalRunner(), "me", [*probe, "--peer", f"me=127.0.0.1:{port}", "--peer", "far=8.8.8.8:53"], timeout_s=30)
    finally:
        server.kill()
        server.wait()
    near, far = (json.loads(line.removeprefix(probes.MARK)) for line in answer.stdout.splitlines())
    mbit, rtt = near["figures"]
    assert (mbit["check"], rtt["check"]) == ("link_throughput:me", "link_rtt:me")
    assert mbit["value"] > 10 and 0 < rtt["value"] < 100
    assert far["checks"] == ["link_throughput:far", "link_rtt:far"] and "contacts only 10.200.0.0/24, 127.0.0.0/8" in far["error"]


def test_the_command_checks_this_machine_alone_without_peers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selfcheck", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (host,) = out["hosts"]
    assert out["passed"] and not host["judged"] and "no peers to compare with" in host["summary"]
    values = {f["check"]: f["value"] for f in host["figures"]}
    assert set(values) == {"matmul", "memory_bandwidth", "loopback_allreduce"} and all(v > 0 for v in values.values())


# --- the command line ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--run", "r1"], "--collector and --run go together"),
        (["--factor", "1"], "argument --factor: must be more than 1 and finite, got 1"),
        (["--ranks-per-host", "1"], "argument --ranks-per-host: must be at least 2, got 1"),
        (["--testbed", "rs-none"], "no test bed 'rs-none'"),
    ],
)
def test_bad_input_is_refused_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["selfcheck", *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rankscope selfcheck: error: ") and message in err
    assert err.rstrip().endswith("(see rankscope selfcheck --help)")


def test_the_table_has_a_row_per_figure_and_a_verdict_line_per_host() -> None:
    report = judge({"node0": local(), "node1": local(matmul=20.0), "node2": local()})
    lines = cli.table(report).splitlines()
    assert lines[0].split() == ["host", "check", "value", "unit", "peers'", "median", "ok"]
    assert lines[4].split() == ["node1", "matmul", "20", "GFLOP/s", "100", "FAIL"]
    assert lines[-3:] == [
        "node0 PASS: every figure within 2x of its peers' median",
        "node1 FAIL: matmul 20 GFLOP/s is 0.20x the peers' median 100",
        "node2 PASS: every figure within 2x of its peers' median",
    ]  # fmt: skip
    assert cli.table(judge({"vm": local()})).splitlines()[-1] == "vm not judged: no peers to compare with: 3 figures measured, every test ran"


def test_the_command_defaults_are_the_apis() -> None:
    assert (cli.TIMEOUT_S, cli.FACTOR) == (selfcheck.TIMEOUT_S, verdict.FACTOR)
    assert "torch" not in subprocess.run([sys.executable, "-c", "import sys, rankscope.cli.selfcheck; print(sorted(sys.modules))"],
                                         capture_output=True, text=True, check=True).stdout  # fmt: skip


# --- a real test bed -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.foreground
@pytest.mark.timeout(240)
def test_a_frozen_host_fails_on_a_timeout_and_its_links_are_not_judged(testbed: testbed_hosts.Testbed) -> None:
    """A throttled host failing on matmul, and only that host, is docs/selfcheck.md's run as written
    (tests/test_docs.py expects its verdict lines)."""
    from rankscope.testbed import host_faults as faults

    runner = TestbedRunner(testbed)
    names = runner.hosts
    assert run_on(runner, "node1", ["hostname"], timeout_s=10).stdout == "node1\n"  # the command runs inside the host
    frozen = faults.freeze_host(testbed.host("node2"))
    try:
        began = time.monotonic()
        report = check_hosts(names, runner, timeout_s=8)
        took = time.monotonic() - began
    finally:
        frozen.undo()
    # node0 and node1 are only judged against each other here, on a machine others load too: not asserted
    assert "node2" in report.failed and all(not math.isnan(report.host(h).figure("matmul").value) for h in ("node0", "node1")), cli.table(report)
    assert report.host("node2").figure("memory_bandwidth").detail == "no answer in 8 s"
    assert report.host("node0").figure("link_rtt:node2").detail == "not judged: node2 gave no answer to memory_bandwidth in 8 s"
    assert re.fullmatch(r"not run: node2 gave no answer to memory_bandwidth in 8 s", report.host("node2").figure("matmul").detail)
    assert report.host("node2").elapsed_s < 8 + 3 and took < 45, (report.host("node2").elapsed_s, took)
