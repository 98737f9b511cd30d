"""Self-check of suspect hosts, MegaScale-style: short, bounded tests run *on* each host, each
figure judged against the same figure on its peers.

After an incident names a host, the self-healing driver asks: is that machine really bad, or did
it only look slow? ``check_hosts([suspect, peer, peer], runner)`` runs the same tests on every host
given, one host at a time (so they do not compete for CPU), and judges each host against the
others:

- ``matmul``: matrix-multiply throughput, GFLOP/s (CPU: float32 256x256; CUDA: bf16 4096x4096);
- ``memory_bandwidth``: a 64 MiB memory copy, GB/s (bytes read plus bytes written, as STREAM counts);
- ``loopback_allreduce``: ``ranks`` local processes all-reduce 1 MiB over 127.0.0.1 (gloo; NCCL on
  CUDA), ms per all-reduce;
- ``link_throughput:PEER`` and ``link_rtt:PEER``: a TCP stream (Mbit/s) and a ping-pong (ms, median)
  from the host to a small sink server started on each peer host; ``link_server`` fails on a host
  whose server did not start or that most of its peers could not reach.

Each test is a child process on the host (``python -m rankscope.healing.selfcheck --probe ...``)
that prints one JSON line per test; every test has a timeout, and a host that gives no line in
time (a frozen host) fails with "no answer in N s", its remaining tests not run.

Verdict (``judge``, pure): a figure fails when it is worse than the median of the same figure on
the other hosts by more than ``factor`` (default 2: a throughput below 0.5x, a time above 2x) and
by more than the figure's noise floor (``SPECS``); a test that could not run fails. A bad host
makes its peers' links to it slow too: a slow link to a host that fails its own tests, or whose
links to most peers are slow, is not held against the other end. The host passes when every
figure passes. A host that fails on a local figure it measured is measured again, once, and
judged on the better of its two runs: a blip of a loaded machine passes, a host that is really
slow fails twice. With no peer, figures are measured but not judged. Measurements are windows of
about 0.1 s or more (many 10 ms CPU-quota periods), best of a few, so that a throttled host
measures slow instead of fitting one lucky burst into its quota.

Where a host's commands run is a ``Runner``: ``LocalRunner`` (this machine itself) here, a test
bed's namespace hosts with ``rankscope.testbed.fleet.TestbedRunner``. A runner also names the only
networks the link tests may contact.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from rankscope.healing.record import Figure, selfcheck_batch

if TYPE_CHECKING:
    from rankscope.protos.v1 import ingest_pb2

__all__ = [
    "FACTOR", "LOCAL_CHECKS", "SPECS", "TIMEOUT_S", "Answer", "HostResult", "LocalRunner", "Report", "Runner", "Spec",
    "check_hosts", "check_local", "judge", "run_on",
]  # fmt: skip

#: a figure fails when it is worse than its peers' median by more than this factor
FACTOR = 2.0
#: seconds each test of a host may take (its process start and imports count into the first one)
TIMEOUT_S = 60.0
#: the tests run on each host itself, in this order (``matmul`` last: nothing forks after it)
LOCAL_CHECKS = ("memory_bandwidth", "loopback_allreduce", "matmul")
#: the networks a link test may contact unless its runner names others (``Runner.networks``)
LOOPBACK = ("127.0.0.0/8",)
#: what the probes print before each JSON line (anything else on their stdout is ignored)
MARK = "@selfcheck "
#: bytes and seconds of a link test: the stream stops at whichever comes first
LINK_BYTES = 256 << 20
LINK_SECONDS = 0.3
LINK_PINGS = 30


@dataclass(frozen=True)
class Spec:
    """How a figure is judged: its unit, which way is better, and the noise floor (in its unit) below
    which a worse value is not a failure, whatever the ratio (a 0.1 ms round trip that doubles)."""

    unit: str
    higher_is_better: bool
    noise: float = 0.0


SPECS: dict[str, Spec] = {
    "matmul": Spec("GFLOP/s", True),
    "memory_bandwidth": Spec("GB/s", True),
    "loopback_allreduce": Spec("ms", False, noise=0.5),
    "link_throughput": Spec("Mbit/s", True),
    "link_rtt": Spec("ms", False, noise=0.5),
    "link_server": Spec("", True),  # only ever a failure: the host could not serve its peers' link tests
}
ORDER = ("matmul", "memory_bandwidth", "loopback_allreduce", "link_server", "link_throughput", "link_rtt")


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

    def stop(self) -> None:
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


@dataclass(frozen=True)
class HostResult:
    """One host's self-check: every figure (``record.Figure``, judged), the verdict and why."""

    host: str
    passed: bool
    summary: str
    figures: tuple[Figure, ...]
    #: False when there was no peer to compare with: the figures are measured, not judged
    judged: bool = True
    elapsed_s: float = 0.0

    @property
    def failed(self) -> list[Figure]:
        return [f for f in self.figures if not f.passed]

    def figure(self, check: str) -> Figure:
        return next(f for f in self.figures if f.check == check)

    def batch(self, run_id: str) -> ingest_pb2.Batch:
        """The record the collector stores (``Client(address).send(result.batch(run_id))``)."""
        return selfcheck_batch(run_id, self.host, self.passed, self.summary, self.figures)

    def as_json(self) -> dict[str, Any]:
        return {
            "host": self.host, "passed": self.passed, "judged": self.judged, "summary": self.summary, "elapsed_s": round(self.elapsed_s, 3),
            "figures": [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(f).items()} for f in self.figures],
        }  # fmt: skip


@dataclass(frozen=True)
class Report:
    """The self-check of several hosts, each judged against the others."""

    hosts: tuple[HostResult, ...]
    factor: float = FACTOR

    @property
    def passed(self) -> bool:
        return all(h.passed for h in self.hosts)

    @property
    def failed(self) -> list[str]:
        """The names of the hosts that failed."""
        return [h.host for h in self.hosts if not h.passed]

    def host(self, name: str) -> HostResult:
        return next(h for h in self.hosts if h.host == name)

    def as_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "failed": self.failed, "factor": self.factor, "hosts": [h.as_json() for h in self.hosts]}


def check_hosts(
    hosts: Sequence[str], runner: Runner, *, ranks: int = 2, timeout_s: float = TIMEOUT_S, factor: float = FACTOR,
    links: bool = True, device: str = "auto", link_bytes: int = LINK_BYTES, link_seconds: float = LINK_SECONDS,
) -> Report:  # fmt: skip
    """Run every test on every host of ``hosts`` (one host at a time), then the link tests between
    the hosts that answered, and judge each host against the others (``judge``).

    ``ranks``: processes of the loopback all-reduce (0: one per GPU, else 2; 1 counts as 2: an
    all-reduce of one process tests nothing); ``timeout_s``: the most each test may take on a host;
    ``device``: auto (CUDA where there is one), cpu or cuda.
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
    report = judge(raw, factor=factor)
    measured_again: set[str] = set()
    while again := [h for h in _slow_locally(report) if h not in silent and h not in measured_again]:
        for host in again:  # a failure is measured twice before it counts: a loaded machine's blip passes
            began = time.monotonic()
            figures, _ = _local(runner, host, ranks=ranks, timeout_s=timeout_s, device=device)
            raw[host] = _best_of(raw[host], figures)
            elapsed[host] += time.monotonic() - began
            measured_again.add(host)
        report = judge(raw, factor=factor)
    return replace(report, hosts=tuple(replace(h, elapsed_s=elapsed[h.host]) for h in report.hosts))


def check_local(*, ranks: int = 0, timeout_s: float = TIMEOUT_S, device: str = "auto") -> Report:
    """The tests on this machine alone (no peer: the figures are measured, not judged)."""
    runner = LocalRunner()
    return check_hosts(runner.hosts, runner, ranks=ranks, timeout_s=timeout_s, links=False, device=device)


def _probe(*args: str) -> list[str]:
    return [sys.executable, "-m", "rankscope.healing.selfcheck", *args]


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
        child.stop()
    return figures, silent


def _slow_locally(report: Report) -> list[str]:
    """The hosts that failed on a local figure they measured (slow, not silent or broken)."""
    return [h.host for h in report.hosts if any(f.check in LOCAL_CHECKS and not math.isnan(f.value) for f in h.failed)]


def _best_of(first: Sequence[Figure], again: Sequence[Figure]) -> list[Figure]:
    """``first`` with each local figure measured in both runs replaced by the better of the two."""
    second = {f.check: f for f in again if not math.isnan(f.value)}
    best = []
    for f in first:
        other = second.get(f.check)
        if f.check not in LOCAL_CHECKS or math.isnan(f.value) or other is None:
            best.append(f)
            continue
        better, worse = (other, f) if (other.value > f.value) == SPECS[f.check].higher_is_better else (f, other)
        best.append(replace(better, detail=_join(better.detail, f"best of 2 runs (the other: {_fmt(worse.value)} {f.unit})")))
    return best


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
        return [_not_run(c, SPECS[_metric(c)].unit, f"could not run: {message['error']}") for c in message["checks"]]
    return [Figure(f["check"], float(f["value"]), f["unit"], detail=f.get("detail", "")) for f in message["figures"]]


def _not_run(check: str, unit: str, detail: str) -> Figure:
    return Figure(check, math.nan, unit, passed=False, detail=detail)


def _metric(check: str) -> str:
    return check.split(":", 1)[0]


# --- the verdict (pure) ----------------------------------------------------------------------------


def judge(measured: Mapping[str, Sequence[Figure]], *, factor: float = FACTOR) -> Report:
    """Judge each host's figures against the same figures on the other hosts.

    ``measured``: host -> its figures as measured: a figure with a value (``passed`` True) is judged;
    one without a value is kept as it is: ``passed`` False (the test could not run: a failure) or
    True (not judged, e.g. a link to a host that did not answer). Each judged figure gets
    ``reference`` = the median of the same figure on the other hosts, and fails when it is worse than
    the reference by more than ``factor`` and by more than its spec's noise floor.

    A link has two ends, and a bad host makes its peers' links to it slow too. So a link figure
    ``metric:PEER`` is compared with the links that touch neither this host nor a *slow end* (a host
    that fails its own tests, or whose links to most of its peers are slow: ``_slow_ends``), and a
    slow link to a slow end is not held against this host. A link slow between two hosts that are
    otherwise fine fails both ends: nothing tells which end it is.
    """
    if not factor > 1:
        raise ValueError(f"the factor must be more than 1, got {factor}")
    slow_ends = _slow_ends(measured, factor)
    results = []
    for host, figures in measured.items():
        judged_figures, any_judged = [], False
        for f in figures:
            if math.isnan(f.value):
                judged_figures.append(f)
                continue
            metric, _, peer = f.check.partition(":")
            ends = slow_ends.get(metric, set()) - {host}
            ref = _reference(measured, host, f.check, ends)
            if math.isnan(ref):
                judged_figures.append(replace(f, reference=math.nan, passed=True, detail=_join(f.detail, "no peers to compare with")))
                continue
            any_judged = True
            bad = _worse(f, ref, factor)
            detail = _join(f.detail, f"{_times(f.value / ref if ref else math.inf)} the peers' median")
            if bad and peer in ends:
                bad, detail = False, _join(detail, f"not held against {host}: {peer} is slow itself")
            judged_figures.append(replace(f, reference=ref, passed=not bad, detail=detail))
        judged_figures.sort(key=lambda f: (ORDER.index(_metric(f.check)) if _metric(f.check) in ORDER else len(ORDER), f.check))
        failed = [f for f in judged_figures if not f.passed]
        passed = not failed
        if failed:
            summary = "; ".join(_describe(f) for f in failed)
        elif not any_judged:
            summary = f"no peers to compare with: {len(judged_figures)} figures measured, every test ran"
        else:
            summary = f"every figure within {factor:g}x of its peers' median"
        results.append(HostResult(host, passed, summary, tuple(judged_figures), judged=any_judged))
    return Report(tuple(results), factor)


def _worse(f: Figure, reference: float, factor: float) -> bool:
    """Whether ``f`` is worse than ``reference`` by more than ``factor`` and its noise floor."""
    spec = SPECS[_metric(f.check)]
    if spec.higher_is_better:
        return f.value < reference / factor and reference - f.value > spec.noise
    return f.value > reference * factor and f.value - reference > spec.noise


def _slow_ends(measured: Mapping[str, Sequence[Figure]], factor: float) -> dict[str, set[str]]:
    """Per link metric, the hosts the slow links to them are blamed on: those that fail a local
    figure they measured (a throttled CPU slows its network too), and those whose links (either
    way) to more than half of their peers are worse than the links that do not touch them."""
    locally = {
        host for host, figures in measured.items() for f in figures
        if f.check in LOCAL_CHECKS and not math.isnan(f.value) and _worse(f, _reference(measured, host, f.check, set()), factor)
    }  # fmt: skip
    ends: dict[str, set[str]] = {}
    for metric in {_metric(f.check) for figures in measured.values() for f in figures if ":" in f.check}:
        links = _link_figures(measured, metric)
        ends[metric] = set(locally)
        for host in measured:
            touching = [(b if a == host else a, f) for a, b, f in links if host in (a, b)]
            others = [f.value for a, b, f in links if host not in (a, b)]
            if not touching or not others:
                continue
            ref = statistics.median(others)
            if len({p for p, f in touching if _worse(f, ref, factor)}) > len({p for p, _ in touching}) / 2:
                ends[metric].add(host)
    return ends


def _link_figures(measured: Mapping[str, Sequence[Figure]], metric: str) -> list[tuple[str, str, Figure]]:
    """(from, to, figure) of every link figure of ``metric`` that has a value."""
    return [
        (host, f.check.partition(":")[2], f) for host, figures in measured.items() for f in figures
        if ":" in f.check and _metric(f.check) == metric and not math.isnan(f.value)
    ]  # fmt: skip


def _reference(measured: Mapping[str, Sequence[Figure]], host: str, check: str, avoid: set[str]) -> float:
    """The median of ``check`` on the hosts other than ``host``; for a link figure, of the same metric
    on the links that touch neither ``host`` nor a host of ``avoid`` (or, when none is left, on the
    links that do not touch ``host``)."""
    metric, _, peer = check.partition(":")
    if not peer:
        values = [f.value for other, figures in measured.items() if other != host for f in figures if f.check == check and not math.isnan(f.value)]
        return statistics.median(values) if values else math.nan
    links = [(a, b, f.value) for a, b, f in _link_figures(measured, metric) if host not in (a, b)]
    values = [v for a, b, v in links if a not in avoid and b not in avoid] or [v for _, _, v in links]
    return statistics.median(values) if values else math.nan


def _describe(f: Figure) -> str:
    if math.isnan(f.value):
        return f"{f.check} {f.detail}"
    ratio = f.value / f.reference if f.reference else math.inf
    return f"{f.check} {_fmt(f.value)} {f.unit} is {_times(ratio)} the peers' median {_fmt(f.reference)}"


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


# --- the probes: what runs on the host -------------------------------------------------------------


def _say(message: Mapping[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def _best_window(work: Any, *, windows: int = 3, window_s: float = 0.12) -> float:
    """Seconds per call of ``work``, from the best of ``windows`` windows of at least ``window_s``
    each: a window spans many CPU-quota periods, so a throttled host measures throttled."""
    best = math.inf
    for _ in range(windows):
        calls, began = 0, time.perf_counter()
        while True:
            work()
            calls += 1
            spent = time.perf_counter() - began
            if spent >= window_s:
                break
        best = min(best, spent / calls)
    return best


def _memory_bandwidth(size: int = 64 << 20) -> dict[str, Any]:
    import numpy as np

    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page first
    per_copy = _best_window(lambda: np.copyto(dst, src))
    return {"check": "memory_bandwidth", "value": 2 * size / per_copy / 1e9, "unit": "GB/s", "detail": f"{size >> 20} MiB copy"}


def _matmul(device: str) -> dict[str, Any]:
    import torch

    if device == "cuda":  # untested on the CPU-only development machine: keep it this small
        n, dtype = 4096, torch.bfloat16
        a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)

        def work() -> None:
            for _ in range(10):
                a @ b
            torch.cuda.synchronize()

        work()
        per_call = _best_window(work) / 10
    else:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        n, dtype = 256, torch.float32
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        per_call = _best_window(lambda: a @ b)
    return {"check": "matmul", "value": 2 * n**3 / per_call / 1e9, "unit": "GFLOP/s", "detail": f"{device} {str(dtype).split('.')[-1]} {n}x{n}"}


def _allreduce_worker(rank: int, world: int, port: int, device: str, size: int, window_s: float, conn: Any) -> None:
    """One rank of the loopback all-reduce: sends back its ms per all-reduce, from the best of three
    windows of about ``window_s`` each (the ranks agree on how many all-reduces make a window)."""
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=world)
        if device == "cuda":
            torch.cuda.set_device(rank)
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)

        def window(iterations: int) -> float:
            if device == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            for _ in range(iterations):
                dist.all_reduce(tensor)
            if device == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - began) / iterations

        window(3)  # warm-up
        count = torch.tensor([min(2000, max(5, math.ceil(window_s / window(5))))], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        best = min(window(int(count.item())) for _ in range(3))
        dist.destroy_process_group()
        conn.send(best * 1e3)
    except BaseException as e:  # noqa: BLE001: the parent reports it
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def _loopback_allreduce(device: str, ranks: int, size: int = 1 << 20, window_s: float = 0.12) -> dict[str, Any]:
    import multiprocessing

    import torch.distributed as dist

    if ranks <= 0:
        import torch

        ranks = torch.cuda.device_count() if device == "cuda" else 2
        if ranks < 2:  # NCCL takes one rank per GPU: with one GPU, the loopback test is gloo's
            device, ranks = "cpu", 2
    if ranks < 2:
        raise RuntimeError(f"a loopback all-reduce needs 2 or more processes, not {ranks}")
    # fork on CPU: the workers share the parent's imported torch (starting a fresh interpreter that
    # imports torch costs seconds on a throttled host); spawn on CUDA, which does not survive a fork
    context = multiprocessing.get_context("spawn" if device == "cuda" else "fork")
    store = dist.TCPStore("127.0.0.1", 0, ranks + 1, True, wait_for_workers=False)
    pipes, workers = [], []
    for rank in range(ranks):
        receive, send = context.Pipe(duplex=False)
        worker = context.Process(target=_allreduce_worker, args=(rank, ranks, store.port, device, size, window_s, send), daemon=True)
        worker.start()
        send.close()
        pipes.append(receive)
        workers.append(worker)
    answers = [p.recv() for p in pipes]
    for w in workers:
        w.join(10)
    del store
    errors = [a for a in answers if isinstance(a, str)]
    if errors:
        raise RuntimeError(errors[0])
    backend = "nccl" if device == "cuda" else "gloo"
    return {"check": "loopback_allreduce", "value": max(answers), "unit": "ms", "detail": f"{ranks} ranks, {size >> 20} MiB, {backend}"}


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _probe_local(checks: Sequence[str], ranks: int, device: str) -> None:
    for check in checks:
        try:
            if check == "memory_bandwidth":
                figure = _memory_bandwidth()
            elif check == "loopback_allreduce":
                figure = _loopback_allreduce(_device(device), ranks)
            elif check == "matmul":
                figure = _matmul(_device(device))
            else:
                raise ValueError(f"no check {check!r}")
        except Exception as e:  # noqa: BLE001: a test that cannot run is a finding, not a crash
            _say({"checks": [check], "error": f"{type(e).__name__}: {e}"})
            continue
        _say({"figures": [figure]})


def _allowed(address: str, networks: Sequence[str]) -> None:
    if not any(ipaddress.ip_address(address) in ipaddress.ip_network(net) for net in networks):
        raise ValueError(f"a link test contacts only {', '.join(networks)}, not {address}")


def _probe_links(peers: Sequence[str], total_bytes: int, seconds: float, socket_timeout_s: float, networks: Sequence[str]) -> None:
    for spec in peers:
        name, _, target = spec.partition("=")
        address, _, port = target.rpartition(":")
        checks = [f"link_throughput:{name}", f"link_rtt:{name}"]
        try:
            _allowed(address, networks)
            rtt = _ping(address, int(port), socket_timeout_s)
            mbit = _stream(address, int(port), total_bytes, seconds, socket_timeout_s)
        except (OSError, ValueError) as e:
            _say({"checks": checks, "error": f"{address}:{port}: {type(e).__name__}: {e}"})
            continue
        _say({"figures": [
            {"check": checks[0], "value": mbit, "unit": "Mbit/s", "detail": f"to {address}"},
            {"check": checks[1], "value": rtt, "unit": "ms", "detail": f"to {address}, median of {LINK_PINGS}"},
        ]})  # fmt: skip


def _ping(address: str, port: int, timeout_s: float) -> float:
    with socket.create_connection((address, port), timeout=timeout_s) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"E")
        times = []
        for _ in range(LINK_PINGS + 3):
            began = time.perf_counter()
            s.sendall(b"x" * 64)
            _read_exactly(s, 64)
            times.append(time.perf_counter() - began)
        return statistics.median(times[3:]) * 1e3


def _stream(address: str, port: int, total_bytes: int, seconds: float, timeout_s: float) -> float:
    chunk = b"\0" * (256 << 10)
    with socket.create_connection((address, port), timeout=timeout_s) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # what is left in it when time is up drains quickly on a slow link
        s.sendall(b"S")
        sent, began = 0, time.perf_counter()
        while sent < total_bytes and time.perf_counter() - began < seconds:
            s.sendall(chunk)
            sent += len(chunk)
        s.shutdown(socket.SHUT_WR)
        (received,) = struct.unpack("!Q", _read_exactly(s, 8))
        spent = time.perf_counter() - began
    return received * 8 / spent / 1e6


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = s.recv(n - len(data))
        if not part:
            raise ConnectionError("the peer closed the connection")
        data += part
    return data


def _serve_links(bind: str, for_s: float, networks: Sequence[str]) -> None:
    """The peer's end of the link tests: ``E`` echoes, ``S`` sinks and answers with the byte count.
    One connection at a time (the hosts are checked one at a time); gone after ``for_s`` seconds."""
    _allowed(bind, networks)
    deadline = time.monotonic() + for_s
    with socket.create_server((bind, 0)) as server:
        _say({"port": server.getsockname()[1]})
        while (left := deadline - time.monotonic()) > 0:
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                return
            with conn:
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                try:
                    mode = conn.recv(1)
                    if mode == b"E":
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        while data := conn.recv(1 << 16):
                            conn.sendall(data)
                    elif mode == b"S":
                        received = 0
                        while data := conn.recv(1 << 20):
                            received += len(data)
                        conn.sendall(struct.pack("!Q", received))
                except OSError:
                    continue


def main(argv: Sequence[str] | None = None) -> int:
    from rankscope.common.cmdline import Parser

    parser = Parser(prog="python -m rankscope.healing.selfcheck", description="one host's end of rankscope selfcheck (a probe or a link server)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--probe", choices=("local", "links"))
    what.add_argument("--serve-links", action="store_true")
    parser.add_argument("--checks", default=",".join(LOCAL_CHECKS))
    parser.add_argument("--ranks", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=ADDRESS:PORT")
    parser.add_argument("--bytes", type=int, default=LINK_BYTES)
    parser.add_argument("--seconds", type=float, default=LINK_SECONDS)
    parser.add_argument("--socket-timeout", type=float, default=10.0)
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--for", dest="for_s", type=float, default=600.0)
    parser.add_argument("--allow", action="append", metavar="CIDR", help=f"a network link tests may contact (default: {', '.join(LOOPBACK)})")
    args = parser.parse_args(argv)
    networks = args.allow or list(LOOPBACK)
    if args.serve_links:
        _serve_links(args.bind, args.for_s, networks)
    elif args.probe == "local":
        _probe_local(args.checks.split(","), args.ranks, args.device)
    else:
        _probe_links(args.peer, args.bytes, args.seconds, args.socket_timeout, networks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
