"""The slow-link detector's window: every point-to-point transfer of the newest steps, kept from one
pass to the next and read again only where the store holds more.

Joining a 10-step window of transfers with the comm spans (to know when each side arrived) took
3.6 s a pass at 100,096 ranks, while a pass brings at most one new step. Here a step's transfers
are read when the step first appears in the window and again only when the store's count of its
rows grew (point-to-point records and comm-span pieces: a rank's rows that came late are read with
their step); the per-pair medians over the window are computed again only when a step changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from rankscope.collector.diagnosis.context import RunContext, pages

_RUN = "run_id = {run:String} AND attempt = {attempt:UInt16}"
_STEPS = "step BETWEEN {first_step:UInt32} AND {last_step:UInt32}"
#: how much of each step the store holds: point-to-point records, and pieces of comm spans
COUNTS_SQL = (
    f"SELECT step, sum(n) AS n FROM (SELECT step, count() AS n FROM collectives WHERE {_RUN} AND peer >= 0 AND {_STEPS} "
    f"GROUP BY step UNION ALL SELECT step, sum(pieces) AS n FROM step_segments WHERE {_RUN} AND kind = 'comm' AND {_STEPS} "
    "GROUP BY step) GROUP BY step"
)
TRANSFERS_SQL = """
WITH p2p AS (
    SELECT rank, group_name, seq, op, peer, nbytes, step, issue_time, end_time
    FROM collectives
    WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND peer >= 0 AND step IN {steps:Array(UInt32)}
      AND end_time > toDateTime64(0, 9)
),
arrived AS (
    SELECT c.rank AS rank, c.group_name AS group_name, c.seq AS seq, c.op AS op, c.peer AS peer, c.nbytes AS nbytes,
           c.step AS step, c.end_time AS end_time,
           if(s.end_time >= c.issue_time, least(s.start_time, c.issue_time), c.issue_time) AS arrival
    FROM p2p AS c
    ASOF LEFT JOIN (
        SELECT rank, start_time, end_time FROM spans
        WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND kind = 'comm' AND step IN {steps:Array(UInt32)}
    ) AS s ON c.rank = s.rank AND c.issue_time >= s.start_time
)
SELECT snd.rank AS src, rcv.rank AS dst, snd.nbytes AS nbytes, snd.step AS step,
       greatest(toUnixTimestamp64Nano(rcv.end_time) - greatest(toUnixTimestamp64Nano(snd.arrival), toUnixTimestamp64Nano(rcv.arrival)), 0) AS t,
       toUnixTimestamp64Nano(rcv.end_time) AS end_ns
FROM (SELECT * FROM arrived WHERE positionCaseInsensitive(op, 'send') > 0) AS snd
INNER JOIN (SELECT * FROM arrived WHERE positionCaseInsensitive(op, 'recv') > 0) AS rcv
    ON snd.group_name = rcv.group_name AND snd.seq = rcv.seq AND snd.rank = rcv.peer AND snd.peer = rcv.rank
"""
"""A transfer is timed from the moment both sides arrived to the moment the receiver has the data,
clamped at 0. A rank arrives when it enters the comm span around the operation, else at the
operation's issue time."""


#: the pairs of a window: src, dst, nbytes, transfers (at least 2), median_ns (exact, np.median's),
#: first_ns and last_ns (when the first and last ended)
PAIR_COLUMNS = ("src", "dst", "nbytes", "transfers", "median_ns", "first_ns", "last_ns")


@dataclass
class TransferWindow:
    """Per step: the store's count of its rows when read, and its transfers (a DataFrame of src, dst,
    nbytes, t, end_ns); the pairs of the last window computed, and that window."""

    counts: dict[int, int] = field(default_factory=dict)
    transfers: dict[int, pd.DataFrame] = field(default_factory=dict)
    window: tuple[int, int, tuple[tuple[int, int], ...]] | None = None
    pairs: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=PAIR_COLUMNS))
    steps: int = 0

    @classmethod
    def of(cls, ctx: RunContext) -> TransferWindow:
        """The window kept for the run's attempt (a new one on the first pass)."""
        window = ctx.seen.get("slow_link.window")
        if window is None:
            window = ctx.seen["slow_link.window"] = cls()
        return window  # type: ignore[no-any-return]

    def pairs_of(self, ctx: RunContext, first_step: int, last_step: int) -> tuple[pd.DataFrame, int]:
        """The pairs of steps ``first_step`` .. ``last_step`` (``PAIR_COLUMNS``, a row per (src, dst,
        nbytes) with two transfers or more), and how many of those steps have transfers at all."""
        window = {"run": ctx.run_id, "first_step": first_step, "last_step": last_step}
        counts = {int(r["step"]): int(r["n"]) for r in ctx.query(COUNTS_SQL, window).to_pylist()}
        stale = sorted(s for s, n in counts.items() if self.counts.get(s) != n)
        for steps in pages({s: counts[s] for s in stale}):  # a row per transfer: a page of steps at a time at scale
            rows = ctx.query(TRANSFERS_SQL, {"run": ctx.run_id, "steps": steps}).to_pandas()
            for step in steps:
                self.counts[step] = counts[step]
                self.transfers[step] = rows[rows["step"] == step].drop(columns="step")
        for step in [s for s in self.transfers if not first_step <= s <= last_step]:
            self.transfers.pop(step)
            self.counts.pop(step, None)
        key = (first_step, last_step, tuple(sorted(counts.items())))
        if key != self.window:
            parts = [t for _, t in sorted(self.transfers.items()) if len(t)]
            self.window, self.pairs, self.steps = key, _pairs(parts), len(parts)
        return self.pairs, self.steps


def _pairs(parts: list[pd.DataFrame]) -> pd.DataFrame:
    if not parts:
        return pd.DataFrame(columns=PAIR_COLUMNS)
    grouped = pd.concat(parts, ignore_index=True).groupby(["src", "dst", "nbytes"], sort=False).agg(
        transfers=("t", "size"), median_ns=("t", "median"), first_ns=("end_ns", "min"), last_ns=("end_ns", "max"))
    return grouped[grouped["transfers"] >= 2].reset_index()
