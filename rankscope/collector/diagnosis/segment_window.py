"""The straggler detector's window: every rank's time per compute segment and step over the newest
steps, kept from one pass to the next and read again only where the store holds more.

At 100,096 ranks the window holds about ten million (rank, segment, step) points. Comparing them in
SQL (nested window functions over all of them) took 9.5 s a pass. Here a (segment, step) cell is read
when it first appears and again only when the store's count of its pieces grew: a rank's rows that
came late (a flush interval longer than a step, a spool replayed after an outage) are read with
their cell, however far behind the newest step they are. The comparisons are numpy over dense
per-rank arrays (a cell is an array indexed by rank, NaN where a rank has no point).

A point is compared with the median of its stage at that step (exact, numpy's: the mean of the two
middle values); in a cell of four ranks or fewer of a stage, with the median of the others (the
point would pull a small median towards itself). The ratio is capped at 1 where the excess is too
small to matter. A rank's segment is slow at a step when its ratio reaches its threshold:
1 + max(excess, 3 robust standard deviations (1.4826 MAD) of its stage's recent ratios), so that a
busy host's noise does not read as a straggler while a real one still stands out; at a step where
the stage's ratios scatter more than that (``STEP_NOISE_FROM`` other ranks or more), that scatter. In a stage of up
to ``LEAVE_ONE_OUT_UP_TO`` ranks the noise is that of the other ranks (a quarter of a four-rank
stage's points are the straggler's own, which would raise its bar); in a larger stage one rank's
share moves the MAD little. "Recent": each rank's newest ``window`` points, wherever they lie.

Wall time is compared on a step's compute as a whole (``STEP_COMPUTE``: its segments summed per
rank), not segment by segment: a CPU quota throttles in bursts, so a starved rank's single segment
sometimes runs in a period with quota to spare, while the step as a whole waits every time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from rankscope.collector.anatomy.path import by_rank
from rankscope.collector.diagnosis.context import RunContext, pages

#: the kinds of segment that measure a rank's own work
KINDS = "('compute', 'data', 'optimizer')"
#: the series of a step's compute segments summed, compared in wall time
STEP_COMPUTE = "step compute"
#: stages of up to this many ranks measure a rank's noise on the other ranks' points
LEAVE_ONE_OUT_UP_TO = 16
#: a step's own scatter raises its bar where this many other ranks of the stage have a point there
STEP_NOISE_FROM = 5
#: a stage cell of up to this many ranks compares each point with the median of the others
SMALL_CELL = 4

_WINDOW = "run_id = {run:String} AND attempt = {attempt:UInt16} AND kind IN " + KINDS
#: how much of each (segment, step) cell the store holds: pieces only add up (merges keep the sum)
CELLS_SQL = (
    f"SELECT name, step, sum(pieces) AS pieces FROM step_segments WHERE {_WINDOW} "
    "AND step BETWEEN {first_step:UInt32} AND {last_step:UInt32} GROUP BY name, step"
)
READ_SQL = (
    "SELECT name, step, rank, sum(total_ns) AS wall, sum(total_cpu_ns) AS cpu, sum(pieces) = sum(cpu_pieces) AS has_cpu, "
    f"sum(cpu_pieces) > 0 AS some_cpu FROM step_segments WHERE {_WINDOW} AND step IN {{steps:Array(UInt32)}} GROUP BY name, step, rank "
    "ORDER BY name, step"
)
STARTED_SQL = (
    "SELECT name, step, rank, toUnixTimestamp64Nano(min(first_start)) AS started FROM step_segments "
    f"WHERE {_WINDOW} AND step BETWEEN {{first_step:UInt32}} AND {{last_step:UInt32}} AND rank IN {{ranks:Array(UInt32)}} "
    "GROUP BY name, step, rank"
)


@dataclass
class Cell:
    """One segment's points at one step: per rank (the index), its wall and CPU time in ns."""

    pieces: int
    wall: np.ndarray
    #: None when a piece of a point had no CPU time measured
    cpu: np.ndarray | None
    #: some piece had its CPU time measured
    some_cpu: bool
    #: per measure (wall time or not), its points and what each is compared with (``stage_medians``),
    #: the ranks ordered by stage: computed once per cell, not once a pass
    rows: dict[bool, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def row(self, wall: bool, stage_cols: dict[int, np.ndarray], order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Its points (wall or CPU time) and the medians of their stage (or of the others') that they are
        compared with, the ranks in ``order`` (``stage_cols``' columns one stage after another)."""
        if wall not in self.rows:
            ns = self.wall if wall else self.cpu
            assert ns is not None
            out = np.full(len(ns), np.nan)
            for cols in stage_cols.values():
                inside = cols[cols < len(ns)]
                out[inside] = stage_medians(ns[inside][None, :])[0]
            self.rows[wall] = (_padded(ns, len(order))[order], _padded(out, len(order))[order])
        return self.rows[wall]


#: one series' (name, steps, points, medians, in wall time): points and medians are steps x ranks
_Matrix = tuple[str, np.ndarray, np.ndarray, np.ndarray, bool]


@dataclass
class Series:
    """A (rank, segment) that was slow at ``min_steps`` or more steps of the window."""

    rank: int
    segment: str
    threshold: float
    wall_only: bool
    #: (step, ratio, ns, median ns, the ratio it is slow from at that step), by step
    points: list[tuple[int, float, float, float, float]]


@dataclass
class SegmentWindow:
    """The cells of steps ``first``..``last`` of one attempt, as the store held them when read."""

    cells: dict[tuple[str, int], Cell] = field(default_factory=dict)
    #: the ranks' stages the cells' medians were computed with
    stages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: step -> (its cells' pieces, every rank's compute in wall time, its stage's medians), ranks by stage
    step_rows: dict[int, tuple[tuple, np.ndarray, np.ndarray]] = field(default_factory=dict)
    #: (wall, min_excess_ns, excess, window, min_steps) -> (the cells judged, the slow series found):
    #: a pass with nothing new (most of them: a step of 100,000 ranks arrives every several passes) judges nothing again
    judged: dict[tuple, tuple[list[tuple[tuple[str, int], Cell]], list[Series]]] = field(default_factory=dict)

    @classmethod
    def of(cls, ctx: RunContext) -> SegmentWindow:
        """The window kept for ``ctx``'s attempt between passes (a new one the first time)."""
        window = ctx.seen.get("straggler.window")
        if not isinstance(window, cls):
            window = ctx.seen["straggler.window"] = cls()
        return window

    def refresh(self, ctx: RunContext, first: int, last: int) -> None:
        """Hold steps ``first``..``last``: cells that are new or grew in the store are read (again)."""
        held = ctx.query(CELLS_SQL, {"run": ctx.run_id, "first_step": first, "last_step": last}).to_pydict()
        stored = {(n, s): p for n, s, p in zip(held["name"], held["step"], held["pieces"])}
        self.cells = {key: cell for key, cell in self.cells.items() if key in stored}
        stale = {key for key, pieces in stored.items() if key not in self.cells or self.cells[key].pieces != pieces}
        # a step's read is a row per (segment, rank): 500,000 at 100,096 ranks, so a page of steps at a time
        cells = Counter(s for _, s in stored)
        for steps in pages({s: cells[s] * max(len(ctx.stage), 1) for _, s in stale}):
            self._read(ctx, steps, stale, stored)

    def _read(self, ctx: RunContext, steps: list[int], stale: set[tuple[str, int]], stored: dict[tuple[str, int], int]) -> None:
        """Read the ``stale`` cells of ``steps`` (``stored``: each cell's pieces in the store)."""
        table = ctx.query(READ_SQL, {"run": ctx.run_id, "steps": steps})
        names = table.column("name").cast(pa.string()).combine_chunks().dictionary_encode()
        cols = {c: table.column(c).to_numpy() for c in ("step", "rank", "wall", "cpu", "has_cpu", "some_cpu")}
        code, step = names.indices.to_numpy(), cols["step"]
        size = max(len(ctx.stage), int(cols["rank"].max()) + 1 if len(step) else 0)
        # rows come ordered by (name, step): one slice per cell
        bounds = [0, *(np.flatnonzero((code[1:] != code[:-1]) | (step[1:] != step[:-1])) + 1), len(step)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            key = (names.dictionary[code[lo]].as_py(), int(step[lo])) if hi > lo else None
            if key not in stale:
                continue
            ranks = cols["rank"][lo:hi]
            wall = np.full(size, np.nan)
            wall[ranks] = cols["wall"][lo:hi]
            cpu = None
            if cols["has_cpu"][lo:hi].all():
                cpu = np.full(size, np.nan)
                cpu[ranks] = cols["cpu"][lo:hi]
            self.cells[key] = Cell(stored[key], wall, cpu, bool(cols["some_cpu"][lo:hi].any()))

    @property
    def cpu_measured(self) -> bool:
        """Whether any piece in the window had its CPU time measured."""
        return any(cell.some_cpu for cell in self.cells.values())

    def slow_series(self, stage: dict[int, int], *, wall: bool, min_excess_ns: float, excess: float, window: int,
                    min_steps: int) -> list[Series]:  # fmt: skip
        """The slow series, slow at ``min_steps`` or more steps; ``stage``: rank -> pipeline stage (0
        where unknown). Each segment, measured in CPU time where every piece of it in the window had
        it; with ``wall``, the step's compute as a whole (``STEP_COMPUTE``), in wall time."""
        if not self.cells:
            return []
        stages = by_rank(stage, max(len(c.wall) for c in self.cells.values()), missing=0)  # pp ranks are >= 0 (context)
        if not np.array_equal(stages, self.stages):  # a rank registered since: the medians are of other stages
            self.stages = stages
            self.step_rows.clear()
            self.judged.clear()
            for cell in self.cells.values():
                cell.rows.clear()
        asked, cells = (wall, min_excess_ns, excess, window, min_steps), list(self.cells.items())
        if asked in self.judged and _same(self.judged[asked][0], cells):
            return list(self.judged[asked][1])
        stage_cols = {int(s): np.flatnonzero(stages == s) for s in np.unique(stages)}
        # the ranks ordered by stage: a stage is a slice of columns (a view, not a copy)
        order = np.concatenate(list(stage_cols.values()))
        edges = np.cumsum([0, *(len(cols) for cols in stage_cols.values())])
        series = [self._step_compute(len(stages), order, edges)] if wall else self._segments(order, stage_cols)
        found: list[Series] = []
        for name, steps, ns, median, wall_only in series:
            for x in slow_columns(name, steps, ns, median, edges, wall_only=wall_only, min_excess_ns=min_excess_ns, excess=excess,
                           window=window, min_steps=min_steps):  # fmt: skip
                x.rank = int(order[x.rank])
                found.append(x)
        self.judged[asked] = (cells, found)
        return list(found)

    @property
    def names(self) -> list[str]:
        """The segments the window holds."""
        return sorted({n for n, _ in self.cells})

    def _segments(self, order: np.ndarray, stage_cols: dict[int, np.ndarray]) -> list[_Matrix]:
        """Per segment: its steps and its points and medians (steps x ranks in ``order``), in CPU time
        where every piece of it had that measured."""
        out = []
        for name in self.names:
            steps = sorted(s for n, s in self.cells if n == name)
            cells = [self.cells[(name, s)] for s in steps]
            wall_only = any(c.cpu is None for c in cells)
            rows = [c.row(wall_only, stage_cols, order) for c in cells]
            out.append((name, np.asarray(steps), np.vstack([r[0] for r in rows]), np.vstack([r[1] for r in rows]), wall_only))
        return out

    def _step_compute(self, size: int, order: np.ndarray, edges: np.ndarray) -> _Matrix:
        """Every rank's wall time in all the compute segments of each step, with its stage's medians
        (a rank with no point in a step has none; one missing some segment of it has the sum of the rest).
        A step's row is summed again only when one of its cells was read again."""
        by_step: dict[int, list[tuple[str, Cell]]] = {}
        for (name, s), cell in self.cells.items():
            by_step.setdefault(s, []).append((name, cell))
        steps = sorted(by_step)
        self.step_rows = {s: kept for s, kept in self.step_rows.items() if s in by_step}
        for s in steps:
            pieces = tuple((name, cell.pieces) for name, cell in by_step[s])
            if s in self.step_rows and self.step_rows[s][0] == pieces:
                continue
            total, seen = np.zeros(size), np.zeros(size, dtype=bool)
            for _, cell in by_step[s]:
                wall = _padded(cell.wall, size)
                total += np.nan_to_num(wall)
                seen |= ~np.isnan(wall)
            total[~seen] = np.nan
            ns = total[order][None, :]
            median = np.hstack([stage_medians(ns[:, lo:hi]) for lo, hi in zip(edges[:-1], edges[1:])])
            self.step_rows[s] = (pieces, ns[0], median[0])
        ns = np.vstack([self.step_rows[s][1] for s in steps])
        median = np.vstack([self.step_rows[s][2] for s in steps])
        return STEP_COMPUTE, np.asarray(steps), ns, median, True

    def started(self, ctx: RunContext, first: int, last: int, ranks: Iterable[int]) -> dict[tuple[int, str, int], int]:
        """(rank, segment, step) -> when the segment began (ns), for ``ranks`` over steps ``first``..``last``."""
        params = {"run": ctx.run_id, "first_step": first, "last_step": last, "ranks": sorted(set(ranks))}
        table = ctx.query(STARTED_SQL, params).to_pydict()
        started = {(r, n, s): t for n, s, r, t in zip(table["name"], table["step"], table["rank"], table["started"])}
        for (r, _, s), t in list(started.items()):  # a step's compute began with its first segment
            started[(r, STEP_COMPUTE, s)] = min(t, started.get((r, STEP_COMPUTE, s), t))
        return started


def episode(points: list[tuple], slow: Callable[[tuple], bool]) -> list[tuple]:
    """The newest run of ``slow`` points (by step), allowing single points that are not inside it (noise)."""
    start = len(points) - 1
    i = start - 1
    while i >= 0:
        if slow(points[i]):
            start = i
        elif i == 0 or not slow(points[i - 1]):
            break  # two fast steps in a row (or the first step): the episode began after them
        i -= 1
    return points[start:]


def _padded(values: np.ndarray, size: int) -> np.ndarray:
    return values if len(values) == size else np.concatenate([values, np.full(size - len(values), np.nan)])


def slow_columns(name: str, steps: np.ndarray, ns: np.ndarray, median: np.ndarray, edges: np.ndarray, *, wall_only: bool,
          min_excess_ns: float, excess: float, window: int, min_steps: int) -> list[Series]:  # fmt: skip
    """The slow series of one segment (``rank``: the column); ``ns`` and ``median``: steps x ranks
    (NaN: no point), the ranks of a stage in the columns ``edges[i]:edges[i + 1]``."""
    # a point is one of its rank's recent ones, and counts in its stage's width, when its cell has a
    # median (two points or more), even a median of 0 (a segment of no CPU time), which compares nothing
    counted = ~np.isnan(median)
    recent = _newest(counted, window)
    median[~(median > 0)] = np.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = ns / median
        np.minimum(ratio, 1.0, out=ratio, where=ns - median < min_excess_ns)
    valid = ~np.isnan(ratio)
    recent &= valid
    threshold = np.empty(ns.shape[1])  # per rank, from the noise of the recent steps
    bar = np.empty(ns.shape)  # per point: that, or higher at a step whose stage is scattered
    for lo, hi in zip(edges[:-1], edges[1:]):
        widest = int(counted[:, lo:hi].sum(axis=1).max())
        noise = _noise(ratio[:, lo:hi], recent[:, lo:hi], widest)
        threshold[lo:hi] = 1 + np.maximum(excess, 3 * 1.4826 * noise)
        if min_steps > 0 and not (valid[:, lo:hi] & ~(ratio[:, lo:hi] < threshold[None, lo:hi])).any():
            bar[:, lo:hi] = threshold[None, lo:hi]  # no point reaches it: a step's scatter could only raise the bar
            continue
        bar[:, lo:hi] = 1 + np.maximum(excess, 3 * 1.4826 * np.fmax(noise[None, :], _step_noise(ratio[:, lo:hi])))
    slow_steps = (ratio >= bar).sum(axis=0)
    out = []
    for rank in np.flatnonzero(slow_steps >= min_steps):
        at = np.flatnonzero(valid[:, rank])
        points = [(int(steps[i]), float(ratio[i, rank]), float(ns[i, rank]), float(median[i, rank]), float(bar[i, rank])) for i in at]
        out.append(Series(int(rank), name, float(threshold[rank]), wall_only, points))
    return out


def _same(held: list[tuple[tuple[str, int], Cell]], cells: list[tuple[tuple[str, int], Cell]]) -> bool:
    """Whether ``cells`` are the very cells ``held`` (kept alive there: an object's id is never reused)."""
    return len(held) == len(cells) and all(k == j and c is d for (k, c), (j, d) in zip(held, cells))


def _newest(counted: np.ndarray, window: int) -> np.ndarray:
    """Per column (steps x ranks), its newest ``window`` points that are ``counted``: a row at a time from
    the newest (a cumulative sum down reversed columns of 100,000 ranks is ten times slower)."""
    out = np.zeros_like(counted)
    seen = np.zeros(counted.shape[1], dtype=np.int64)
    for i in range(len(counted) - 1, -1, -1):
        seen += counted[i]
        out[i] = counted[i] & (seen <= window)
    return out


def stage_medians(ns: np.ndarray) -> np.ndarray:
    """Per point (steps x the stage's ranks), the median it is compared with; NaN where its cell has
    fewer than two points. Cells of up to ``SMALL_CELL`` points: the median of the others."""
    present = ~np.isnan(ns)
    count = present.sum(axis=1)
    out = np.full(ns.shape, np.nan)
    wide = count > SMALL_CELL
    if wide.any():
        out[wide] = np.nanmedian(ns[wide], axis=1)[:, None]
    for i in np.flatnonzero((count >= 2) & ~wide):
        cols = np.flatnonzero(present[i])
        values = ns[i, cols]
        for j, col in enumerate(cols):
            out[i, col] = np.median(np.delete(values, j))
    out[~present] = np.nan
    return out


def _step_noise(ratio: np.ndarray) -> np.ndarray:
    """Per point of one stage (steps x ranks), the scatter of the other ranks' ratios at its step: half
    their interquartile range (the MAD of a symmetric spread; a stage split in two groups of unequal
    size has a MAD of 0); NaN where fewer than ``STEP_NOISE_FROM`` others have one. A step where the
    stage splits (some of a busy machine's ranks run slower for a while) is no evidence against one."""
    others = (~np.isnan(ratio)).sum(axis=1, keepdims=True) - ~np.isnan(ratio)
    if ratio.shape[1] <= LEAVE_ONE_OUT_UP_TO:
        out = np.column_stack([_half_iqr(np.delete(ratio, j, axis=1)) for j in range(ratio.shape[1])])
    else:  # one rank moves the quartiles of thousands little
        out = np.repeat(_half_iqr(ratio)[:, None], ratio.shape[1], axis=1)
    out[others < STEP_NOISE_FROM] = np.nan
    return out


def _half_iqr(values: np.ndarray) -> np.ndarray:
    """Half the interquartile range of each row's values (NaN: no value; a row of none gives NaN).
    Rows of as many values are one vectorised percentile (numpy's nanpercentile goes row by row:
    most of a pass at 100,000 ranks); the result is the same, value for value."""
    out = np.full(values.shape[0], np.nan)
    count = (~np.isnan(values)).sum(axis=1)
    ordered = None
    for n in np.unique(count[count > 0]):
        rows = np.flatnonzero(count == n)
        if n == values.shape[1]:
            block = values[rows]
        else:
            ordered = np.sort(values, axis=1) if ordered is None else ordered  # NaN sorts last
            block = ordered[rows, :n]
        q1, q3 = np.percentile(block, [25, 75], axis=1)
        out[rows] = (q3 - q1) / 2
    return out


def _noise(ratio: np.ndarray, recent: np.ndarray, widest: int) -> np.ndarray:
    """Per rank of one stage (steps x ranks), the MAD of the recent ratios it is judged against: the
    stage's, or in a stage of up to ``LEAVE_ONE_OUT_UP_TO`` ranks the other ranks'."""
    values = ratio[recent]
    if values.size == 0:
        return np.full(ratio.shape[1], np.nan)
    stage_mad = np.median(np.abs(values - np.median(values)))
    out = np.full(ratio.shape[1], stage_mad)
    if widest <= LEAVE_ONE_OUT_UP_TO:
        for j in range(ratio.shape[1]):
            others = np.delete(ratio, j, axis=1)[np.delete(recent, j, axis=1)]
            if others.size:
                out[j] = np.median(np.abs(others - np.median(others)))
    return out
