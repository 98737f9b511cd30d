"""The straggler's window judged on points written by hand: a step's compute as a whole in wall time,
and a step where the stage's ranks scatter raising its bar.

One stage of eight ranks, steps 1..12; each (segment, step) cell holds every rank's wall and CPU time.
"""

from __future__ import annotations

import numpy as np

from rankscope.collector.diagnosis.segment_window import STEP_COMPUTE, Cell, SegmentWindow

RANKS, STEPS = 8, range(1, 13)
MS = 1e6
STAGE = {r: 0 for r in range(RANKS)}
CPU = dict(wall=False, min_excess_ns=2 * MS, excess=0.10, window=6, min_steps=3)
WALL = dict(wall=True, min_excess_ns=2 * MS, excess=1.0, window=6, min_steps=5)


def window(cells: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]) -> SegmentWindow:
    """A window holding ``cells``: (segment, step) -> (wall ns, CPU ns) per rank."""
    return SegmentWindow({key: Cell(RANKS, wall, cpu, True) for key, (wall, cpu) in cells.items()})


def noise(step: int, segment: str) -> np.ndarray:
    """Each rank's share of its work at a step: within a few percent, as on a quiet machine."""
    return 1 + 0.03 * np.sin(np.arange(RANKS) * 1.7 + step * 0.9 + len(segment))


def test_a_starved_rank_is_judged_on_its_steps_compute_as_a_whole() -> None:
    """Rank 5 gets its CPU in bursts: at each step one of its segments runs at full speed and the
    other waits three times as long. Neither segment is twice as slow at every step; the step is."""
    cells = {}
    for step in STEPS:
        for i, segment in enumerate(("forward", "backward")):
            cpu = 40 * MS * noise(step, segment)
            wall = cpu.copy()
            wall[5] *= 3.0 if (step + i) % 2 else 1.0
            cells[(segment, step)] = (wall, cpu)
    w = window(cells)
    assert w.slow_series(STAGE, **CPU) == []  # the same work in the same CPU time
    assert w.slow_series(STAGE, **{**WALL, "wall": False, "excess": 1.0, "min_steps": 5}) == []  # no segment alone
    found = w.slow_series(STAGE, **WALL)
    assert [(x.rank, x.segment, x.wall_only) for x in found] == [(5, STEP_COMPUTE, True)]
    assert all(1.9 < p[1] < 2.1 for p in found[0].points)


def test_a_step_where_the_stage_splits_is_no_evidence_against_one_rank() -> None:
    """At steps 3, 4, 7 and 8 half the stage runs 25% slower than the other half (a busy machine's
    cores); rank 6 is 30% slower than the stage's median then and at no other step. Rank 2 is 30%
    slower at steps 9-12, when the stage is quiet: a straggler."""
    cells = {}
    for step in STEPS:
        cpu = 40 * MS * noise(step, "forward")
        if step in (3, 4, 7, 8):
            cpu[[2, 3, 6, 7]] *= 1.12
            cpu[[0, 1, 4, 5]] *= 0.88
            cpu[6] *= 1.18
        if step >= 9:
            cpu[2] *= 1.3
        cells[("forward", step)] = (cpu.copy(), cpu)
    w = window(cells)
    found = w.slow_series(STAGE, **CPU)
    assert [x.rank for x in found] == [2]
    bars = {p[0]: p[4] for p in found[0].points}
    assert min(bars[s] for s in (3, 4, 7, 8)) > 1.3 and max(bars[s] for s in (9, 10, 11, 12)) < 1.2
    assert w.slow_series(STAGE, **CPU) == found  # kept: nothing new
    for step in (11, 12):  # rank 2 back to speed in the newest two steps: the cells that changed are judged again
        cpu = 40 * MS * noise(step, "forward")
        w.cells[("forward", step)] = Cell(RANKS, cpu.copy(), cpu, True)
    assert w.slow_series(STAGE, **CPU) == []
