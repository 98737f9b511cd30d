"""Where the suite's time goes, and what a stuck test was doing: a pytest plugin (tests/conftest.py loads it).

- Each test's wall time and the CPU time spent for it (pytest's own and that of the child processes
  it started and reaped), setup and teardown included, so a shared fixture's cost shows on the test
  that made it. A test that is busy for little of its wall time is waiting: on a timer, a poll or a
  sleep. The figures are taken where the test runs (an xdist worker, tests/suite_lanes.py) and travel
  with its teardown report to the pytest that prints them. At the end the slowest tests are printed,
  and every test's figures are written to ``test-artifacts/durations.json`` (docs/architecture.md's
  table is made from it).
- A test stopped by its deadline (pytest-timeout) fails with the Python stacks of the processes it
  left running (py-spy), not only with pytest's own: what a stuck child waits on is what one needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Generator
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from rankscope.common.processes import process_tree

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "test-artifacts" / "durations.json"
SHOWN = 15  # slowest tests printed at the end
STACKS_OF = 12  # at most this many child processes dumped for a timed-out test
PY_SPY = Path(sys.executable).parent / "py-spy"


@dataclass
class Spent:
    nodeid: str
    wall_s: float
    cpu_s: float  # this process and the children it reaped, during the test
    started: float  # when its setup began (Unix time): where it sat in the run, beside what ran on the other worker
    worker: str  # the xdist worker that ran it ("" without xdist)
    outcome: str

    @property
    def busy(self) -> float:
        """CPU seconds per wall second (2.0: both cores busy throughout; near 0: the test waited)."""
        return self.cpu_s / self.wall_s if self.wall_s else 0.0


_spent: list[Spent] = []
_outcomes: dict[str, str] = {}  # node id -> its worst phase outcome so far
_started = time.monotonic()
_gathers = True  # False on an xdist worker: its reports go to the pytest that hands out the tests
CLOCK = pytest.StashKey[tuple[float, float, float]]()
PROPERTY = "suite_clock"  # the teardown report's user property carrying (wall s, CPU s, start time, worker)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def pytest_configure(config: pytest.Config) -> None:
    global _gathers
    _gathers = not hasattr(config, "workerinput")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    item.stash[CLOCK] = (time.monotonic(), _cpu(), time.time())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed and call.excinfo is not None and str(call.excinfo.value).startswith("Timeout (>"):
        report.sections.append(("stacks of the test's child processes (py-spy)", _child_stacks()))
    if report.when == "teardown" and CLOCK in item.stash:  # the figures travel with the report (xdist sends it on)
        wall, cpu, started = item.stash[CLOCK]
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        report.user_properties.append((PROPERTY, (time.monotonic() - wall, _cpu() - cpu, started, worker)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _gathers:
        return
    nodeid = report.nodeid
    if report.outcome != "passed" and _outcomes.get(nodeid, "passed") == "passed":
        _outcomes[nodeid] = report.outcome
    for name, value in report.user_properties:
        if name == PROPERTY:
            _spent.append(Spent(nodeid, *value, _outcomes.pop(nodeid, "passed")))


def _child_stacks() -> str:
    """py-spy's dump of each process below this one (the test's collectors, trainers, ranks), newest last."""
    me = os.getpid()
    pids = sorted(pid for pid in process_tree(me) if pid != me)
    if not pids:
        return "no child process was running"
    if not PY_SPY.exists():  # a dependency of rankscope: beside this interpreter in an installed venv
        return f"py-spy is not installed beside {sys.executable}: children still running: {pids}"
    dumps = []
    for pid in pids[-STACKS_OF:]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        try:
            done = subprocess.run([str(PY_SPY), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=15)
            text = done.stdout or done.stderr
        except subprocess.TimeoutExpired:
            text = "py-spy dump took over 15 s"
        dumps.append(f"--- pid {pid}: {cmdline[:200]}\n{text.strip()}")
    skipped = len(pids) - STACKS_OF
    return "\n".join(dumps + ([f"({skipped} older child processes not dumped)"] if skipped > 0 else []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _spent:
        return
    slowest = sorted(_spent, key=lambda s: s.wall_s, reverse=True)
    total_wall = sum(s.wall_s for s in _spent)
    total_cpu = sum(s.cpu_s for s in _spent)
    write = terminalreporter.write_line
    terminalreporter.section(f"the {min(SHOWN, len(slowest))} slowest tests (setup and teardown included)")
    write(f"{'wall s':>8} {'cpu s':>8} {'busy':>5}  test")
    for s in slowest[:SHOWN]:
        write(f"{s.wall_s:8.1f} {s.cpu_s:8.1f} {s.busy:5.2f}  {s.nodeid}")
    write(f"{total_wall:8.1f} {total_cpu:8.1f} {total_cpu / total_wall if total_wall else 0:5.2f}  all {len(_spent)} tests")
    write(f"{time.monotonic() - _started:8.1f} {'':8} {'':5}  from the start of the session to here (tests run side by side under xdist)")
    try:
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(json.dumps([asdict(s) | {"busy": round(s.busy, 3)} for s in slowest], indent=1))
    except OSError as e:  # a read-only checkout: the table above is still printed
        write(f"could not write {REPORT}: {e}")
