"""The process-safety fixtures in conftest.py really leave no process behind."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import TERM_GRACE_S, running, use_this_conftest

# A child that starts three grandchildren: one in its own process group, one in a new session
# (as torchrun starts its workers), one that ignores SIGTERM (needs the SIGKILL), then writes
# all their pids to a file and waits.
SPAWNER = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ignoring', flush=True); time.sleep(1000)")
    kids = [
        subprocess.Popen(["sleep", "1000"]),
        subprocess.Popen(["sleep", "1000"], start_new_session=True),
        subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE),
    ]
    kids[2].stdout.readline()  # SIGTERM is ignored from here on
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump([os.getpid()] + [k.pid for k in kids], f)
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    print("ready", flush=True)
    time.sleep(1000)
    """
)


def _wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written in {timeout} s"
        time.sleep(0.05)


def test_cleanup_kills_group_and_escaped_descendants(proc_runner, tmp_path: Path) -> None:
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    pidfile = tmp_path / "pids.json"
    proc_runner.term_grace_s = 0.5
    proc = proc_runner.start([sys.executable, str(script), str(pidfile)])
    proc.wait_for("ready", timeout=30)
    pids = json.loads(pidfile.read_text())
    assert all(running(pid) for pid in pids)
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)  # its own process group

    start = time.monotonic()
    proc_runner.cleanup()
    elapsed = time.monotonic() - start
    assert [pid for pid in pids if running(pid)] == []
    assert proc.returncode is not None
    # the SIGTERM-proof grandchild held out for the whole 0.5 s grace, then SIGKILL ended it at once:
    # well before the default grace would have run out
    assert 0.5 <= elapsed < TERM_GRACE_S, elapsed
    proc_runner.cleanup()  # idempotent


def test_output_goes_to_files_and_wait_reports_status(proc_runner) -> None:
    code = "import sys; print('x' * 200_000); print('err', file=sys.stderr); sys.exit(3)"
    proc = proc_runner.start([sys.executable, "-c", code], name="chatty")
    assert proc.wait(timeout=30) == 3  # 200 kB would fill a pipe; files do not
    assert proc.returncode == 3
    assert len(proc.stdout) == 200_001 and proc.stderr == "err\n"
    assert "--- chatty stderr ---\nerr" in proc.output()
    with pytest.raises(TimeoutError, match="still running"):
        proc_runner.start(["sleep", "1000"]).wait(timeout=0.1)


def test_pytest_timeout_still_kills_children(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """A test killed by pytest-timeout (method "signal") fails with its children's stacks, then the fixture teardown still runs."""
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    pidfile = tmp_path / "pids.json"
    use_this_conftest(pytester)
    pytester.makeini("[pytest]\ntimeout_method = signal\n")
    pytester.makepyfile(
        f"""
        import sys, time, pytest

        @pytest.mark.timeout(2)
        def test_hangs(proc_runner):
            proc_runner.term_grace_s = 0.5
            proc = proc_runner.start([sys.executable, {str(script)!r}, {str(pidfile)!r}])
            proc.wait_for("ready", timeout=30)
            time.sleep(1000)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    _wait_for_file(pidfile, timeout=1)
    pids = json.loads(pidfile.read_text())
    assert len(pids) == 4
    # what the stuck child was doing: its own stack, dumped before the teardown killed it
    result.stdout.fnmatch_lines(["*Timeout*", "*stacks of the test's child processes (py-spy)*",
                                 f"--- pid {pids[0]}: *spawner.py*", "*<module> (spawner.py:*"])
    # and the session ends with the slowest tests' wall and CPU time (tests/suite_clock.py)
    result.stdout.fnmatch_lines(["*the 1 slowest tests (setup and teardown included)*", "*wall s*cpu s*busy*test",
                                 "*test_hangs", "*all 1 tests"])
    assert [pid for pid in pids if running(pid)] == []


WORKER = textwrap.dedent(
    """
    import os, sys, time
    rank = os.environ["RANK"]
    with open(os.path.join(sys.argv[1], f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} threads {os.environ['OMP_NUM_THREADS']}", flush=True)
    time.sleep(1000)
    """
)


@pytest.mark.slow
def test_torchrun_workers_die_with_the_test(torchrun, proc_runner, tmp_path: Path) -> None:
    """torchrun puts each worker in a session of its own: teardown must still reach them."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = torchrun([str(script), str(tmp_path)], nproc=2)
    for rank in (0, 1):
        _wait_for_file(tmp_path / f"rank{rank}.pid", timeout=120)
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in (0, 1)]
    assert all(running(pid) for pid in pids)
    assert os.getpgid(pids[0]) != proc.pid  # really outside torchrun's group
    proc_runner.cleanup()
    assert [pid for pid in pids if running(pid)] == []


LANE_PROBE = """
import os, subprocess, sys, pytest

def where():
    # what a child started by the test inherits: its nice value and its cpu cgroup
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0)); print(open('/proc/self/cgroup').read())"],
                         capture_output=True, text=True, check=True).stdout.split("\\n", 1)
    cpu = [line.split(":", 2)[2] for line in out[1].splitlines() if line and "cpu" in line.split(":")[1].split(",")]
    return int(out[0]), cpu[0]

@pytest.mark.foreground
def test_timing():
    print("LANE foreground", *where(), os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.foreground
def test_timing_too():
    print("LANE foreground", *where(), os.environ["PYTEST_XDIST_WORKER"])

def test_other_a():
    print("LANE background", *where(), os.environ["PYTEST_XDIST_WORKER"])

def test_other_b():
    print("LANE background", *where(), os.environ["PYTEST_XDIST_WORKER"])
"""


def test_the_timing_tests_run_in_the_foreground_lane_and_the_rest_yield(pytester: pytest.Pytester) -> None:
    """Under two xdist workers, the tests marked foreground run on one worker, and they and what they
    start run at nice 0 in the foreground cgroup (weight 1024), the others at nice 15 in the
    background one (weight 36); the groups go with the run (tests/suite_lanes.py)."""
    use_this_conftest(pytester)
    pytester.makepyfile(test_lanes=LANE_PROBE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "-rA")
    result.assert_outcomes(passed=4)
    seen = sorted(line.split()[1:] for line in result.outlines if line.startswith("LANE "))
    assert [(lane, int(nice)) for lane, nice, _, _ in seen] == [("background", 15)] * 2 + [("foreground", 0)] * 2, result.outlines
    assert len({worker for lane, _, _, worker in seen if lane == "foreground"}) == 1, seen  # one after the other
    if os.geteuid() == 0 and Path("/sys/fs/cgroup/cpu").is_dir():
        groups = {lane: group for lane, _, group, _ in seen}
        assert groups["foreground"].endswith("/foreground") and groups["background"].endswith("/background"), seen
        assert Path(groups["foreground"]).parent == Path(groups["background"]).parent  # one run's groups
        suite = Path("/sys/fs/cgroup/cpu") / Path(groups["foreground"]).parent.relative_to("/")
        assert not suite.exists(), "the run's lane groups outlived it"
