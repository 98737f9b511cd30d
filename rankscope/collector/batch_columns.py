"""One batch's envelope and ``bytes`` columns, read with every check, and the Arrow tables they fill.

Every column is checked before anything is written (byte lengths against ``count``, string
indices, enum values, signs of unsigned columns, times inside the accepted window, ranks inside
the run's world), so a malformed batch is refused whole (``IngestError``) with a message a person
can act on, and never reaches a shared insert where it could fail the good rows buffered with it.
The tables (``arrow_table``) have exactly ``schema.BY_NAME[t].insert_columns``, in order, with the
Arrow types of ``store.base.arrow_schema`` (so the store casts nothing).

Kept apart from the payload decoders (``decode``, ``run_lifecycle``), which all read through it:
what a column must satisfy is said once, whichever payload carries it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rankscope.collector.batch_limits import (
    MAX_ID_CHARS, STRING_EXPANSION, IngestError, UnregisteredRun, check_count, check_repeated, shown,
)
from rankscope.collector.run_registry import RunInfo, sender
from rankscope.collector.store import schema
from rankscope.collector.store.base import arrow_schema, arrow_type
from rankscope.protos.v1 import ingest_pb2


@dataclass(frozen=True)
class TimeWindow:
    """How far from the collector's clock a batch's times may lie.

    Rows far in the past would be dropped at once by the retention TTL, and rows scattered over
    many days would fail a shared insert with "too many partitions": both are refused up front.
    Rows of a run that has ended are refused when they say they happened after its end by more
    than ``end_skew_s`` (``BatchContext.before_end``).
    """

    past_s: float = 86_400.0
    future_s: float = 3_600.0
    #: how far past its run's end a row's time may lie: the disagreement between the clock offsets
    #: stamped on one rank's batches (a spool replayed after the run is stamped anew), not a delay:
    #: a row delivered late keeps the time it happened at
    end_skew_s: float = 60.0


def enum_names(enum: object, prefix: str) -> tuple[str, ...]:
    """Lower-case names of a proto enum indexed by value (``SPAN_KIND_COMM`` -> ``comm``)."""
    items = sorted((value, name) for name, value in enum.items())  # type: ignore[attr-defined]
    if [value for value, _ in items] != list(range(len(items))):
        raise AssertionError(f"{prefix}* values are not 0..n-1")
    return tuple(name.removeprefix(prefix).lower() for _, name in items)


#: table name -> the Arrow schema its rows are built in
SCHEMAS: dict[str, pa.Schema] = {t.name: arrow_schema(t) for t in schema.TABLES if not t.source}  # rollups are never written to
#: how DateTime64(9) travels in Arrow
TIMESTAMP = arrow_type("DateTime64(9)")


def arrow_table(name: str, columns: Mapping[str, object], attempt: int | np.ndarray | None = None) -> pa.Table:
    """An Arrow table for ``name`` from column name -> values (numpy, Arrow or list); a table with an
    ``attempt`` column gets ``attempt``: the batch's in every row, or one per row."""
    target = SCHEMAS[name]
    if attempt is not None:
        rows = len(next(iter(columns.values())))
        attempts = np.full(rows, attempt) if np.isscalar(attempt) else attempt
        columns = {**columns, "attempt": np.asarray(attempts, dtype=np.uint16)}
    if set(columns) != set(target.names):
        raise AssertionError(f"{name}: columns {sorted(columns)} != {sorted(target.names)}")
    arrays = [_array(name, columns[f.name], f) for f in target]
    return pa.Table.from_arrays(arrays, schema=target)


def _array(table: str, values: object, target: pa.Field) -> pa.Array:
    """One column as its Arrow type. The decoders check every value first; a value that still does
    not fit the column is the batch's fault, and is refused as such rather than failing the call."""
    if isinstance(values, pa.Array):
        return values
    try:
        return pa.array(values, type=target.type)
    except (pa.ArrowInvalid, OverflowError) as e:
        raise IngestError(f"{table}.{target.name}: a value the column ({target.type}) cannot hold: {str(e)[:200]}", "range") from None


class BatchContext:
    """One batch being decoded: envelope values, the clock, and the time-window check."""

    def __init__(self, batch: ingest_pb2.Batch, now_ns: int, window: TimeWindow, kind: str) -> None:
        self.kind = kind
        self.run_id = batch.run_id
        self.rank = batch.rank
        self.attempt = batch.attempt
        #: the ranks the rows speak for and each row's attempt, when rows name their ranks (``row_ranks``)
        self.ranks: tuple[int, ...] = ()
        self.row_attempts: np.ndarray | None = None
        #: a relay's batch: the ranks' batches it holds, in the order of its rows (``Batch.parts``)
        self.parts = batch.parts
        #: the agent instance that made the batch (``run_registry.sender``)
        self.sender = sender(batch)
        #: the run as the registry knows it (``decode`` sets it; empty for registrations and run-level records)
        self.run = RunInfo()
        self.offset = batch.clock_offset_ns
        self.now_ns = now_ns
        self.lo = now_ns - int(window.past_s * 1e9)
        self.hi = now_ns + int(window.future_s * 1e9)
        #: the end of the run the rows belong to, when it bounds the window (``before_end``; 0: running)
        self.run_end_ns = 0

    def after_start(self, start_ns: int, window: TimeWindow) -> None:
        """Refuse, from now on, rows from before the run began (``start_ns``, its ranks' earliest start)
        less the clock skew the window allows ahead: a rank's first registration carries no clock
        offset yet."""
        if start_ns:
            self.lo = max(self.lo, start_ns - int(window.future_s * 1e9))

    def before_end(self, end_ns: int, window: TimeWindow) -> None:
        """Refuse, from now on, rows from after the run's end (``end_ns``, its last rank's exit; 0 while
        it runs) by more than the window's ``end_skew_s``. Whenever they arrive, true rows happened
        before their rank's end: a rank's last flush, and a spool replayed after the run, keep their
        times; a row that claims to be later was not recorded by the run."""
        if end_ns and end_ns + int(window.end_skew_s * 1e9) < self.hi:
            self.run_end_ns = end_ns
            self.hi = end_ns + int(window.end_skew_s * 1e9)

    def check_times(self, what: str, lo: int, hi: int) -> None:
        """Refuse times (already on the collector's clock, as Python ints: no wrap-around) outside the
        accepted window."""
        if lo >= self.lo and hi <= self.hi:
            return
        if self.run_end_ns and hi > self.hi:
            raise IngestError(
                f"{what}: times up to {_iso(hi)} (collector clock, after adding clock_offset_ns={self.offset}) lie after"
                f" the end of run {shown(self.run_id)} at {_iso(self.run_end_ns)} (every rank of its world has ended) by"
                f" more than {(self.hi - self.run_end_ns) / 1e9:.0f} s: a run's rows happened while it ran",
                "ended",
            )
        raise IngestError(
            f"{what}: times {_iso(lo)} .. {_iso(hi)} (collector clock, after adding clock_offset_ns="
            f"{self.offset}) lie outside the accepted window {_iso(self.lo)} .. {_iso(self.hi)} (around the"
            f" collector's clock {_iso(self.now_ns)}, not before the run's start nor after its end): fix the"
            " rank's clock or clock offset, or widen the collector's --time-window",
            "time",
        )

    def shift(self, what: str, raw: np.ndarray) -> np.ndarray:
        """Times of the rank's clock (int64) on the collector's, once their extremes, moved in Python
        integers, lie inside the window: then no sum wraps around."""
        if raw.size:
            self.check_times(what, int(raw.min()) + self.offset, int(raw.max()) + self.offset)
        return raw + np.int64(self.offset)

    @property
    def attempts(self) -> int | np.ndarray:
        """The rows' attempt: the batch's, or one per row where rows name their ranks."""
        return self.attempt if self.row_attempts is None else self.row_attempts

    def time(self, what: str, value_ns: int) -> int:
        """One time of the rank's clock on the collector's, refused outside the window (``what`` names it)."""
        shifted = value_ns + self.offset
        self.check_times(what, shifted, shifted)
        return shifted


def _iso(ns: int) -> str:
    try:
        return datetime.fromtimestamp(ns / 1e9, timezone.utc).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return f"{ns} ns"


@dataclass(frozen=True)
class Layout:
    """A columnar payload's ``bytes`` columns and their little-endian types; ``optional`` ones may be
    absent (older agents, rows that do not name their rank)."""

    required: Mapping[str, str]
    optional: Mapping[str, str] = field(default_factory=dict)

    @property
    def row_bytes(self) -> int:
        """Bytes every row takes in the required columns: what ``count`` is checked against."""
        return sum(np.dtype(t).itemsize for t in self.required.values())


class Columns:
    """The ``bytes`` columns of one columnar payload, each checked before it is used.

    Every column's length is checked against ``count`` when the payload is opened, before anything
    is allocated for its rows: a few bytes that claim millions of rows are refused at once."""

    def __init__(self, ctx: BatchContext, message: object, layout: Layout) -> None:
        self.ctx = ctx
        self.msg = message
        self.count: int = message.count  # type: ignore[attr-defined]
        self.layout = layout
        size: int = message.ByteSize()  # type: ignore[attr-defined]
        check_count(ctx.kind, self.count, layout.row_bytes, size)
        for column, dtype in layout.required.items():
            self._check_length(column, dtype)
        for column, dtype in layout.optional.items():
            if getattr(message, column):
                self._check_length(column, dtype)
        table = message.strings  # type: ignore[attr-defined]
        check_repeated(self.where("strings"), table)
        self.strings = pa.array(list(table), type=pa.string())
        #: each string's bytes, and one more 0 for the -1 of "none"
        self._lengths = np.append(pc.binary_length(self.strings).to_numpy(zero_copy_only=False), 0).astype(np.int64)
        #: bytes the string columns may hold once every row has its own copy (``strings_at``)
        self._string_budget = STRING_EXPANSION * size

    def where(self, column: str) -> str:
        return f"{self.ctx.kind}.{column}"

    def _check_length(self, column: str, dtype: str) -> None:
        raw = getattr(self.msg, column)
        itemsize = np.dtype(dtype).itemsize
        if len(raw) != self.count * itemsize:
            raise IngestError(
                f"{self.where(column)}: {len(raw)} bytes, but count={self.count} values of {itemsize} bytes"
                f" need {self.count * itemsize}: every column of a batch holds exactly `count` values",
                "count",
            )

    def array(self, column: str) -> np.ndarray:
        """``column``'s values as its layout's type, without a copy (its length was checked on opening)."""
        dtype = self.layout.required.get(column) or self.layout.optional[column]
        return np.frombuffer(getattr(self.msg, column), dtype=dtype)

    def optional(self, column: str, missing: int) -> np.ndarray:
        """A column older agents may leave empty: then every value is ``missing``."""
        if self.count and not getattr(self.msg, column):
            return np.full(self.count, missing, dtype=self.layout.optional[column])
        return self.array(column)

    def at_least(self, column: str, lo: int, values: np.ndarray | None = None) -> np.ndarray:
        """``column``'s values (or ``values`` read from it), refused below ``lo`` (-1: "none"; 0: a
        column the schema stores unsigned, where a negative value would wrap)."""
        values = self.array(column) if values is None else values
        if values.size and values.min() < lo:
            raise IngestError(f"{self.where(column)}: value {values.min()} where only values >= {lo} are valid", "range")
        return values

    def unsigned(self, column: str) -> np.ndarray:
        """A signed column the schema stores unsigned: a negative value would wrap, so it is refused."""
        return self.at_least(column, 0)

    def strings_at(self, column: str, *, none_allowed: bool = False, limit: int = MAX_ID_CHARS) -> pa.Array:
        """Strings from int32 indices into the batch's string table (-1 -> '' where allowed), each at
        most ``limit`` bytes (names are ids; free text such as attributes is longer)."""
        index = self.array(column)
        n = len(self.strings)
        low = -1 if none_allowed else 0
        if index.size and (index.min() < low or index.max() >= n):
            bad = index[(index < low) | (index >= n)][0]
            raise IngestError(
                f"{self.where(column)}: string index {bad} outside the batch's string table"
                f" (valid: {low} .. {n - 1}, {n} strings)",
                "range",
            )
        lengths = self._lengths[index]
        if lengths.size and lengths.max() > limit:
            i = int(np.argmax(lengths > limit))
            raise IngestError(f"{self.where(column)}: row {i} names a string of {lengths[i]} bytes, more than the {limit} allowed", "length")
        taken = int(lengths.sum())
        self._string_budget -= taken
        if self._string_budget < 0:
            raise IngestError(
                f"{self.where(column)}: its rows name {taken} bytes of strings, more than {STRING_EXPANSION}"
                " times the payload's size in all: name long strings from fewer rows",
                "length",
            )
        if none_allowed:
            return pa.concat_arrays([self.strings, pa.array([""])]).take(np.where(index < 0, n, index))
        return self.strings.take(index)

    def enum(self, column: str, names: Sequence[str]) -> pa.Array:
        """A one-byte enum column as its ``names`` (``enum_names``), refusing values the contract lacks."""
        values = self.array(column)
        if values.size and values.max() >= len(names):
            known = ", ".join(f"{i}={name}" for i, name in enumerate(names))
            raise IngestError(f"{self.where(column)}: unknown value {values.max()} (known: {known})", "range")
        return pa.array(names, type=pa.string()).take(values)

    def times(self, column: str, *, zero_is_unknown: bool = False) -> np.ndarray:
        """Times (int64 ns) moved onto the collector's clock and checked against the window.

        Where the contract says 0 means "unknown" (a collective that never started or ended),
        0 stays 0 and is exempt from the window.
        """
        raw = self.array(column)
        if not zero_is_unknown:
            return self.ctx.shift(self.where(column), raw)
        known = raw != 0
        self.ctx.shift(self.where(column), raw[known])
        return np.where(known, raw + np.int64(self.ctx.offset), 0)

    def ordered(self, earlier: str, later: str, first: np.ndarray, then: np.ndarray) -> None:
        """Refuse rows whose ``later`` time (0: unknown) comes before their ``earlier`` one."""
        wrong = (then < first) & (then != 0) & (first != 0)
        if wrong.any():
            i = int(np.argmax(wrong))
            raise IngestError(
                f"{self.where(later)}: row {i} ends ({then[i]}) before {self.where(earlier)} ({first[i]}): a span or"
                " operation ends after it begins",
                "order",
            )

    def run_rank(self) -> dict[str, object]:
        """The run and rank columns: each row's rank from the ``rank`` column where the batch has one."""
        if self.count and self.msg.rank:  # type: ignore[attr-defined]
            ranks: np.ndarray = row_ranks(self.ctx, self.array("rank"), self.where("rank"))
        else:
            ranks = np.full(self.count, self.ctx.rank, dtype=np.uint32)
        return {"run_id": pa.repeat(pa.scalar(self.ctx.run_id), self.count), "rank": ranks}


def timestamps(values: np.ndarray) -> pa.Array:
    """Nanoseconds on the collector's clock as the schema's DateTime64(9)."""
    return pa.array(values, type=TIMESTAMP)


def row_ranks(ctx: BatchContext, ranks: np.ndarray, where: str) -> np.ndarray:
    """Check the ranks rows name (``check_ranks``) and note them in ``ctx``: the batch speaks for them,
    and its rows take the attempt of the process that recorded them where the collector saw it
    register, else their rank's newest (``BatchContext.row_attempts``). A relay's part from a process
    that has not registered while its rank's newest registration is another's is refused
    (``RunInfo.unregistered_parts``): its rows would be taken for the earlier attempt's."""
    check_ranks(ctx.run, ranks, where)
    unique, where_in = np.unique(ranks, return_inverse=True)
    ctx.ranks = tuple(unique.tolist())
    newest = np.array(ctx.run.attempts(ctx.ranks), dtype=np.int64)[where_in]
    counts = [p.count for p in ctx.parts]
    if len(counts) > 1:  # a relay's batch: a process per part (counted in its rows; held_parts checks)
        if unregistered := ctx.run.unregistered_parts(ctx.parts):
            rank = next(p.rank for p in ctx.parts if p.batch_id in unregistered)
            raise UnregisteredRun(ctx.run_id, rank, unregistered)
        known = np.repeat(ctx.run.part_attempts(ctx.parts), counts) if sum(counts) == len(ranks) else np.full(len(ranks), -1)
    else:  # one process that speaks for several ranks (a simulator's worker)
        known = np.full(len(ranks), ctx.run.processes.get(ctx.sender, -1))
    ctx.row_attempts = np.where(known >= 0, known, newest).astype(np.uint16)
    return ranks.astype(np.uint32)


def check_ranks(run: RunInfo, ranks: np.ndarray, where: str) -> None:
    """Refuse ranks below 0, or past the run's world (once it is known) unless they registered: a rank
    of an earlier, larger attempt still delivers its last rows."""
    world = run.world_size
    outside = (ranks < 0) | (ranks >= world) if world else ranks < 0
    if world and outside.any():
        outside &= ~np.isin(ranks, np.fromiter(run.registered, dtype=np.int64, count=len(run.registered)))
    if outside.any():
        inside = f"0 .. {world - 1} (the run's world)" if world else ">= 0"
        raise IngestError(f"{where}: rank {ranks[outside][0]} outside {inside}", "rank")
