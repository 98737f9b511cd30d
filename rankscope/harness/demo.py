"""The demo: a collector on the embedded store, the dashboard and an 8-rank CPU training run that
develops a straggler and later hangs, with progress and incidents printed as they happen.

Everything runs as child processes started through ``orchestration`` (as the fault scenarios
do). Ctrl-C or SIGTERM stops them in order: training, dashboard, then the collector with SIGTERM
so that it writes every buffer; the store stays for ``rankscope sql --store`` and
``rankscope diagnose --store`` (chDB lets one process hold a store, so only after the collector
is gone).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rankscope.common.incidents import INCIDENTS_SQL, headline
from rankscope.harness.orchestration import CLI, agent_env, collector_command, host_of, start, stop, wait_for_address
from rankscope.common.fault_spec import Fault, parse

if TYPE_CHECKING:
    from rankscope.collector.client import Client

WORLD_SIZE = 8
TRAIN_FLAGS = ("--tp", "2", "--pp", "2", "--dp", "2")
STRAGGLER_FACTOR = 1.5
STRAGGLER_FROM_STEP = 5
#: the smallest --steps that leaves the default straggler time to be found before the hang
MIN_DEFAULT_STEPS = 12
#: seconds the diagnosis gets after the run ended, before a demo without dashboard stops
FINAL_PASSES_S = 6.0
LATEST_STEP_SQL = (
    "SELECT step, avgIf(value, name = 'step_time_s') AS step_time_s, maxIfOrNull(value, name = 'loss') AS loss "
    "FROM step_metrics WHERE run_id = {run:String} GROUP BY step ORDER BY step DESC LIMIT 1"
)
FOLLOW_UP_SQL = "SELECT kind, ranks, hosts, summary FROM incidents FINAL WHERE run_id = {run:String} ORDER BY first_seen"


class DemoError(RuntimeError):
    """A process of the demo could not start; the message says which and why."""


@dataclass(frozen=True)
class DemoOptions:
    """What ``rankscope demo`` was asked for (validated by the command line)."""

    store: Path
    steps: int
    inject: str
    #: ``inject`` parsed and checked (``check_faults``)
    faults: list[Fault]
    listen: str
    #: the dashboard's HTTP port, or None for no dashboard (then the demo ends with the run)
    dashboard_port: int | None
    hang_after_s: float
    #: how the follow-up commands are spelt (``rankscope``, or the path it was run by)
    command: str = "rankscope"


def default_faults(steps: int, straggler_rank: int, hang_rank: int) -> str:
    """The demo's story: a straggler from step 5, then a hang of another rank three quarters in."""
    if steps < MIN_DEFAULT_STEPS:
        raise ValueError(f"the default straggler and hang need --steps {MIN_DEFAULT_STEPS} or more (or give --inject)")
    if straggler_rank == hang_rank:
        raise ValueError(f"the straggler and the hung rank must differ (both are {hang_rank})")
    return (
        f"straggler:rank={straggler_rank},factor={STRAGGLER_FACTOR},from_step={STRAGGLER_FROM_STEP};"
        f"hang:rank={hang_rank},step={steps * 3 // 4}"
    )


def check_faults(spec: str, steps: int) -> list[Fault]:
    """Parse and check a fault spec against the demo's 8 ranks and ``steps`` (FaultSpecError if wrong)."""
    faults = parse(spec)
    for fault in faults:
        fault.check_ranks(WORLD_SIZE, steps)
    return faults


def run(options: DemoOptions, out: Callable[[str], None]) -> int:
    """Run the demo until the run is over (no dashboard) or Ctrl-C / SIGTERM; 0 once all is stopped.

    DemoError when a process cannot start; every process started is stopped in any case.
    """
    if options.dashboard_port is not None:
        _check_port_free(options.dashboard_port)  # before anything runs: a clear error, nothing to undo
    demo = _Demo(options, out)
    with _stops_as_interrupt():
        try:
            demo.start()
            demo.watch()
        except KeyboardInterrupt:
            out("")
            out("stopping every process the demo started ...")
        finally:
            with _signals_ignored():  # a second Ctrl-C must not leave half of it running
                demo.shutdown()
    demo.follow_ups()
    return 0


class _Demo:
    """One demo: the processes it started (to stop them in order) and the run it watches."""

    def __init__(self, options: DemoOptions, out: Callable[[str], None]) -> None:
        self.options = options
        self.out = out
        self.faults = options.faults
        self.run_id = f"demo-{uuid.uuid4().hex[:8]}"
        self.logs = Path(tempfile.mkdtemp(prefix="rankscope-demo-"))
        self.store = options.store.resolve()
        self.started = time.monotonic()
        self.collector: subprocess.Popen[bytes] | None = None
        self.dashboard: subprocess.Popen[bytes] | None = None
        self.training: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.client: Client | None = None

    def say(self, line: str) -> None:
        """A line stamped with the seconds since the demo started, so that delays read off directly."""
        self.out(f"[{time.monotonic() - self.started:5.0f} s] {line}")

    # -- start -------------------------------------------------------------------------------

    def start(self) -> None:
        o = self.options
        self.say(f"logs in {self.logs}")
        self.collector = start(collector_command(self.store, o.listen, o.hang_after_s), self.logs / "collector.log", os.environ)
        try:
            self.address = wait_for_address(self.collector, self.logs / "collector.log")
        except RuntimeError as e:
            raise DemoError(f"{e}\n(is another collector using {self.store} or {o.listen}? see --store, --listen)") from None
        self.say(f"collector on {self.address}, storing in {self.store} (pid {self.collector.pid})")
        from rankscope.collector.client import Client

        self.client = Client(self.address)
        if o.dashboard_port is not None:
            self.dashboard = start(
                [*CLI, "dashboard", "--collector", self.address, "--port", str(o.dashboard_port)], self.logs / "dashboard.log", os.environ
            )
            _wait_for_http(self.dashboard, f"http://127.0.0.1:{o.dashboard_port}/_stcore/health", self.logs / "dashboard.log")
            self.say(f"dashboard on http://127.0.0.1:{o.dashboard_port}/ (pid {self.dashboard.pid})")
        flags = [*TRAIN_FLAGS, "--steps", str(o.steps), "--timeout", str(max(60.0, 4 * o.hang_after_s)), "--inject", o.inject]
        self.training = start([*CLI, "train", *flags], self.logs / "train.log", agent_env(self.address, self.run_id, self.logs / "spool"))
        self.say(f"training run {self.run_id}: 8 CPU ranks, TP2 x PP2 x DP2, two ranks per host (pid {self.training.pid})")
        self.say(f"faults: {o.inject}")
        for line in self._guide():
            self.out(line)

    def _guide(self) -> list[str]:
        """What to look at, for the faults of this run."""
        if self.options.dashboard_port is None:
            return [f"  no dashboard (--no-dashboard): `{self.options.command} sql --collector {self.address} ...` reads the live data"]
        base, q = f"http://127.0.0.1:{self.options.dashboard_port}", f"?run={self.run_id}"
        lines = ["", f"Open {base}/{q}", "What to look at:"]
        for f in self.faults:
            where = f"rank {f.rank} ({host_of(f.rank)})"
            if f.kind == "straggler":
                lines.append(f"  {base}/heatmap{q}    heat map: {where}'s row turns hot from step {f.from_step} ({f.factor}x compute)")
            elif f.kind == "hang":
                lines.append(f"  {base}/graph{q}      3D-parallel graph: from step {f.step} every rank waits, {where} is the root")
            elif f.kind == "slow_link":
                lines.append(f"  {base}/timeline{q}   timeline: sends from rank {f.src} to rank {f.dst} arrive late")
            else:
                lines.append(f"  {base}/overview{q}   overview: {f.kind} of {where} at step {f.step}")
        lines += [
            f"  {base}/incidents{q}  incidents: each one with its evidence, stack dump and the SQL that shows it",
            f"  {base}/sql{q}        SQL: the postmortem cookbook on this run",
            "Ctrl-C stops everything; the data stays in the store.",
            "",
        ]
        return lines

    # -- watch -------------------------------------------------------------------------------

    def watch(self) -> None:
        """Print progress and incidents until the run is over; then, with a dashboard, wait for Ctrl-C."""
        from rankscope.collector.client import QueryFailed

        assert self.training is not None and self.client is not None
        progress = _Progress(self.options.steps, self.options.hang_after_s, self.say)
        seen: set[str] = set()
        ended_at: float | None = None
        while ended_at is None or self.dashboard is not None or time.monotonic() - ended_at < FINAL_PASSES_S:
            time.sleep(1.0 if ended_at is None else 2.0)
            self._check_alive()
            try:
                latest = self.client.query(LATEST_STEP_SQL, {"run": self.run_id}).to_pylist()
                incidents = self.client.query(INCIDENTS_SQL, {"run": self.run_id}).to_pylist()
            except QueryFailed as e:  # a collector busy writing may miss the call deadline: ask again
                self.say(f"the collector did not answer ({e}); asking again")
                continue
            if ended_at is None and latest:
                progress.update(int(latest[0]["step"]), float(latest[0]["step_time_s"]), latest[0]["loss"])
            for incident in incidents:
                if incident["incident_id"] not in seen:
                    seen.add(incident["incident_id"])
                    self.say(f"INCIDENT {headline(incident['kind'], incident['summary'])}")
            if ended_at is not None:
                continue
            hung = any(i["kind"] == "hang" for i in incidents)
            if hung:
                self.say("the hang is diagnosed: stopping the training run (otherwise it would wait out its timeout)")
                stop(self.training)
            if self.training.poll() is not None:
                ended_at = time.monotonic()
                if not hung:
                    self.say(f"training ended (exit {self.training.returncode}); log: {self.logs / 'train.log'}")
                if self.dashboard is not None:
                    self.say(f"the dashboard stays up at http://127.0.0.1:{self.options.dashboard_port}/?run={self.run_id}"
                             " - Ctrl-C stops it and the collector")  # fmt: skip

    def _check_alive(self) -> None:
        for name, proc in (("collector", self.collector), ("dashboard", self.dashboard)):
            if proc is not None and proc.poll() is not None:
                raise DemoError(f"the {name} exited ({proc.returncode}); log: {self.logs / (name + '.log')}")

    # -- stop --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Training, dashboard, then the collector (SIGTERM: it writes every buffer before it exits)."""
        if self.client is not None:
            self.client.close()
        for name, proc, grace_s in (("training", self.training, 15.0), ("dashboard", self.dashboard, 15.0),
                                    ("collector", self.collector, 60.0)):  # fmt: skip
            if proc is not None:
                running = proc.poll() is None
                stop(proc, grace_s)  # also when its leader is gone: what it started may not be
                if running:
                    self.say(f"{name} stopped")

    def follow_ups(self) -> None:
        c, store = self.options.command, shlex.quote(str(self.store))
        self.out("")
        self.out(f"Everything is stopped. The data stays in {self.store}; for the postmortem:")
        self.out(f"  {c} sql --store {store} --param run={self.run_id} {shlex.quote(FOLLOW_UP_SQL)}")
        self.out(f"  {c} diagnose --store {store} --run {self.run_id} --hang-after {self.options.hang_after_s:g}")
        self.out(f"  {c} dashboard --store {store}")
        self.out(f"Logs: {self.logs}")


class _Progress:
    """A line every tenth of the run's steps, and one when steps stop ending (a hang in the making)."""

    def __init__(self, steps: int, hang_after_s: float, say: Callable[[str], None]) -> None:
        self.steps = steps
        self.hang_after_s = hang_after_s
        self.say = say
        self.every = max(1, round(steps / 10))
        self.shown = 0
        self.last = 0
        self.changed_at = time.monotonic()
        self.stall_told = False

    def update(self, step: int, step_time_s: float, loss: float | None) -> None:
        """Take the latest step the collector has (with its step time and loss, if any)."""
        now = time.monotonic()
        if step != self.last:
            self.last, self.changed_at, self.stall_told = step, now, False
        if step >= self.shown + self.every or (step == self.steps and step > self.shown):
            self.shown = step
            loss_text = f", loss {loss:.3f}" if loss is not None else ""
            self.say(f"step {step}/{self.steps}: {step_time_s:.2f} s/step{loss_text}")
        if step < self.steps and not self.stall_told and now - self.changed_at > max(8.0, 4 * step_time_s):
            self.stall_told = True
            self.say(f"no step has ended for {now - self.changed_at:.0f} s: the collector calls it a hang after "
                     f"{self.hang_after_s:.0f} s")  # fmt: skip


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise DemoError(f"the dashboard's port {port} is taken ({e.strerror}): choose another with --port") from None


def _wait_for_http(proc: subprocess.Popen[bytes], url: str, log_path: Path, timeout_s: float = 90.0) -> None:
    """Wait until ``url`` answers (the dashboard is serving)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"the dashboard exited ({proc.returncode}):\n{log_path.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2.0):
                return
        except OSError:
            time.sleep(0.5)
    raise DemoError(f"the dashboard did not answer at {url} within {timeout_s:.0f} s (log: {log_path})")


@contextmanager
def _stops_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the demo the way Ctrl-C does (a KeyboardInterrupt in the main thread), and so does
    SIGINT even where the demo was started with it ignored (a shell's `( cmd & )` does that)."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
