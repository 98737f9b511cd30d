"""What every detector needs to know about a run: its ranks, hosts, stages and groups, read once per pass."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from clickhouse_connect.driver.binding import format_bind_value

from rankscope.collector.anatomy.path import GROUPS_SQL, GroupIndex
from rankscope.common.incidents import who
from rankscope.common.settings import Settings

#: ``query(sql, params) -> pyarrow.Table``: a collector client, a store reader, or the collector's own store
Query = Callable[[str, Mapping[str, object]], pa.Table]


STEP_TIME_SQL = (
    "SELECT median(value) AS step_s FROM step_metrics WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND name = 'step_time_s' "
    "AND step BETWEEN {first_step:UInt32} AND {last_step:UInt32}"
)


#: rows a window read asks for at most: a collector answers its readers up to a million (query.Limits)
PAGE_ROWS = 500_000

ATTEMPT_SQL = "SELECT max(attempt) AS attempt FROM ranks WHERE run_id = {run:String}"


@dataclass
class RunContext:
    """One run's topology plus the query function; detectors read everything else through SQL.

    A restarted run (torchrun's elastic agent, ``rankscope launch``) keeps its id, and the same rank
    may then be another process on another host, with steps run again from a checkpoint: detectors
    look at the run's latest attempt only (``attempt``, bound to ``{attempt:UInt16}`` in every query
    made through ``query``). What earlier attempts showed stays in their incidents.

    ``seen`` is what passes keep of the attempt from one to the next (the newest step of each
    table a detector windows by, the straggler's window of points), so that a pass reads what is new
    rather than the run's history; the live diagnosis hands it from one context of the attempt to
    the next.
    """

    run_id: str
    query: Query
    settings: Settings
    attempt: int = 0
    host: dict[int, str] = field(default_factory=dict)
    stage: dict[int, int] = field(default_factory=dict)  # rank -> pp_rank (0 when unknown)
    ranks_of_host: dict[str, list[int]] = field(default_factory=dict)  # host -> its ranks, sorted
    groups: dict[str, list[int]] = field(default_factory=dict)
    seen: dict[str, Any] = field(default_factory=dict)
    #: offline replay: the newest step a pass may see (``newest_step`` stops there), so that the
    #: windowed detectors judge the run as it stood at that step; None: the whole run
    until_step: int | None = None
    #: offline replay of a stall: the moment a pass judges the run at (the hang detector reads what
    #: was recorded by then); None: now
    until_ns: int | None = None

    @classmethod
    def load(
        cls, run_id: str, query: Query, settings: Settings, seen: dict[tuple[str, int], dict[str, Any]] | None = None,
        attempt: int | None = None,
    ) -> RunContext:  # fmt: skip
        """The run's latest attempt (or ``attempt``) and its topology; ``seen``: (run, attempt) -> what
        passes keep of it, shared with this context (an entry is made for a new attempt)."""
        if attempt is None:
            attempt = int(query(ATTEMPT_SQL, {"run": run_id}).to_pylist()[0]["attempt"] or 0)
        kept = seen.setdefault((run_id, attempt), {}) if seen is not None else {}
        ctx = cls(run_id, lambda sql, params: query(sql, {"attempt": attempt, **params}), settings, attempt, seen=kept)
        for r in ctx.query(
            "SELECT rank, argMax(host, registered) AS host, argMax(pp_rank, registered) AS pp "
            "FROM ranks WHERE run_id = {run:String} AND attempt = {attempt:UInt16} GROUP BY rank ORDER BY rank",
            {"run": run_id},
        ).to_pylist():
            ctx.host[r["rank"]] = r["host"]
            ctx.stage[r["rank"]] = max(r["pp"], 0)
            ctx.ranks_of_host.setdefault(r["host"], []).append(r["rank"])
        for g in ctx.query(GROUPS_SQL, {"run": run_id}).to_pylist():
            ctx.groups[g["name"]] = list(g["ranks"])
        return ctx

    @functools.cached_property
    def group_index(self) -> GroupIndex:
        """``groups`` indexed for the critical paths of incidents' costs: once a pass, not once a path."""
        return GroupIndex.of(self.groups)

    def whole_hosts(self, ranks: set[int] | dict[int, Any]) -> set[str]:
        """The hosts of two or more ranks all of which are among ``ranks``: a host fault, not a rank's."""
        return {h for h, on in self.ranks_of_host.items() if len(on) >= 2 and all(r in ranks for r in on)}

    def who(self, rank: int) -> str:
        return who(rank, self.host)

    def hosts_of(self, ranks: list[int] | tuple[int, ...]) -> tuple[str, ...]:
        return tuple(sorted({self.host[r] for r in ranks if r in self.host}))

    def newest_step(self, sql: str) -> int:
        """The newest step ``sql`` finds (``max(step) AS newest``, over rows with ``step >= {since:UInt32}``),
        since the newest it found in an earlier pass: steps of an attempt only grow, and a filter on
        the step skips the history (the tables are sorted or indexed by it). 0 when there is none;
        never past ``until_step``."""
        since = self.seen.get(sql, 0)
        step = int(self.query(sql, {"run": self.run_id, "since": since}).to_pylist()[0]["newest"] or 0)
        if self.until_step is not None:
            step = min(step, self.until_step)
        self.seen[sql] = max(step, since)
        return self.seen[sql]

    def median_step_s(self, first_step: int, last_step: int) -> float:
        """The median step time over steps ``first_step``..``last_step`` of every rank; 0 when none was recorded."""
        params = {"run": self.run_id, "first_step": first_step, "last_step": last_step}
        return float(self.query(STEP_TIME_SQL, params).to_pylist()[0]["step_s"] or 0.0)

    def literal_sql(self, sql: str, **params: Any) -> str:
        """A copyable statement: ``{name:Type}`` placeholders written out as literals (for people; never run here)."""
        values = {"run": self.run_id, "attempt": self.attempt, **params}
        return _PLACEHOLDER.sub(lambda m: format_bind_value(values[m.group(1)], top_level=False), sql)


def pages(rows: Mapping[Any, int], limit: int = PAGE_ROWS) -> list[list[Any]]:
    """``rows``' keys (steps, cells) in order, in pages of at most ``limit`` rows (a key over it alone):
    a window read in pieces stays under the result limit of a collector's reads at 100,000 ranks."""
    out: list[list[Any]] = [[]]
    total = 0
    for key in sorted(rows):
        if out[-1] and total + rows[key] > limit:
            out.append([])
            total = 0
        out[-1].append(key)
        total += rows[key]
    return out if out[0] else []


def died_at(silent_since_ns: int, exit_times_ns: Iterable[int], settings: Settings) -> bool:
    """Whether ranks that went silent at ``silent_since_ns`` died rather than froze: some rank ended
    soon after (within ``hang_after_s``), as a dead process's launcher stops its host-mates and its
    peers fail on the broken connections at once. Around a frozen one the others wait, until their
    collectives time out much later."""
    window_ns = settings.hang_after_s * 1e9
    return any(silent_since_ns < t <= silent_since_ns + window_ns for t in exit_times_ns)


_PLACEHOLDER = re.compile(r"\{(\w+):[^}]+\}")
