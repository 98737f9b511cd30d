"""A fault campaign's trials scored the way the papers count: per trial, per fault kind, per framework.

Pure functions over what a trial knew (its ``Truth``) and what the diagnosis said (incidents as
``rankscope diagnose --format json`` or the ``incidents`` table give them: kind, ranks, hosts).
``judge`` gives one trial's ``Verdict``; ``Tally`` adds verdicts up into precision, recall, F1, the
wrong-culprit rate, the time to incident and the clean-run false-alarm rate; ``table`` prints them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: figures the systems users compare rankscope with published (their own clusters and fault sets)
PUBLISHED = (
    ("Minder (NSDI'25)", "precision 0.904, F1 0.893, 3.6 s to detect"),
    ("Holmes (NSDI'25)", "97.21% of slow iterations located, within 30.3 s"),
    ("Greyhound (ATC'25)", "over 99% on a 10,000-GPU cluster"),
)


@dataclass(frozen=True)
class Truth:
    """What a trial injected: the incident kind it must raise (None: a clean trial) and whom it must name."""

    kind: str | None
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    """One trial, scored: ``tp`` 1 when an incident of the fault's kind names exactly its ranks and
    hosts; ``fn`` 1 when none does; ``wrong_culprit`` 1 when the fault's kind was raised but named
    others only; ``fp`` the incidents that are not the fault's (on a clean trial, every one)."""

    tp: int
    fn: int
    fp: int
    wrong_culprit: int

    @property
    def outcome(self) -> str:
        """One word for a progress line: TP, FN (+nFP: other incidents came too), wrong-culprit, clean or false-alarm."""
        if self.wrong_culprit:
            return "wrong-culprit"
        if not self.tp and not self.fn:
            return "false-alarm" if self.fp else "clean"
        word = "TP" if self.tp else "FN"
        return f"{word}+{self.fp}FP" if self.fp else word


def names(incident: Mapping[str, Any]) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    """What an incident names: its kind, sorted ranks and sorted hosts."""
    return incident["kind"], tuple(sorted(int(r) for r in incident["ranks"])), tuple(sorted(incident["hosts"]))


def judge(truth: Truth, incidents: Iterable[Mapping[str, Any]]) -> Verdict:
    """Score one trial's incidents against what it injected."""
    found = [names(i) for i in incidents]
    if truth.kind is None:
        return Verdict(0, 0, len(found), 0)
    wanted = (truth.kind, tuple(sorted(truth.ranks)), tuple(sorted(truth.hosts)))
    if wanted in found:
        return Verdict(1, 0, len(found) - 1, 0)
    of_kind = sum(1 for kind, _, _ in found if kind == truth.kind)
    return Verdict(0, 1, len(found), 1 if of_kind else 0)


def verdict_of(row: Mapping[str, Any]) -> Verdict:
    """A verdict as a trial's JSON record stores it (``dataclasses.asdict``)."""
    return Verdict(int(row["tp"]), int(row["fn"]), int(row["fp"]), int(row["wrong_culprit"]))


@dataclass
class Tally:
    """Verdicts added up: each with whether its trial had a fault; ``seconds``: the time from fault
    to incident of each true positive."""

    added: list[tuple[Verdict, bool]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def add(self, verdict: Verdict, faulty: bool, seconds: float | None = None) -> None:
        self.added.append((verdict, faulty))
        if verdict.tp and seconds is not None:
            self.seconds.append(seconds)

    @property
    def trials(self) -> int:
        return len(self.added)

    @property
    def faults(self) -> int:
        return sum(1 for _, faulty in self.added if faulty)

    @property
    def clean(self) -> int:
        return self.trials - self.faults

    @property
    def clean_alarmed(self) -> int:
        """Clean trials with any incident."""
        return sum(1 for v, faulty in self.added if not faulty and v.fp)

    def total(self, count: str) -> int:
        """One of the verdicts' counts (tp, fn, fp, wrong_culprit), summed."""
        return sum(getattr(v, count) for v, _ in self.added)

    @property
    def precision(self) -> float | None:
        tp, fp = self.total("tp"), self.total("fp")
        return tp / (tp + fp) if tp + fp else None

    @property
    def recall(self) -> float | None:
        tp, fn = self.total("tp"), self.total("fn")
        return tp / (tp + fn) if tp + fn else None

    @property
    def f1(self) -> float | None:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p is not None and r is not None and p + r else None

    @property
    def wrong_culprit_rate(self) -> float | None:
        """Of the trials with a fault, those where its kind was raised naming someone else."""
        return self.total("wrong_culprit") / self.faults if self.faults else None

    @property
    def false_alarm_rate(self) -> float | None:
        """Of the clean trials, those with any incident."""
        return self.clean_alarmed / self.clean if self.clean else None

    def percentile(self, q: float) -> float | None:
        """The ``q`` quantile (0.5: the median) of the time to incident, nearest rank."""
        if not self.seconds:
            return None
        if q == 0.5:
            return statistics.median(self.seconds)
        return sorted(self.seconds)[max(0, math.ceil(q * len(self.seconds)) - 1)]


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


HEADER = ("| {by} | diagnosis | trials | faults | clean | TP | FN | FP | precision | recall | F1 | wrong culprit | "
          "median s | p90 s | clean false alarms |")  # fmt: skip


def table(by: str, sides: Mapping[str, Mapping[str, Tally]]) -> list[str]:
    """A markdown table, two rows per group: each side's (live, offline) figures, one under the other."""
    rows = [HEADER.format(by=by), "|" + "---|" * 15]
    for name in sorted({n for tallies in sides.values() for n in tallies}):
        for side, tallies in sides.items():
            t = tallies.get(name, Tally())
            alarms = f"{t.clean_alarmed}/{t.clean}" if t.clean else "-"
            rows.append(
                f"| {name} | {side} | {t.trials} | {t.faults} | {t.clean} | {t.total('tp')} | {t.total('fn')} | {t.total('fp')} | {_fmt(t.precision)} | "
                f"{_fmt(t.recall)} | {_fmt(t.f1)} | {_fmt(t.wrong_culprit_rate)} | {_fmt(t.percentile(0.5), 1)} | "
                f"{_fmt(t.percentile(0.9), 1)} | {alarms} |"
            )
    return rows
