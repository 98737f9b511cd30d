"""Step anatomy: where a step's time goes, the chain of ranks that set its length, and what fixing a link buys.

- ``breakdown``: per step, per rank and for the range, the time in compute, exposed communication,
  pipeline bubble, data loading, optimizer and unexplained, computed in the store by one SQL
  statement per range of steps (``categories.BREAKDOWN_SQL``);
- ``critical_path``: the critical path of one step across ranks, and what each link of it costs;
- ``waterfall``: from peak MFU (or the step's time, without MFU) to what was achieved.

Every function reads through ``query(sql, params) -> pyarrow.Table``: a collector client, a store
reader, the collector's own store, or a detector's ``RunContext.query``. Steps run again after a
restart count with their latest attempt. docs/anatomy.md has the method and the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rankscope.collector.anatomy.categories import CATEGORIES, Breakdown, Query, Split, breakdown
from rankscope.collector.anatomy.mfu import Bar, waterfall
from rankscope.collector.anatomy.path import Cost, CriticalPath, Link, critical_path

__all__ = [
    "CATEGORIES", "Anatomy", "Bar", "Breakdown", "Cost", "CriticalPath", "Link", "Split", "anatomy", "breakdown",
    "critical_path", "step_range", "waterfall",
]  # fmt: skip

STEPS_SQL = """
SELECT min(step) AS first_step, max(step) AS last_step, count() AS rows
FROM step_segments WHERE run_id = {run:String} AND step > 0
"""


@dataclass
class Anatomy:
    run_id: str
    first_step: int
    last_step: int
    breakdown: Breakdown
    #: the step whose critical path was followed (the median step of the range unless asked)
    path_step: int | None = None
    path: CriticalPath | None = None
    waterfall: list[Bar] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        b = self.breakdown
        return {
            "run_id": self.run_id, "first_step": self.first_step, "last_step": self.last_step,
            "total": b.total.as_json() if b.total else None,
            "by_step": [{"step": s, **split.as_json()} for s, split in sorted(b.by_step.items())],
            "by_rank": [{"rank": r, **split.as_json()} for r, split in sorted(b.by_rank.items())],
            "critical_path": self.path.as_json() if self.path else None,
            "waterfall": [bar.as_json() for bar in self.waterfall],
        }  # fmt: skip


def step_range(query: Query, run_id: str) -> tuple[int, int] | None:
    """(first, last) step of ``run_id`` with segments stored; None when it has none."""
    row = query(STEPS_SQL, {"run": run_id}).to_pylist()[0]
    return (int(row["first_step"]), int(row["last_step"])) if row["rows"] else None


def anatomy(query: Query, run_id: str, first_step: int, last_step: int, *, path_step: int | None = None) -> Anatomy:
    """The breakdown of steps ``first_step``..``last_step``, the critical path of ``path_step`` (default:
    the range's median step) and the waterfall of the range."""
    b = breakdown(query, run_id, first_step, last_step)
    step = path_step if path_step is not None else b.median_step()
    path = critical_path(query, run_id, step) if step is not None else None
    return Anatomy(run_id, first_step, last_step, b, step, path, waterfall(b.total) if b.total else [])
