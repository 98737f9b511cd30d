"""Two lanes on two cores: the timing tests run one at a time at full weight, the rest in their shadow
(a pytest plugin; tests/conftest.py loads it).

`make test` runs pytest with two xdist workers (``-n 2 --dist loadgroup``). Each test runs in one
of two lanes:

- the foreground lane: the tests marked ``foreground``, whose checks depend on how fast ranks and
  hosts run next to each other (stragglers, throttled hosts, slow links, the self-check's verdicts,
  the docs pages that show them and take the default ports). They form one xdist group, handed out
  first: one worker runs them one after another, never two at once;
- the background lane: every other test, taken by whichever worker is free, the groups with slow
  tests first; a module whose tests share a module- or session-scoped fixture is one group (its
  fixture is made once per lane that uses it: tests that share an expensive one are marked alike).

Before each test a worker joins its lane's cpu cgroup (v1: ``cpu.shares`` 1024 in the foreground,
36, nice 15's weight, in the background) and takes the lane's nice value. What a background test
starts (its collector, its ranks, the hosts of its test bed: their groups nest in their maker's)
gets the CPU the foreground leaves idle and yields it within a scheduler tick when the foreground
wants it, so a foreground test runs as it would alone. Without root or cgroup v1 only the nice
value is set (children in sessions of their own then escape it: the kernel's autogroups).

A background test that fails is run once more (pytest-rerunfailures' ``flaky`` mark, added here):
its lane gets about 3% of a core while the foreground is busy, and a bound of its waits that
holds on an idle machine can run out in a long foreground burst (a query unanswered for 30 s, a
TLS handshake, three diagnosis passes: one such failure in most whole runs, a different test each
time). The first attempt's failure is printed (``--rerun-show-tracebacks``) and counted in the
summary line. A foreground test is never run again: its checks are the timing ones; nor a test that
shares a fixture with others (a collector of its module): its first attempt's runs are still in it.

Without xdist (``pytest`` alone, or ``-n 0``) nothing here acts: tests run in file order, at the
priority pytest was started with.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

FOREGROUND, BACKGROUND = "foreground", "background"
NICE = {FOREGROUND: 0, BACKGROUND: 15}
SHARES = {FOREGROUND: 1024, BACKGROUND: 36}  # the kernel's weights of nice 0 and nice 15
BACKGROUND_RERUNS = 1  # how many more times a failed background test runs
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
SUITE_GROUP = "rankscope-suite-"  # + the pid of the pytest that hands out the tests
LANE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "foreground: what the test checks depends on relative speed: it runs in the foreground lane (tests/suite_lanes.py)"
    )
    if not _worker(config) and _distributed(config):
        _remove_groups(stale_only=True)


def _worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _distributed(config: pytest.Config) -> bool:
    return config.getoption("dist", "no") != "no"


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture of the suite's that outlives it (module- or session-scoped):
    its module's tests then go to one worker, which makes the fixture once."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return True
    tests = Path(__file__).parent
    return any(d.scope != "function" and Path(inspect.getfile(d.func)).parent == tests for defs in info.name2fixturedefs.values() for d in defs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _worker(config):
        return
    groups = {}
    for item in items:
        item.stash[LANE] = FOREGROUND if item.get_closest_marker(FOREGROUND) else BACKGROUND
        if item.stash[LANE] == BACKGROUND and not _shares_a_fixture(item) and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=BACKGROUND_RERUNS))
        groups[item.nodeid] = FOREGROUND if item.stash[LANE] == FOREGROUND else _module(item) if _shares_a_fixture(item) else item.nodeid
    slow = {groups[i.nodeid] for i in items if i.get_closest_marker("slow")}
    # stable: the foreground group is handed out first, then the groups with slow tests (a short test ends the run)
    items.sort(key=lambda i: (i.stash[LANE] != FOREGROUND, groups[i.nodeid] not in slow))
    path = _groups_file(os.getppid())  # both workers write the same: the last rename wins
    partial = path.with_suffix(f".{os.getpid()}")
    partial.write_text(json.dumps(groups))
    partial.replace(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduler by groups, with the groups the workers wrote at collection (xdist's own
    ``xdist_group`` marks are lost on pytest 9.2: pytest-xdist#1386)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once the workers have collected (they wrote it first)
                self.groups = json.loads(_groups_file(os.getpid()).read_text())
            return self.groups.get(nodeid) or nodeid.split("::", 1)[0]

    return LaneScheduling(config, log)


def _groups_file(pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"{SUITE_GROUP}{pid}.json"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    lane = item.stash.get(LANE, None)
    if lane is None:
        return
    with contextlib.suppress(PermissionError):  # lowering a nice value back needs root
        os.setpriority(os.PRIO_PROCESS, 0, NICE[lane])
    if group := _lane_group(lane):
        (group / "cgroup.procs").write_text(str(os.getpid()))


def _lane_group(lane: str) -> Path | None:
    """The lane's cpu cgroup of this test run (made on first use), or None where none can be made."""
    group = CPU_CGROUPS / f"{SUITE_GROUP}{os.getppid()}" / lane  # a worker's parent hands out the tests
    try:
        if not group.is_dir():
            group.mkdir(parents=True, exist_ok=True)
            (group / "cpu.shares").write_text(str(SHARES[lane]))
        return group
    except OSError:
        return None


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _worker(config) and _distributed(config):
        _remove_groups(stale_only=False)
        _groups_file(os.getpid()).unlink(missing_ok=True)


def _remove_groups(*, stale_only: bool) -> None:
    """Remove this run's lane groups once its workers are gone (stale_only: those of runs whose pytest is gone).
    A group that still holds a process (one a test left behind) stays."""
    for suite in CPU_CGROUPS.glob(f"{SUITE_GROUP}*") if CPU_CGROUPS.is_dir() else []:
        pid = suite.name.removeprefix(SUITE_GROUP)
        if (stale_only and Path(f"/proc/{pid}").exists()) or (not stale_only and pid != str(os.getpid())):
            continue
        for group in [*(p for p in suite.iterdir() if p.is_dir()), suite]:
            with contextlib.suppress(OSError):
                group.rmdir()
