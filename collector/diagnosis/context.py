"""What every detector needs to know about a run: its ranks, hosts, stages and groups, read once per pass."""

from __future__ import annotations

import re

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

#: ``query(sql, params) -> pyarrow.Table``: a collector client, a store reader, or the collector's own store
Query = Callable[[str, Mapping[str, object]], pa.Table]


@dataclass(frozen=True)
class Settings:
    """Detector thresholds; the defaults are what the scenarios are tuned and tested with."""

    #: a run whose steps stopped advancing this long while heartbeats still arrive is hung
    hang_after_s: float = 30.0
    #: a rank silent for this long without saying it ended is lost
    silent_after_s: float = 15.0
    #: straggler: slower than its stage's median by at least this share ...
    straggler_excess: float = 0.10
    #: ... over this many recent steps (median of them), seen in at least ``straggler_min_steps``
    straggler_window: int = 6
    straggler_min_steps: int = 3
    #: ... and by at least this much time per step (tiny segments are all noise)
    straggler_min_excess_s: float = 0.002
    #: slow link: a pair's transfer time this many times the median of comparable pairs ...
    slow_link_ratio: float = 4.0
    #: ... costing at least this share of a step (and this much time) per step
    slow_link_step_share: float = 0.05
    slow_link_min_s: float = 0.005
    #: loss spike: the loss this many times the median of the previous steps
    loss_spike_ratio: float = 2.0


@dataclass
class RunContext:
    """One run's topology plus the query function; detectors read everything else through SQL."""

    run_id: str
    query: Query
    settings: Settings
    database: str = "rankscope"
    world_size: int = 0
    host: dict[int, str] = field(default_factory=dict)
    stage: dict[int, int] = field(default_factory=dict)  # rank -> pp_rank (0 when unknown)
    coords: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # rank -> (tp, pp, dp)
    groups: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def load(cls, run_id: str, query: Query, settings: Settings, database: str = "rankscope") -> RunContext:
        ctx = cls(run_id, query, settings, database)
        ranks = query(
            "SELECT rank, argMax(host, registered) AS host, argMax(tp_rank, registered) AS tp, "
            "argMax(pp_rank, registered) AS pp, argMax(dp_rank, registered) AS dp "
            "FROM ranks WHERE run_id = {run:String} GROUP BY rank",
            {"run": run_id},
        ).to_pylist()
        for r in ranks:
            ctx.host[r["rank"]] = r["host"]
            ctx.stage[r["rank"]] = max(r["pp"], 0)
            ctx.coords[r["rank"]] = (r["tp"], r["pp"], r["dp"])
        run = query(
            "SELECT argMax(world_size, updated) AS world FROM runs WHERE run_id = {run:String}", {"run": run_id}
        ).to_pylist()
        ctx.world_size = run[0]["world"] if run and run[0]["world"] else len(ranks)
        for g in query(
            "SELECT name, argMax(ranks, registered) AS ranks FROM groups WHERE run_id = {run:String} GROUP BY name",
            {"run": run_id},
        ).to_pylist():
            ctx.groups[g["name"]] = list(g["ranks"])
        return ctx

    def who(self, rank: int) -> str:
        """``rank 5 (node-2)``: how incidents name a rank."""
        host = self.host.get(rank)
        return f"rank {rank} ({host})" if host else f"rank {rank}"

    def hosts_of(self, ranks: list[int] | tuple[int, ...]) -> tuple[str, ...]:
        return tuple(sorted({self.host[r] for r in ranks if r in self.host}))

    def literal_sql(self, sql: str, **params: Any) -> str:
        """A copyable statement: ``{name:Type}`` placeholders written out as literals (for people; never run here)."""
        values = {"run": self.run_id, **params}

        def literal(match: re.Match[str]) -> str:
            value = values[match.group(1)]
            if isinstance(value, (int, float)):
                return repr(value)
            if isinstance(value, (list, tuple)):
                return "[" + ", ".join(repr(v) for v in value) + "]"
            return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"

        return _PLACEHOLDER.sub(literal, sql)


_PLACEHOLDER = re.compile(r"\{(\w+):[^}]+\}")
