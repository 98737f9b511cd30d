"""Shared test infrastructure: child processes that can never outlive their test.

Every multi-process test starts its processes through the ``proc_runner`` fixture (or the
``torchrun`` fixture built on it). Each child gets its own process group
(``start_new_session=True``); at teardown, which also runs when the test fails or
pytest-timeout fires (method "signal", set in pyproject.toml), the runner sends SIGTERM to the
group and to every descendant (torchrun puts each worker in a session of its own, so killing
torchrun's group alone would miss them), waits up to 5 s, then sends SIGKILL. Output goes to
files under ``tmp_path``, so a chatty child never blocks on a full pipe.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rankscope.harness.orchestration import CLI, free_port, listen_address, metrics_url
from rankscope.common.processes import terminate_tree
from rankscope.testbed.hosts import Testbed
from rankscope.trainer import torchrun_launcher

pytest_plugins = ("pytester", "suite_clock", "suite_lanes")  # pytester: tests/test_infra.py runs pytest inside a test

TERM_GRACE_S = 5.0
ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"  # training scripts that know nothing about rankscope
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
#: what a source copy for a wheel leaves out: version control, environments, build outputs, local data, the tests
WHEEL_SOURCE_SKIP = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    "rankscope-data", "test-artifacts", ".whl", ".gl", "tests", "benchmarks",
)
#: for processes of an installed wheel: the suite's PYTHONPATH may point at this source tree, which would
#: shadow the wheel's rankscope (Python ignores an empty PYTHONPATH)
OFF_THIS_TREE = {"PYTHONPATH": ""}


__all__ = ["OFF_THIS_TREE", "Proc", "ProcRunner", "Running", "build_wheel", "by_speed", "free_port", "make_testbed", "running", "start_collector",
           "use_this_conftest"]

#: incident kinds found by comparing how fast ranks run next to each other; None: a healthy run,
#: where no false alarm may appear
RELATIVE_SPEED = {None, "straggler", "slow_link"}


def by_speed(value: Any, name: str, kind: str | None) -> Any:
    """A scenario's test case, in the foreground lane (tests/suite_lanes.py) when what it expects
    (``kind``) is read from relative speed; a hang, a crash or a lost host is not."""
    return pytest.param(value, id=name, marks=[pytest.mark.foreground] if kind in RELATIVE_SPEED else [])


class Proc:
    """One started child: its exit status and the output it has written so far."""

    def __init__(self, popen: subprocess.Popen[bytes], name: str, stdout_path: Path, stderr_path: Path, runner: ProcRunner):
        self.popen = popen
        self.runner = runner
        self.name = name
        self.stdout_path = stdout_path
        self.stderr_path = stderr_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """Exit status, or None while the process runs (negative: killed by that signal)."""
        return self.popen.poll()

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def output(self, tail: int | None = 8000) -> str:
        """stdout and stderr so far, labelled, the last `tail` characters of each: for assertion messages."""
        out, err = self.stdout, self.stderr
        if tail is not None:
            out, err = out[-tail:], err[-tail:]
        return f"--- {self.name} stdout ---\n{out}\n--- {self.name} stderr ---\n{err}"

    def wait(self, timeout: float | None = None) -> int:
        """Wait for exit and return the status; TimeoutError (with the output) if it runs on."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} still running after {timeout} s\n{self.output()}") from None

    def wait_for(self, text: str, timeout: float) -> None:
        """Wait until `text` appears in stdout or stderr (e.g. a server's "listening" line)."""
        deadline = time.monotonic() + timeout
        while True:
            if text in self.stdout or text in self.stderr:
                return
            if self.returncode is not None:
                raise AssertionError(f"{self.name} exited ({self.returncode}) before printing {text!r}\n{self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not print {text!r} in {timeout} s\n{self.output()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGTERM the process, its group and its descendants; SIGKILL what is left after the grace time."""
        terminate_tree(self.popen, self.runner.term_grace_s)


class ProcRunner:
    """Starts children in their own process groups and kills them all at teardown."""

    def __init__(self, tmp_path: Path):
        self.log_dir = tmp_path / "procs"
        self.procs: list[Proc] = []
        self.term_grace_s = TERM_GRACE_S  # seconds between SIGTERM and SIGKILL at teardown

    def start(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        name: str | None = None,
    ) -> Proc:
        """Start `args`; `env` is added to (not instead of) os.environ; output goes to files."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        name = name or f"{Path(args[0]).name}-{len(self.procs)}"
        stdout_path = self.log_dir / f"{name}.out"
        stderr_path = self.log_dir / f"{name}.err"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            popen = subprocess.Popen(
                list(args),
                env=full_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        proc = Proc(popen, name, stdout_path, stderr_path, self)
        self.procs.append(proc)
        return proc

    def torchrun(
        self,
        args: Sequence[str],
        nproc: int,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> Proc:
        """``torchrun --standalone --nproc-per-node N args...`` with this interpreter (``rankscope.trainer.torchrun_launcher``:
        the same agent, started with less CPU).

        --standalone makes torchrun pick a free rendezvous port itself, so parallel tests do
        not collide. OMP_NUM_THREADS=1 keeps N ranks from oversubscribing the two cores.
        """
        cmd = torchrun_launcher.command("--standalone", f"--nproc-per-node={nproc}", *args)
        return self.start(cmd, env={"OMP_NUM_THREADS": "1", **(env or {})}, name=name or f"torchrun-{len(self.procs)}")

    def cleanup(self) -> None:
        """Kill every started process tree (idempotent; the fixture calls it at teardown)."""
        for proc in self.procs:
            terminate_tree(proc.popen, self.term_grace_s)



def use_this_conftest(pytester: pytest.Pytester) -> None:
    """Give a pytest run inside a test this conftest.py and the plugins it loads (tests/suite_*.py)."""
    here = Path(__file__).parent
    pytester.makeconftest((here / "conftest.py").read_text())
    pytester.makepyfile(**{p.stem: p.read_text() for p in here.glob("suite_*.py")})


def running(pid: int) -> bool:
    """True while pid exists and is not a zombie (orphans may stay zombies a while)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@dataclass
class Running:
    """A started collector: its process, gRPC address, metrics URL (when asked for) and store directory."""

    proc: Proc
    target: str
    metrics_url: str | None
    store: Path


def start_collector(
    runner: ProcRunner, store: Path, *flags: str, listen: str = "127.0.0.1:0", name: str = "collector", timeout: float = 90
) -> Running:
    """``rankscope collector --store STORE --listen LISTEN FLAGS...``, once it listens."""
    proc = runner.start([*CLI, "collector", "--store", str(store), "--listen", listen, *flags], name=name)
    proc.wait_for("listening on", timeout)
    line = next(text for text in proc.stdout.splitlines() if "listening on" in text)
    return Running(proc, listen_address(line) or "", metrics_url(line), store)


def incidents(address: str, run_id: str, until: Callable[[list[dict], Any], bool], timeout_s: float) -> list[dict]:
    """Poll a run's incidents until ``until(incidents, client)`` holds (or time runs out); returns the last answer."""
    from rankscope.collector.client import Client
    from rankscope.common.incidents import INCIDENTS_SQL

    with Client(address) as client:
        deadline = time.monotonic() + timeout_s
        while True:
            found = client.query(INCIDENTS_SQL, {"run": run_id}).to_pylist()
            if until(found, client) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


def build_wheel(workdir: Path, probes: Iterable[str] = ()) -> tuple[Path, Path]:
    """(source copy, wheel): rankscope's wheel built from a copy of the source tree under ``workdir``, so
    the build leaves nothing in the work tree; ``probes`` (paths in the tree) are added to the copy as
    placeholder files."""
    src = workdir / "src"
    shutil.copytree(ROOT, src, ignore=WHEEL_SOURCE_SKIP)
    for name in probes:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text("# probe\n" if name.endswith(".py") else "probe\n")
    out = workdir / "out"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", str(src), "-w", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    (wheel,) = out.glob("rankscope-*.whl")
    return src, wheel


@pytest.fixture(scope="session")
def wheel_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """rankscope's wheel as released (no probe files), built once per session."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))[1]


@pytest.fixture
def proc_runner(tmp_path: Path) -> Iterator[ProcRunner]:
    """A ProcRunner whose processes are all killed when the test ends, however it ends."""
    runner = ProcRunner(tmp_path)
    try:
        yield runner
    finally:
        runner.cleanup()


@pytest.fixture
def torchrun(proc_runner: ProcRunner) -> Callable[..., Proc]:
    """``torchrun(args, nproc, env=None) -> Proc``: ProcRunner.torchrun bound to this test."""
    return proc_runner.torchrun


@pytest.fixture
def starve() -> Iterator[Callable[[int, float], Path]]:
    """``starve(pid, share)``: the process's CPU cut to ``share`` of a core, from outside (a cpu cgroup
    nested in its own, whose quota a sibling of it on the host would not feel); undone at teardown, or
    before by ``release_starved``. Returns the cgroup (its ``cpu.stat`` tells how often the quota held
    the process back)."""
    made: list[Path] = []

    def cut(pid: int, share: float) -> Path:
        own = next((line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                    if "cpu" in line.split(":", 2)[1].split(",")), None)  # fmt: skip
        if own is None or not os.access(CPU_CGROUPS, os.W_OK):
            pytest.skip("no writable cpu cgroup (v1) here")
        group = CPU_CGROUPS / own.lstrip("/") / f"starved-{pid}"
        group.mkdir()
        made.append(group)
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(share * 100000))))  # the kernel's least quota: 1 ms
        (group / "cgroup.procs").write_text(str(pid))
        return group

    yield cut
    for group in made:
        release_starved(group)
        group.rmdir()


def release_starved(group: Path) -> None:
    """The processes of a starving cgroup back into its parent: their CPU is theirs again."""
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            (group.parent / "cgroup.procs").write_text(pid)
        except ProcessLookupError:
            pass


def make_testbed(hosts: int, ranks_per_host: int = 1) -> Iterator[Testbed]:
    """A test bed of ``hosts`` namespace hosts, destroyed however the test ends; skips where none can be made."""
    from rankscope.testbed import hosts as testbed_hosts

    try:
        bed = testbed_hosts.create(hosts, ranks_per_host=ranks_per_host)
    except testbed_hosts.TestbedError as e:
        pytest.skip(f"no test bed on this machine: {e}")
    try:
        yield bed
    finally:
        testbed_hosts.destroy(bed.name)


@pytest.fixture
def testbed() -> Iterator[Testbed]:
    """Three namespace hosts of one rank each (see ``make_testbed`` for other sizes)."""
    yield from make_testbed(3)


@pytest.fixture(scope="module")
def module_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcRunner]:
    """A ProcRunner shared by a module's tests (runs shared between assertions), cleaned up after the module."""
    runner = ProcRunner(tmp_path_factory.mktemp("module-procs"))
    try:
        yield runner
    finally:
        runner.cleanup()


@pytest.fixture(scope="session")
def straggler_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(work directory, score) of the straggler-1.5 scenario, run once for the whole session: a real
    collector and an 8-rank ``rankscope train`` with rank 5 1.5x slower. Its diagnosis, the SQL cookbook
    and the dashboard pages all read this one recorded run; the collector has stopped, the store is kept."""
    from rankscope.harness import local_scenarios as scenarios

    workdir = tmp_path_factory.mktemp("straggler-run")
    return workdir, scenarios.run(scenarios.SCENARIOS["straggler-1.5"], workdir=workdir, log=lambda line: None)

