"""The verdict of a self-check (pure): each host's figures judged against the same figures on its
peers.

A figure fails when it is worse than the median of the same figure on the other hosts by more than
``factor`` (default 2: a throughput below 0.5x, a time above 2x) and by more than the figure's
noise floor (``SPECS``); a test that could not run fails. A bad host makes its peers' links to it
slow too: a slow link to a host that fails its own tests, or whose links to most peers are slow, is
not held against the other end. The host passes when every figure passes. A host measured twice is
judged on the better of its two runs (``best_of``). With no peer, figures are measured but not
judged.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from rankscope.healing.probes import LOCAL_CHECKS
from rankscope.healing.record import Figure, selfcheck_batch

if TYPE_CHECKING:
    from rankscope.protos.v1 import ingest_pb2

__all__ = ["FACTOR", "SPECS", "HostResult", "Report", "Spec", "best_of", "figure_text", "judge", "spec_of"]

#: a figure fails when it is worse than its peers' median by more than this factor
FACTOR = 2.0


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


def best_of(first: Sequence[Figure], again: Sequence[Figure]) -> list[Figure]:
    """``first`` with each local figure measured in both runs replaced by the better of the two: a
    host slow once is measured again, and a loaded machine's blip passes."""
    second = {f.check: f for f in again if not math.isnan(f.value)}
    best = []
    for f in first:
        other = second.get(f.check)
        if f.check not in LOCAL_CHECKS or math.isnan(f.value) or other is None:
            best.append(f)
            continue
        better, worse = (other, f) if (other.value > f.value) == SPECS[f.check].higher_is_better else (f, other)
        best.append(replace(better, detail=_join(better.detail, f"best of 2 runs (the other: {figure_text(worse.value)} {f.unit})")))
    return best


def spec_of(check: str) -> Spec:
    """How the figure ``check`` is judged (a link figure ``metric:PEER`` as its metric)."""
    return SPECS[_metric(check)]


def _worse(f: Figure, reference: float, factor: float) -> bool:
    """Whether ``f`` is worse than ``reference`` by more than ``factor`` and its noise floor."""
    spec = spec_of(f.check)
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
    return f"{f.check} {figure_text(f.value)} {f.unit} is {_times(ratio)} the peers' median {figure_text(f.reference)}"


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def figure_text(value: float) -> str:
    """A figure as the verdicts and ``rankscope selfcheck``'s table write it: three significant digits, "-" for none."""
    if math.isnan(value):
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _metric(check: str) -> str:
    return check.split(":", 1)[0]
