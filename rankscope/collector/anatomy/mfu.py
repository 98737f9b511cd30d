"""The waterfall: from the peak to what the job achieved, what each category of the step takes away.

Where the trainer reports MFU (model FLOPs utilisation, GPU runs), in MFU: with ``T`` the mean step
wall time of a rank, ``C`` its compute time and ``m`` the achieved MFU, the MFU the step would have
if it were compute alone is ``m_c = m * T / C``. From the peak (100%) the kernels' own shortfall
takes ``1 - m_c``; then each other category of time ``k`` takes ``m * k / C`` (those add up to
``m_c - m``), largest first, down to ``m``.

Without MFU (CPU runs, scripts that report none), in time: the step's wall time split into the
categories, largest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rankscope.collector.anatomy.categories import CATEGORIES, Split


@dataclass(frozen=True)
class Bar:
    """One bar: ``label`` takes ``value`` away (a category), or is where the fall starts or ends."""

    label: str
    value: float  # MFU as a fraction (unit "mfu") or milliseconds (unit "ms")
    unit: str
    #: share of the step's time (categories only)
    share: float | None = None
    total: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"label": self.label, "value": round(self.value, 6 if self.unit == "mfu" else 3), "unit": self.unit,
                "share": None if self.share is None else round(self.share, 4), "total": self.total}  # fmt: skip


def waterfall(split: Split) -> list[Bar]:
    """The waterfall of a breakdown (its range's ``total``, or one step's)."""
    t, c, m = split.wall_ns, split.ns["compute"], split.mfu
    others = sorted((k for k in CATEGORIES if k != "compute"), key=lambda k: -split.ns[k])
    if m is not None and c > 0 and t > 0:
        ideal = m * t / c
        bars = [Bar("peak", 1.0, "mfu", total=True), Bar("compute below peak", 1.0 - ideal, "mfu", split.share("compute"))]
        bars += [Bar(k, m * split.ns[k] / c, "mfu", split.share(k)) for k in others]
        return [*bars, Bar("achieved", m, "mfu", total=True)]
    ordered = sorted(CATEGORIES, key=lambda k: -split.ns[k])
    return [Bar("step", t / 1e6, "ms", 1.0, total=True), *(Bar(k, split.ns[k] / 1e6, "ms", split.share(k)) for k in ordered)]
