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
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa

from rankscope.collector.run_registry import RunRegistry
from rankscope.collector.store import schema
from rankscope.collector.store.base import arrow_schema, arrow_type
from rankscope.protos.v1 import ingest_pb2


class IngestError(ValueError):
    """A malformed batch (gRPC INVALID_ARGUMENT): resending it unchanged can never succeed."""


@dataclass(frozen=True)
class TimeWindow:
    """How far from the collector's clock a batch's times may lie.

    Rows far in the past would be dropped at once by the retention TTL, and rows scattered over
    many days would fail a shared insert with "too many partitions": both are refused up front.
    """

    past_s: float = 86_400.0
    future_s: float = 3_600.0


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
    arrays = [_array(columns[f.name], f.type) for f in target]
    return pa.Table.from_arrays(arrays, schema=target)


def _array(values: object, type_: pa.DataType) -> pa.Array:
    return values if isinstance(values, pa.Array) else pa.array(values, type=type_)


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
        self.offset = batch.clock_offset_ns
        self.now_ns = now_ns
        self.lo = now_ns - int(window.past_s * 1e9)
        self.hi = now_ns + int(window.future_s * 1e9)

    def check_times(self, what: str, lo: int, hi: int) -> None:
        """Refuse times (already on the collector's clock) outside the accepted window."""
        if lo >= self.lo and hi <= self.hi:
            return
        raise IngestError(
            f"{what}: times {_iso(lo)} .. {_iso(hi)} (collector clock, after adding clock_offset_ns="
            f"{self.offset}) lie outside the accepted window {_iso(self.lo)} .. {_iso(self.hi)} around the"
            f" collector's clock {_iso(self.now_ns)}: fix the rank's clock or clock offset, or widen the"
            " collector's --time-window"
        )

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


class Columns:
    """The ``bytes`` columns of one columnar payload, each checked before it is used."""

    def __init__(self, ctx: BatchContext, message: object) -> None:
        self.ctx = ctx
        self.msg = message
        self.count: int = message.count  # type: ignore[attr-defined]
        self.strings = pa.array(list(message.strings), type=pa.string())  # type: ignore[attr-defined]

    def _where(self, column: str) -> str:
        return f"{self.ctx.kind}.{column}"

    def array(self, column: str, dtype: str) -> np.ndarray:
        """``column``'s values as ``dtype``, without a copy, once its byte length matches ``count``."""
        raw = getattr(self.msg, column)
        itemsize = np.dtype(dtype).itemsize
        if len(raw) != self.count * itemsize:
            raise IngestError(
                f"{self._where(column)}: {len(raw)} bytes, but count={self.count} values of {itemsize} bytes"
                f" need {self.count * itemsize}: every column of a batch holds exactly `count` values"
            )
        return np.frombuffer(raw, dtype=dtype)

    def optional(self, column: str, dtype: str, missing: int) -> np.ndarray:
        """A column older agents may leave empty: then every value is ``missing``."""
        if self.count and not getattr(self.msg, column):
            return np.full(self.count, missing, dtype=dtype)
        return self.array(column, dtype)

    def unsigned(self, column: str, dtype: str) -> np.ndarray:
        """A signed column the schema stores unsigned: a negative value would wrap, so it is refused."""
        values = self.array(column, dtype)
        if values.size and values.min() < 0:
            raise IngestError(f"{self._where(column)}: negative value {values.min()} where only values >= 0 are valid")
        return values

    def strings_at(self, column: str, *, none_allowed: bool = False) -> pa.Array:
        """Strings from int32 indices into the batch's string table (-1 -> '' where allowed)."""
        index = self.array(column, "<i4")
        n = len(self.strings)
        low = -1 if none_allowed else 0
        if index.size and (index.min() < low or index.max() >= n):
            bad = index[(index < low) | (index >= n)][0]
            raise IngestError(
                f"{self._where(column)}: string index {bad} outside the batch's string table"
                f" (valid: {low} .. {n - 1}, {n} strings)"
            )
        if none_allowed:
            return pa.concat_arrays([self.strings, pa.array([""])]).take(np.where(index < 0, n, index))
        return self.strings.take(index)

    def enum(self, column: str, names: Sequence[str]) -> pa.Array:
        """A one-byte enum column as its ``names`` (``enum_names``), refusing values the contract lacks."""
        values = self.array(column, "u1")
        if values.size and values.max() >= len(names):
            known = ", ".join(f"{i}={name}" for i, name in enumerate(names))
            raise IngestError(f"{self._where(column)}: unknown value {values.max()} (known: {known})")
        return pa.array(names, type=pa.string()).take(values)

    def times(self, column: str, *, zero_is_unknown: bool = False) -> pa.Array:
        """Times moved onto the collector's clock and checked against the window.

        Where the contract says 0 means "unknown" (a collective that never started or ended),
        0 stays 0 and is exempt from the window.
        """
        raw = self.array(column, "<i8")
        known = raw != 0 if zero_is_unknown else None
        shifted = raw + np.int64(self.ctx.offset)
        if zero_is_unknown:
            shifted = np.where(known, shifted, 0)
            checked = shifted[known]
        else:
            checked = shifted
        if checked.size:
            self.ctx.check_times(self._where(column), int(checked.min()), int(checked.max()))
        return pa.array(shifted, type=TIMESTAMP)

    def run_rank(self, registry: RunRegistry) -> dict[str, object]:
        """The run and rank columns: each row's rank from the ``rank`` column where the batch has one."""
        if self.count and self.msg.rank:  # type: ignore[attr-defined]
            ranks: np.ndarray = row_ranks(self.ctx, registry, self.array("rank", "<i4"), self._where("rank"))
        else:
            ranks = np.full(self.count, self.ctx.rank, dtype=np.uint32)
        return {"run_id": pa.repeat(pa.scalar(self.ctx.run_id), self.count), "rank": ranks}


def row_ranks(ctx: BatchContext, registry: RunRegistry, ranks: np.ndarray, where: str) -> np.ndarray:
    """Check the ranks rows name (>= 0, inside the run's world once it is known) and note them in
    ``ctx``: the batch speaks for them, and its rows take each rank's attempt (``BatchContext.row_attempts``)."""
    run = registry.run(ctx.run_id)
    world = run.world_size
    bad = ranks[(ranks < 0) | (ranks >= world)] if world else ranks[ranks < 0]
    if bad.size:
        inside = f"0 .. {world - 1} (the run's world)" if world else ">= 0"
        raise IngestError(f"{where}: rank {bad[0]} outside {inside}")
    unique, where_in = np.unique(ranks, return_inverse=True)
    ctx.ranks = tuple(unique.tolist())
    ctx.row_attempts = np.array(run.attempts(ctx.ranks), dtype=np.uint16)[where_in]
    return ranks.astype(np.uint32)

