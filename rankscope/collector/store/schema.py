"""rankscope's tables, described once as data.

The DDL for the embedded store (chDB), a ClickHouse server and a ClickHouse cluster is generated
from these descriptions (``ddl.py``), and the collector's ingest builds Arrow tables whose columns
are exactly a table's ``insert_columns`` in order. Times are DateTime64(9) (nanoseconds, UTC),
carried in Arrow as ``timestamp[ns]``. Every table starts with ``run_id``; per-rank tables
continue with ``rank``.

Bump ``SCHEMA_VERSION`` and add a migration in ``migrations.py`` when a table changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SCHEMA_VERSION = 7

TIME = "DateTime64(9)"
TIME_CODEC = "CODEC(Delta, ZSTD(1))"
NAME = "LowCardinality(String)"


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    codec: str = ""
    #: computed by the server from other columns (not inserted)
    materialized: str = ""
    #: the value of a row inserted without it (the column is then not among ``insert_columns``)
    default: str = ""
    comment: str = ""


@dataclass(frozen=True)
class Projection:
    """A second sort order kept inside the table (ClickHouse projection)."""

    name: str
    select: str  # e.g. "SELECT * ORDER BY (run_id, group, seq)"


@dataclass(frozen=True)
class Index:
    """A data-skipping index: what the engine keeps per ``granularity`` granules to skip those a filter excludes."""

    name: str
    expression: str
    type: str = "minmax"
    granularity: int = 1


#: Per-rank tables are sorted by rank and time, so a filter on the step alone would read a run's
#: whole history; a step grows with time within a rank, so each granule's step range is narrow.
STEP_INDEX = Index("step_range", "step")


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    columns: tuple[Column, ...]
    order_by: tuple[str, ...]
    #: the time column used for daily partitions and for the retention TTL; "" for small tables
    time_column: str = ""
    #: ReplacingMergeTree version column: rows with the same ORDER BY key replace each other
    version_column: str = ""
    projections: tuple[Projection, ...] = field(default_factory=tuple)
    indexes: tuple[Index, ...] = field(default_factory=tuple)
    #: a rollup: the table is filled by a materialized view over ``source`` (never by writers),
    #: ``view`` being that view's SELECT with ``{source}`` for the source table's name
    source: str = ""
    view: str = ""

    @property
    def insert_columns(self) -> tuple[Column, ...]:
        """The columns a writer provides, in order (materialized columns are computed by the server,
        ``CYCLE`` is added by the collector's writer alone)."""
        return tuple(c for c in self.columns if not c.materialized and not c.default)

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)


def _run_rank() -> tuple[Column, Column]:
    return Column("run_id", NAME), Column("rank", "UInt32")


#: which attempt (restart) of the run a rank's row comes from: the same rank number may be another
#: process on another host after a restart, and a step after the last checkpoint is run again
ATTEMPT = Column("attempt", "UInt16", comment="restart of the run that wrote the row; 0 for the first")
#: the torchrun round a rank's process belongs to, as its agent reported it; the collector numbers a
#: run's worlds in the order they first registered: that number is the attempt
WORLD = Column("world", "String", comment="the round's store address and size, '' when unknown")
#: the collector's flush cycle that wrote the row: committed once that cycle's batch ids are in ``batches``
#: (the same value there); a starting collector removes the rows of cycles never committed (store/cycles.py)
CYCLE = Column(
    "cycle", "UInt64", "CODEC(Delta, ZSTD(1))", default="0", comment="the collector's flush cycle that wrote it; 0 when written by another"
)


_TABLES: tuple[Table, ...] = (
    Table(
        "schema_version",
        "Which schema version wrote this store (one row per migration applied).",
        (Column("version", "UInt32"), Column("applied", TIME), Column("rankscope_version", "String")),
        order_by=("version",),
    ),
    Table(
        "runs",
        "One row per run, replaced as its status changes (running, finished, failed, hung).",
        (
            Column("run_id", NAME),
            Column("name", "String"),
            Column("start_time", TIME),
            Column("end_time", TIME, comment="1970-01-01 while the run is not over"),
            Column("world_size", "UInt32"),
            Column("tp", "UInt16"),
            Column("pp", "UInt16"),
            Column("dp", "UInt16"),
            Column("config", "String", "CODEC(ZSTD(3))", comment="JSON"),
            Column("status", NAME),
            Column("updated", TIME),
        ),
        order_by=("run_id",),
        version_column="updated",
    ),
    Table(
        "ranks",
        "Who each rank is: host, process, device, 3D-parallel coordinates, clock offset.",
        (
            *_run_rank(),
            Column("host", NAME),
            Column("pid", "UInt32"),
            Column("local_rank", "Int32"),
            Column("device", NAME),
            Column("tp_rank", "Int32"),
            Column("pp_rank", "Int32"),
            Column("dp_rank", "Int32"),
            Column("clock_offset_ns", "Int64"),
            Column("agent_version", NAME),
            Column("registered", TIME),
            ATTEMPT,
            WORLD,
        ),
        order_by=("run_id", "attempt", "rank"),  # a rank's row of each attempt: who it was before a restart too
        version_column="registered",
    ),
    Table(
        "groups",
        "Process groups by name, with their member ranks in group-rank order.",
        (
            Column("run_id", NAME),
            Column("name", NAME),
            Column("description", "String"),
            Column("ranks", "Array(UInt32)"),
            Column("registered", TIME),
            ATTEMPT,
        ),
        order_by=("run_id", "attempt", "name"),  # each attempt's groups: a restart may change the layout
        version_column="registered",
    ),
    Table(
        "spans",
        "Timed code segments: compute, comm, data, optimizer, user.",
        (
            *_run_rank(),
            Column("step", "UInt32"),
            Column("name", NAME),
            Column("kind", NAME),
            Column("start_time", TIME, TIME_CODEC),
            Column("end_time", TIME, TIME_CODEC),
            Column("microbatch", "Int32"),
            Column("attributes", "String", "CODEC(ZSTD(1))", comment="JSON object, '' when none"),
            Column("cpu_ns", "Int64", comment="CPU time of the thread in the span (host-only runs); -1 when not measured"),
            Column("duration_ns", "Int64", materialized="toUnixTimestamp64Nano(end_time) - toUnixTimestamp64Nano(start_time)"),
            ATTEMPT,
        ),
        order_by=("run_id", "rank", "start_time"),
        time_column="start_time",
        indexes=(STEP_INDEX,),
    ),
    Table(
        "step_segments",
        "Each rank's total time per named segment and step (the split pieces of a span summed), "
        "kept up to date by ClickHouse as spans arrive: what heat maps and the straggler detector read. "
        "Rows of one key may not be merged yet: read with sum/min/max ... GROUP BY. A step run again after a "
        "restart has a row per attempt.",
        (
            Column("run_id", NAME),
            Column("attempt", "UInt16"),
            Column("step", "UInt32"),
            Column("name", NAME),
            Column("kind", NAME),
            Column("rank", "UInt32"),
            Column("total_ns", "SimpleAggregateFunction(sum, Int64)"),
            Column("pieces", "SimpleAggregateFunction(sum, UInt64)"),
            Column("total_cpu_ns", "SimpleAggregateFunction(sum, Int64)", comment="of the pieces whose CPU time was measured"),
            Column("cpu_pieces", "SimpleAggregateFunction(sum, UInt64)"),
            Column("first_start", f"SimpleAggregateFunction(min, {TIME})"),
            Column("last_end", f"SimpleAggregateFunction(max, {TIME})"),
        ),
        order_by=("run_id", "attempt", "name", "step", "rank", "kind"),
        source="spans",
        view=(
            "SELECT run_id, attempt, step, name, kind, rank, sum(duration_ns) AS total_ns, count() AS pieces, "
            "sumIf(cpu_ns, cpu_ns >= 0) AS total_cpu_ns, countIf(cpu_ns >= 0) AS cpu_pieces, "
            "min(start_time) AS first_start, max(end_time) AS last_end FROM {source} WHERE step > 0 "
            "GROUP BY run_id, attempt, step, name, kind, rank"
        ),
    ),
    Table(
        "collectives",
        "Every collective and point-to-point operation of every rank.",
        (
            *_run_rank(),
            Column("group_name", NAME),
            Column("seq", "Int64", "CODEC(Delta, ZSTD(1))"),
            Column("op", NAME),
            Column("nbytes", "UInt64"),
            Column("dtype", NAME),
            Column("peer", "Int32"),
            Column("issue_time", TIME, TIME_CODEC),
            Column("start_time", TIME, TIME_CODEC),
            Column("end_time", TIME, TIME_CODEC, comment="1970-01-01 when it never completed"),
            Column("state", NAME),
            Column("step", "UInt32"),
            ATTEMPT,
        ),
        order_by=("run_id", "rank", "issue_time"),
        time_column="issue_time",
        # Matching an operation across the members of its group: (run, group, seq).
        projections=(Projection("by_group_seq", "SELECT * ORDER BY (run_id, group_name, seq, rank)"),),
        indexes=(STEP_INDEX,),
    ),
    Table(
        "entered",
        "The highest sequence number each rank has entered per process group (and, for point-to-point operations, "
        "per peer and direction), kept up to date by ClickHouse as collectives arrive: whom a hung rank waits for. "
        "Read with max(seq) GROUP BY.",
        (
            Column("run_id", NAME),
            Column("attempt", "UInt16"),
            Column("group_name", NAME),
            Column("rank", "UInt32"),
            Column("peer", "Int32", comment="-1 for a collective"),
            Column("sends", "UInt8", comment="a point-to-point send (1) or receive (0); 0 for a collective"),
            Column("seq", "SimpleAggregateFunction(max, Int64)"),
        ),
        order_by=("run_id", "attempt", "group_name", "rank", "peer", "sends"),
        source="collectives",
        view=(
            "SELECT run_id, attempt, group_name, rank, peer, peer >= 0 AND position(splitByChar(':', op)[-1], 'send') > 0 AS sends, "
            "max(seq) AS seq FROM {source} GROUP BY run_id, attempt, group_name, rank, peer, sends"
        ),
    ),
    Table(
        "heartbeats",
        "Each rank's pulse every few seconds: step, phase, the collectives it is in.",
        (
            *_run_rank(),
            Column("host", NAME),
            Column("time", TIME, TIME_CODEC),
            Column("step", "UInt32"),
            Column("phase", NAME),
            Column("status", NAME),
            Column("last_progress", TIME),
            Column("inflight_group", f"Array({NAME})"),
            Column("inflight_seq", "Array(Int64)"),
            Column("inflight_op", f"Array({NAME})"),
            Column("inflight_peer", "Array(Int32)"),
            Column("inflight_issue", f"Array({TIME})"),
            Column("inflight_waiting", "Array(UInt8)"),
            Column("events_dropped", "UInt64"),
            ATTEMPT,
        ),
        order_by=("run_id", "rank", "time"),
        time_column="time",
        indexes=(STEP_INDEX,),
    ),
    Table(
        "rank_state",
        "Each rank's latest heartbeat, kept up to date by ClickHouse as heartbeats arrive: what the live diagnosis "
        "reads on every pass (a run's heartbeats grow with it, this does not). Read with max(...) and argMaxMerge(...) "
        "GROUP BY run_id, attempt, rank.",
        (
            Column("run_id", NAME),
            Column("attempt", "UInt16"),
            Column("rank", "UInt32"),
            Column("host", f"SimpleAggregateFunction(anyLast, {NAME})"),
            Column("last_heartbeat", f"SimpleAggregateFunction(max, {TIME})"),
            Column("max_step", "SimpleAggregateFunction(max, UInt32)"),
            *(Column(name, f"AggregateFunction(argMax, {kind}, {TIME})", comment="of the latest heartbeat")
              for name, kind in (("latest_step", "UInt32"), ("phase", NAME), ("last_progress", TIME), ("inflight_group", f"Array({NAME})"),
                                 ("inflight_seq", "Array(Int64)"), ("inflight_op", f"Array({NAME})"), ("inflight_peer", "Array(Int32)"),
                                 ("inflight_waiting", "Array(UInt8)"))),
        ),
        order_by=("run_id", "attempt", "rank"),
        source="heartbeats",
        view=(
            "SELECT run_id, attempt, rank, anyLast(host) AS host, max(time) AS last_heartbeat, max(step) AS max_step, "
            "argMaxState(step, time) AS latest_step, argMaxState(phase, time) AS phase, argMaxState(last_progress, time) AS last_progress, "
            "argMaxState(inflight_group, time) AS inflight_group, argMaxState(inflight_seq, time) AS inflight_seq, "
            "argMaxState(inflight_op, time) AS inflight_op, argMaxState(inflight_peer, time) AS inflight_peer, "
            "argMaxState(inflight_waiting, time) AS inflight_waiting FROM {source} GROUP BY run_id, attempt, rank"
        ),
    ),
    Table(
        "metrics",
        "Device and host gauges and counters (GPU utilisation, memory, temperature, NIC bytes, ...).",
        (
            Column("run_id", NAME),
            Column("rank", "Int32", comment="the rank that reported it"),
            Column("host", NAME),
            Column("device", NAME),
            Column("time", TIME, TIME_CODEC),
            Column("name", NAME),
            Column("value", "Float64", "CODEC(Gorilla, ZSTD(1))"),
            ATTEMPT,
        ),
        order_by=("run_id", "host", "name", "device", "time"),
        time_column="time",
    ),
    Table(
        "gpu_signals",
        "Per rank and GPU fault signal (throttle reasons, uncorrected ECC errors, Xid events): samples on, range, when "
        "first on and last seen, kept up to date by ClickHouse as metrics arrive. Read with sum/max/min/minIfMerge GROUP BY.",
        (
            Column("run_id", NAME),
            Column("attempt", "UInt16"),
            Column("rank", "Int32"),
            Column("name", NAME),
            Column("host", f"SimpleAggregateFunction(anyLast, {NAME})"),
            Column("device", f"SimpleAggregateFunction(anyLast, {NAME})"),
            Column("samples_on", "SimpleAggregateFunction(sum, UInt64)", comment="samples above 0"),
            Column("highest", "SimpleAggregateFunction(max, Float64)"),
            Column("lowest", "SimpleAggregateFunction(min, Float64)"),
            Column("first_on", f"AggregateFunction(minIf, {TIME}, UInt8)", comment="the first sample above 0"),
            Column("last_seen", f"SimpleAggregateFunction(max, {TIME})"),
        ),
        order_by=("run_id", "attempt", "rank", "name"),
        source="metrics",
        view=(
            "SELECT run_id, attempt, rank, name, anyLast(host) AS host, anyLast(device) AS device, countIf(value > 0) AS samples_on, "
            "max(value) AS highest, min(value) AS lowest, minIfState(time, value > 0) AS first_on, max(time) AS last_seen FROM {source} "
            "WHERE startsWith(name, 'hw.gpu.throttle.') OR name = 'hw.errors.ecc_uncorrected' OR startsWith(name, 'hw.gpu.xid.') "
            "GROUP BY run_id, attempt, rank, name"
        ),
    ),
    Table(
        "step_metrics",
        "Training scalars per rank and step: loss, grad_norm, tokens_per_s, mfu, user values.",
        (
            *_run_rank(),
            Column("step", "UInt32"),
            Column("name", NAME),
            Column("value", "Float64"),
            Column("time", TIME, TIME_CODEC),
            ATTEMPT,
        ),
        order_by=("run_id", "rank", "step", "name"),
        time_column="time",
        indexes=(STEP_INDEX,),
    ),
    Table(
        "step_losses",
        "Per step: the loss (its median) over the ranks that report it, those ranks, when the first came, and how many values "
        "were not finite (a loss, or a rank's count of non-finite outputs), kept up to date by ClickHouse as step "
        "metrics arrive. Read with quantileIfMerge (the median)/groupArrayIfMerge/min/sum GROUP BY step.",
        (
            Column("run_id", NAME),
            Column("attempt", "UInt16"),
            Column("step", "UInt32"),
            Column("loss", "AggregateFunction(quantileIf, Float64, UInt8)"),
            Column("ranks", "AggregateFunction(groupArrayIf, UInt32, UInt8)", comment="the ranks that reported a loss"),
            Column("first_time", f"SimpleAggregateFunction(min, {TIME})"),
            Column("nonfinite", "SimpleAggregateFunction(sum, UInt64)"),
        ),
        order_by=("run_id", "attempt", "step"),
        source="step_metrics",
        view=(
            "SELECT run_id, attempt, step, quantileIfState(value, name = 'loss') AS loss, groupArrayIfState(rank, name = 'loss') AS ranks, "
            "min(time) AS first_time, countIf((name = 'loss' AND NOT isFinite(value)) OR (name = 'nonfinite_outputs' AND value > 0)) AS nonfinite "
            "FROM {source} WHERE name IN ('loss', 'nonfinite_outputs') GROUP BY run_id, attempt, step"
        ),
    ),
    Table(
        "stacks",
        "Stack dumps (py-spy, or Python's own frames where ptrace is denied).",
        (
            *_run_rank(),
            Column("host", NAME),
            Column("time", TIME),
            Column("reason", NAME),
            Column("method", NAME),
            Column("text", "String", "CODEC(ZSTD(3))"),
            ATTEMPT,
        ),
        order_by=("run_id", "rank", "time"),
        time_column="time",
    ),
    Table(
        "exits",
        "How each rank ended: normally, with an exit code, an exception or a signal.",
        (
            *_run_rank(),
            Column("host", NAME),
            Column("time", TIME),
            Column("reason", NAME, comment="normal, exit_code, exception, signal"),
            Column("exit_code", "Int32"),
            Column("signal", "Int32"),
            Column("message", "String"),
            ATTEMPT,
        ),
        order_by=("run_id", "rank", "time"),
        time_column="time",
    ),
    Table(
        "incidents",
        "One row per fault, replaced (higher version) while it lasts; read with FINAL or argMax.",
        (
            Column("run_id", NAME),
            Column("incident_id", "String"),
            Column("kind", NAME),
            Column("severity", NAME),
            Column("status", NAME, comment="open, closed, or merged into the incident named by evidence.merged_into"),
            Column("ranks", "Array(UInt32)"),
            Column("hosts", f"Array({NAME})"),
            Column("first_seen", TIME),
            Column("last_seen", TIME),
            Column("summary", "String"),
            Column("evidence", "String", comment="JSON"),
            Column("sql", "String"),
            Column("version", "UInt64"),
        ),
        order_by=("run_id", "incident_id"),
        time_column="first_seen",
        version_column="version",
    ),
    Table(
        "actions",
        "What a self-healing driver (rankscope launch) decided and did: the incident it acted on, self-checks, "
        "evictions, restarts, the first step after a restart, the job's end; with why and the evidence.",
        (
            Column("run_id", NAME),
            Column("time", TIME),
            ATTEMPT,
            Column("action", NAME),
            Column("hosts", f"Array({NAME})"),
            Column("incident_id", "String"),
            Column("reason", "String"),
            Column("evidence", "String", comment="JSON"),
        ),
        order_by=("run_id", "time"),
        time_column="time",
    ),
    Table(
        "selfchecks",
        "Host self-checks (rankscope selfcheck): each figure beside its peers' median, and whether it passed.",
        (
            Column("run_id", NAME, comment="'' for a self-check outside any run"),
            Column("host", NAME),
            Column("time", TIME),
            Column("check", NAME),
            Column("value", "Float64"),
            Column("unit", NAME),
            Column("reference", "Float64", comment="the peers' median of the same figure; nan when none"),
            Column("passed", "UInt8"),
            Column("host_passed", "UInt8", comment="the host's verdict over all its figures"),
            Column("summary", "String"),
            Column("detail", "String"),
        ),
        order_by=("run_id", "host", "time"),
        time_column="time",
    ),
    Table(
        "node_states",
        "Each node's life as healing sees it: healthy, suspect, checking, drained (with the incident) and back; "
        "a row per change, by a self-healing driver or a person (rankscope node resume). A node's state is its newest row.",
        (
            Column("run_id", NAME, comment="the run whose incident or driver changed it"),
            Column("host", NAME),
            Column("time", TIME),
            Column("state", NAME, comment="healthy, suspect, checking or drained"),
            Column("incident_id", "String", comment="the incident behind it, '' when none"),
            Column("reason", "String", comment="why; a drained node's is what the cluster was told"),
            Column("actor", NAME, comment="rankscope launch, or the person who ran rankscope node"),
        ),
        order_by=("host", "time"),
        time_column="time",
    ),
    Table(
        "batches",
        "Ids of the batches already written, so a retried batch is acknowledged and not stored twice.",
        (
            Column("run_id", NAME),
            Column("rank", "UInt32"),
            Column("batch_id", "FixedString(16)"),
            Column("kind", NAME),
            Column("rows", "UInt32"),
            Column("received", TIME),
        ),
        order_by=("run_id", "batch_id"),
        time_column="received",
    ),
)


def _cycled(table: Table) -> Table:
    """``table`` with ``CYCLE`` last, when the collector's writer may fill it (not a rollup, not the schema's history)."""
    if table.source or table.name == "schema_version":
        return table
    return replace(table, columns=(*table.columns, CYCLE))


TABLES: tuple[Table, ...] = tuple(_cycled(t) for t in _TABLES)
BY_NAME: dict[str, Table] = {t.name: t for t in TABLES}
