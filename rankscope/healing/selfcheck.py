"""Self-check of suspect hosts, MegaScale-style: short, bounded tests run *on* each host, each
figure judged against the same figure on its peers.

After an incident names a host, the self-healing driver asks: is that machine really bad, or did
it only look slow? ``check_hosts([suspect, peer, peer], runner)`` runs the same tests
(``rankscope.healing.probes``: matmul, memory bandwidth, loopback all-reduce) on every host given,
one host at a time (so they do not compete for CPU), then the link tests between the hosts that
answered, from each host to a sink server started on each of its peers; ``link_server`` fails on a
host whose server did not start or that most of its peers could not reach. Each host is then
judged against the others (``rankscope.healing.verdict.judge``).

Each test is a child process on the host (``python -m rankscope.healing.probes --probe ...``) that
prints one JSON line per test; every test has a timeout, and a host that gives no line in time (a
frozen host) fails with "no answer in N s", its remaining tests not run. A host that fails on a
local figure it measured is measured again, once, and judged on the better of its two runs: a blip
of a loaded machine passes, a host that is really slow fails twice.

Where a host's commands run is a ``Runner``: ``LocalRunner`` (this machine itself) here, a test
bed's namespace hosts with ``rankscope.testbed.healing_fleet.TestbedRunner``. A runner also names the only
networks the link tests may contact.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from rankscope.healing.probes import LINK_BYTES, LINK_SECONDS, LOCAL_CHECKS, LOOPBACK, MARK
from rankscope.healing.record import Figure
from rankscope.healing.verdict import FACTOR, SPECS, Report, best_of, judge, spec_of

__all__ = ["TIMEOUT_S", "Answer", "LocalRunner", "Runner", "check_hosts", "check_local", "run_on"]

#: seconds each test of a host may take (its process start and imports count into the first one)
TIMEOUT_S = 60.0


# --- where a host's commands run -----------------------------------------------------------------


class Runner(Protocol):
    """Where a host's commands run: ``command`` wraps an argv to run inside the host; ``address`` is
    where the host's peers reach it; ``networks`` (CIDRs) are the only ones a link test may contact."""

    networks: tuple[str, ...]

    def command(self, host: str, argv: Sequence[str]) -> list[str]: ...

    def address(self, host: str) -> str: ...


@dataclass(frozen=True)
class LocalRunner:
    """This machine: ``rankscope selfcheck`` runs on the host it checks."""

    networks: tuple[str, ...] = LOOPBACK

    @property
    def hosts(self) -> list[str]:
        return [socket.gethostname()]

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def address(self, host: str) -> str:
        return "127.0.0.1"


@dataclass(frozen=True)
class Answer:
    """What a command on a host said: exit status (None when it gave no answer in time), output."""

    returncode: int | None
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_on(runner: Runner, host: str, argv: Sequence[str], timeout_s: float) -> Answer:
    """Run ``argv`` on ``host`` and wait at most ``timeout_s``; a command that does not end in time
    is killed (with everything it started) and answers with ``returncode`` None."""
    child = _Child(runner, host, argv)
    deadline = time.monotonic() + timeout_s
    lines = []
    try:
        while (line := child.line(deadline - time.monotonic())) is not None:
            lines.append(line)
        code = child.proc.wait(max(0.0, deadline - time.monotonic()))
    except (TimeoutError, subprocess.TimeoutExpired):
        code = None
    finally:
        child.stop()
    return Answer(code, "".join(f"{line}\n" for line in lines), child.stderr())


def _env() -> dict[str, str]:
    """The probes' environment: this one without the agent's switch (a probe is no training rank)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    return {**env, "PYTHONUNBUFFERED": "1"}


class _Child:
    """A command started on a host, read one line at a time against a deadline; ``stop`` kills its
    whole process group (a frozen host's processes die once thawed: nothing waits for them)."""

    def __init__(self, runner: Runner, host: str, argv: Sequence[str]):
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            runner.command(host, argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._err, env=_env(),
            start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._fd, selectors.EVENT_READ)
        self._buffer = b""
        self._eof = False

    def line(self, timeout_s: float) -> str | None:
        """The next line of its output; None once the output has ended; TimeoutError if none comes in time."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer and not self._eof:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if self._selector.select(left):
                try:
                    chunk = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    continue
                self._eof = not chunk
                self._buffer += chunk
        if not self._buffer:
            return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(errors="replace")

    def message(self, timeout_s: float) -> dict[str, Any] | None:
        """The next JSON line the probe marked; None once its output has ended."""
        deadline = time.monotonic() + timeout_s
        while (line := self.line(deadline - time.monotonic())) is not None:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        return None

    def stop(self, grace_s: float = 0.0) -> None:
        """End it: ``grace_s`` to end by itself, then SIGTERM, then SIGKILL (a scheduler's task whose
        client is killed outright runs on: srun ends its remote task on SIGTERM)."""
        for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 1.0)):  # srun ends its remote task on SIGTERM
            if sig is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass  # frozen: it dies when its host thaws, and subprocess reaps it later
        self._selector.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def stderr(self, tail: int = 2000) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-tail:]

    def why(self) -> str:
        """Why it ended without answering: its exit status and the end of its stderr."""
        try:
            code = self.proc.wait(2.0)  # its output has ended: its exit follows
        except subprocess.TimeoutExpired:
            code = None
        last = self.stderr().strip().splitlines()[-1:] if self.stderr().strip() else []
        status = "still running" if code is None else f"exit {code}"
        return f"{status}: {last[0]}" if last else status


# --- the API ---------------------------------------------------------------------------------------


def check_hosts(
    hosts: Sequence[str], runner: Runner, *, ranks: int = 2, timeout_s: float = TIMEOUT_S, factor: float = FACTOR,
    links: bool = True, device: str = "auto", link_bytes: int = LINK_BYTES, link_seconds: float = LINK_SECONDS,
    peers: Mapping[str, Sequence[Figure]] | None = None,
) -> Report:  # fmt: skip
    """Run every test on every host of ``hosts`` (one host at a time), then the link tests between
    the hosts that answered, and judge each host against the others (``judge``).

    ``ranks``: processes of the loopback all-reduce (0: one per GPU, else 2; 1 counts as 2: an
    all-reduce of one process tests nothing); ``timeout_s``: the most each test may take on a host;
    ``device``: auto (CUDA where there is one), cpu or cuda; ``peers``: figures other hosts measured
    before (host -> figures), judged with but not measured again nor reported (a node checked alone).
    """
    if len(set(hosts)) != len(hosts) or not hosts:
        raise ValueError(f"name each host once, at least one: {list(hosts)}")
    ranks = max(2, ranks) if ranks > 0 else 0
    raw: dict[str, list[Figure]] = {h: [] for h in hosts}
    elapsed = dict.fromkeys(hosts, 0.0)
    silent: dict[str, str] = {}  # host -> why it is not asked anything more
    for host in hosts:
        began = time.monotonic()
        figures, why = _local(runner, host, ranks=ranks, timeout_s=timeout_s, device=device)
        raw[host] += figures
        if why:
            silent[host] = why
        elapsed[host] += time.monotonic() - began
    if links and len(hosts) > 1:
        _links(runner, hosts, raw, elapsed, silent, timeout_s=timeout_s, link_bytes=link_bytes, link_seconds=link_seconds)
    stored = {host: list(figures) for host, figures in (peers or {}).items() if host not in raw}
    report = judge({**raw, **stored}, factor=factor)
    measured_again: set[str] = set()
    while again := [h for h in _slow_locally(report) if h in raw and h not in silent and h not in measured_again]:
        for host in again:  # a failure is measured twice before it counts: a loaded machine's blip passes
            began = time.monotonic()
            figures, _ = _local(runner, host, ranks=ranks, timeout_s=timeout_s, device=device)
            raw[host] = best_of(raw[host], figures)
            elapsed[host] += time.monotonic() - began
            measured_again.add(host)
        report = judge({**raw, **stored}, factor=factor)
    return replace(report, hosts=tuple(replace(h, elapsed_s=elapsed[h.host]) for h in report.hosts if h.host in raw))


def check_local(*, ranks: int = 0, timeout_s: float = TIMEOUT_S, device: str = "auto") -> Report:
    """The tests on this machine alone (no peer: the figures are measured, not judged)."""
    runner = LocalRunner()
    return check_hosts(runner.hosts, runner, ranks=ranks, timeout_s=timeout_s, links=False, device=device)


def _probe(*args: str) -> list[str]:
    return [sys.executable, "-m", "rankscope.healing.probes", *args]


def _allow(runner: Runner) -> list[str]:
    return [a for net in runner.networks for a in ("--allow", net)]


def _local(runner: Runner, host: str, *, ranks: int, timeout_s: float, device: str) -> tuple[list[Figure], str]:
    """The local tests on one host: their figures, and why the host is not to be asked anything more
    ("" unless it gave no answer in time)."""
    child = _Child(runner, host, _probe("--probe", "local", "--checks", ",".join(LOCAL_CHECKS), "--ranks", str(ranks), "--device", device))
    figures, silent, ended = [], "", ""
    try:
        for check in LOCAL_CHECKS:
            unit = SPECS[check].unit
            if silent or ended:
                figures.append(_not_run(check, unit, f"not run: {silent or ended}"))
                continue
            try:
                message = child.message(timeout_s)
            except TimeoutError:
                figures.append(_not_run(check, unit, f"no answer in {timeout_s:g} s"))
                silent = f"{host} gave no answer to {check} in {timeout_s:g} s"
                continue
            if message is None:
                ended = f"the probe ended ({child.why()})"
                figures.append(_not_run(check, unit, ended))
                continue
            figures += _figures(message)
    finally:
        child.stop(0.0 if silent else 5.0)
    return figures, silent


def _slow_locally(report: Report) -> list[str]:
    """The hosts that failed on a local figure they measured (slow, not silent or broken)."""
    return [h.host for h in report.hosts if any(f.check in LOCAL_CHECKS and not math.isnan(f.value) for f in h.failed)]


def _links(
    runner: Runner, hosts: Sequence[str], raw: dict[str, list[Figure]], elapsed: dict[str, float], silent: dict[str, str], *,
    timeout_s: float, link_bytes: int, link_seconds: float,
) -> None:  # fmt: skip
    """A sink server on every host that answered, then from each of them a link test to every other.

    A link test that could not run is the peer's fault when most hosts could not reach that peer
    (its server answers nobody): the peer fails (``link_server``) and the links to it are not held
    against anybody. Links to a host that gave no answer before are not tested at all.
    """
    servers: dict[str, tuple[_Child, int]] = {}
    tested = [h for h in hosts if h not in silent]
    try:
        for host in tested:
            began = time.monotonic()
            backstop = len(hosts) ** 2 * timeout_s + 30  # the server ends by itself even if nobody stops it
            child = _Child(runner, host, _probe("--serve-links", "--bind", runner.address(host), "--for", f"{backstop:g}", *_allow(runner)))
            try:
                message = child.message(timeout_s)
                problem = "" if message and "port" in message else f"it ended ({child.why()})"
            except TimeoutError:
                message, problem = None, f"no answer in {timeout_s:g} s"
            if message and not problem:
                servers[host] = (child, int(message["port"]))
            else:
                child.stop()
                raw[host].append(_not_run("link_server", "", f"the link server did not start: {problem}"))
                silent[host] = f"{host}'s link server did not start"
            elapsed[host] += time.monotonic() - began
        for host in tested:
            if host not in servers:
                continue  # it failed already
            began = time.monotonic()
            raw[host] += _link_tests(runner, host, [p for p in tested if p != host and p in servers], servers,
                                     timeout_s=timeout_s, link_bytes=link_bytes, link_seconds=link_seconds)  # fmt: skip
            elapsed[host] += time.monotonic() - began
    finally:
        for child, _ in servers.values():
            child.stop()
    for peer in [h for h in tested if h in servers]:
        unreachable = {h: f for h in servers if h != peer for f in raw[h] if f.check == f"link_throughput:{peer}" and not f.passed}
        if len(unreachable) > (len(servers) - 1) / 2:
            raw[peer].append(_not_run("link_server", "", f"unreachable from {', '.join(unreachable)}: {next(iter(unreachable.values())).detail}"))
            silent[peer] = f"{peer}'s link server answers none of its peers"
    for host in hosts:  # links to hosts that could not take part: not held against anybody
        if host in silent:
            for peer in hosts:
                if peer != host and peer not in silent:
                    raw[peer] = [f for f in raw[peer] if not f.check.endswith(f":{host}")] + [
                        Figure(f"{metric}:{host}", math.nan, SPECS[metric].unit, detail=f"not judged: {silent[host]}")
                        for metric in ("link_throughput", "link_rtt")
                    ]  # fmt: skip


def _link_tests(
    runner: Runner, host: str, peers: Sequence[str], servers: Mapping[str, tuple[_Child, int]], *,
    timeout_s: float, link_bytes: int, link_seconds: float,
) -> list[Figure]:  # fmt: skip
    if not peers:
        return []
    args = [a for p in peers for a in ("--peer", f"{p}={runner.address(p)}:{servers[p][1]}")]
    probe = _probe("--probe", "links", "--bytes", str(link_bytes), "--seconds", f"{link_seconds:g}", "--socket-timeout", f"{timeout_s / 3:g}",
                   *_allow(runner), *args)  # fmt: skip
    child = _Child(runner, host, probe)
    figures, why = [], ""
    try:
        for peer in peers:
            if not why:
                try:
                    message = child.message(timeout_s)
                    if message is not None:
                        figures += _figures(message)
                        continue
                    why = f"the probe ended ({child.why()})"
                except TimeoutError:
                    why = f"no answer in {timeout_s:g} s"
            figures += [_not_run(f"{metric}:{peer}", SPECS[metric].unit, why) for metric in ("link_throughput", "link_rtt")]
    finally:
        child.stop()
    return figures


def _figures(message: Mapping[str, Any]) -> list[Figure]:
    if message.get("error"):
        return [_not_run(c, spec_of(c).unit, f"could not run: {message['error']}") for c in message["checks"]]
    return [Figure(f["check"], float(f["value"]), f["unit"], detail=f.get("detail", "")) for f in message["figures"]]


def _not_run(check: str, unit: str, detail: str) -> Figure:
    return Figure(check, math.nan, unit, passed=False, detail=detail)
