"""Decode one agent ``Batch`` into Arrow tables, one per schema table it touches.

Columnar payloads are read with ``numpy.frombuffer`` and turned into Arrow arrays without one
Python object per event: that is what lets one collector take more than a million events per
second on two cores. Every column is checked before anything is written (byte lengths against
``count``, string indices, enum values, signs of unsigned columns, times inside the accepted
window), so a malformed batch is refused whole with a message a person can act on, and never
reaches a shared insert where it could fail the good rows buffered with it.

The produced tables have exactly ``schema.BY_NAME[t].insert_columns``, in order, with the Arrow
types of ``store.base.arrow_schema`` (so the store casts nothing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa

from rankscope.collector.store import schema
from rankscope.collector.store.base import arrow_schema, arrow_type
from rankscope.protos.v1 import BATCH_SCHEMA_VERSION, ingest_pb2, telemetry_pb2

log = logging.getLogger("rankscope.collector")

BATCH_ID_BYTES = 16
#: payloads about the run as a whole (their batch's rank is 0 and says nothing about rank 0)
RUN_LEVEL = ("action", "selfcheck")
#: payloads that register ranks
REGISTRATIONS = frozenset({"register", "registers"})


class IngestError(ValueError):
    """A malformed batch (gRPC INVALID_ARGUMENT): resending it unchanged can never succeed."""


class UnsupportedSchemaVersion(Exception):
    """A batch of a wire-contract version this collector does not speak (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class TimeWindow:
    """How far from the collector's clock a batch's times may lie.

    Rows far in the past would be dropped at once by the retention TTL, and rows scattered over
    many days would fail a shared insert with "too many partitions": both are refused up front.
    """

    past_s: float = 86_400.0
    future_s: float = 3_600.0


@dataclass(frozen=True)
class Decoded:
    """What one batch becomes: its payload kind, its rows per table, and the ranks it speaks for
    (the envelope's, or those its rows name)."""

    kind: str
    parts: dict[str, pa.Table]
    ranks: tuple[int, ...] = ()


def _enum_names(enum: object, prefix: str) -> tuple[str, ...]:
    """Lower-case names of a proto enum indexed by value (``SPAN_KIND_COMM`` -> ``comm``)."""
    items = sorted((value, name) for name, value in enum.items())  # type: ignore[attr-defined]
    if [value for value, _ in items] != list(range(len(items))):
        raise AssertionError(f"{prefix}* values are not 0..n-1")
    return tuple(name.removeprefix(prefix).lower() for _, name in items)


SPAN_KINDS = _enum_names(telemetry_pb2.SpanKind, "SPAN_KIND_")
COLLECTIVE_STATES = _enum_names(telemetry_pb2.CollectiveState, "COLLECTIVE_STATE_")
EXIT_REASONS = _enum_names(telemetry_pb2.EndOfRank.Reason, "REASON_")


_SCHEMAS: dict[str, pa.Schema] = {t.name: arrow_schema(t) for t in schema.TABLES if not t.source}  # rollups are never written to
#: how DateTime64(9) travels in Arrow
TIMESTAMP = arrow_type("DateTime64(9)")


def _table(name: str, columns: Mapping[str, object], attempt: int | np.ndarray | None = None) -> pa.Table:
    """An Arrow table for ``name`` from column name -> values (numpy, Arrow or list); a table with an
    ``attempt`` column gets ``attempt``: the batch's in every row, or one per row."""
    target = _SCHEMAS[name]
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


# --- what the collector knows about runs and ranks -------------------------------------------


@dataclass(frozen=True)
class Registration:
    """A rank's newest registration: its process's start and the registration's time as the rank's
    own clock gave them (one rank's registrations come from one host's clock, so they are ordered
    without a clock offset, which the agent does not know yet when it first registers), and the
    version its rows were stored with (collector clock). Read back from the store after a restart,
    only the version is known (the times are 0)."""

    start_ns: int
    time_ns: int
    version: int
    #: the attempt (restart) of the run the registering process belongs to
    attempt: int = 0

    def newer(self, start_ns: int, time_ns: int, at_ns: int, attempt: int = 0) -> bool | None:
        """Whether a registration (its attempt, its process's start and time on the rank's clock, its
        time on the collector's) is newer than this one; None: this one again (sent again after a
        reconnect). A later attempt is newer whatever the clocks say: after a restart the same rank
        may run on another host, whose clock is not this one's."""
        if attempt != self.attempt:
            return attempt > self.attempt
        if not (time_ns and self.time_ns):  # read back from the store, or an agent that sends no time
            return at_ns >= self.version
        if (start_ns, time_ns) == (self.start_ns, self.time_ns):
            return None
        return (start_ns, time_ns) > (self.start_ns, self.time_ns)


@dataclass
class RunInfo:
    """One run as its ranks' registrations and exits describe it."""

    name: str = ""
    start_ns: int = 0
    world_size: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    config: str = ""
    #: whether tp, pp and dp come from a rank that knew its place in them
    placed: bool = False
    hosts: dict[int, str] = field(default_factory=dict)
    #: rank -> its newest registration
    registered: dict[int, Registration] = field(default_factory=dict)
    #: rank -> (exit reason, exit time ns)
    exits: dict[int, tuple[str, int]] = field(default_factory=dict)
    #: world (torchrun round, ``Register.world``) -> its attempt, numbered in the order worlds registered
    worlds: dict[str, int] = field(default_factory=dict)
    #: (rank, agent instance) -> the attempt of the world that process registered in
    processes: dict[tuple[int, bytes], int] = field(default_factory=dict)
    #: group name -> the group as this collector last stored it (``_group_key``): every rank's
    #: registration carries its groups, which need storing once, not once per member (at 100,000
    #: ranks, a data-parallel group of 782 members would be written 782 times)
    groups: dict[str, bytes] = field(default_factory=dict)

    def merge(self, other: RunInfo) -> None:
        """Fill what this record lacks from ``other`` (an older record read back from the store)."""
        if not self.world_size or (other.placed and not self.placed):
            self.tp, self.pp, self.dp, self.placed = other.tp, other.pp, other.dp, other.placed
        if not self.world_size:
            self.name, self.world_size, self.config = other.name, other.world_size, other.config
        if other.start_ns and (not self.start_ns or other.start_ns < self.start_ns):
            self.start_ns = other.start_ns
        self.hosts = {**other.hosts, **self.hosts}
        self.worlds = {**other.worlds, **self.worlds}
        self.registered = {**other.registered, **self.registered}
        self.exits = {**other.exits, **self.exits}

    def ended_since(self, rank: int, at_ns: int) -> bool:
        """Whether ``rank`` ended after ``at_ns``: a registration made then is news of the past."""
        exited = self.exits.get(rank)
        return exited is not None and at_ns <= exited[1]

    def attempt(self, rank: int) -> int:
        """The attempt of ``rank``'s newest registration (0 before any)."""
        return self.attempts((rank,))[0]

    def attempts(self, ranks: Iterable[int]) -> list[int]:
        """:meth:`attempt` of each of ``ranks``."""
        registered = self.registered
        return [held.attempt if (held := registered.get(rank)) is not None else 0 for rank in ranks]

    def attempt_of(self, batch: ingest_pb2.Batch) -> int:
        """The attempt of the process that sent ``batch``: the number of the world it registered in
        (a new world gets the next number), else its rank's newest registration's (a collector that
        restarted since), else what the envelope says (an agent that sends no world)."""
        process = (batch.rank, bytes(batch.batch_id[:8]))
        kind = batch.WhichOneof("payload")
        world = batch.register.world if kind == "register" else batch.registers.registers[0].world if kind == "registers" and batch.registers.registers else ""
        if world:
            if world not in self.worlds:
                self.worlds[world] = max(self.worlds.values(), default=-1) + 1
            self.processes[process] = self.worlds[world]
        if process in self.processes:
            return self.processes[process]
        return self.attempt(batch.rank) if batch.rank in self.registered else batch.attempt

    def register(self, rank: int, start_ns: int, time_ns: int, at_ns: int, attempt: int = 0) -> int | None:
        """Note a registration of ``rank`` (its process's start and its time on the rank's clock,
        ``at_ns`` on the collector's); the version to store its rows with, or None when it is older
        than the rank's newest registration: one delivered late (a retry, a spool replay) must not
        undo what came after it. One made before the rank's exit but delivered after it is stored
        (the caller does not reopen the rank): the last registration, sent with the rank's end,
        carries the groups its last steps created, and its calls may be answered in any order."""
        held = self.registered.get(rank)
        newer = True if held is None else held.newer(start_ns, time_ns, at_ns, attempt)
        if newer is False:
            return None
        if held is None:
            version = at_ns
        elif newer is None:
            version = held.version  # the same registration again: its rows keep their version
        else:  # above the rank's earlier versions even when the agent's clock offset was corrected in between
            version = max(at_ns, held.version + 1)
        self.registered[rank] = Registration(start_ns, time_ns, version, attempt)
        return version


class RunRegistry:
    """Runs and ranks seen by this collector: hosts for heartbeats, exits for a run's end.

    Filled by Register and EndOfRank batches; after a restart, by what the store holds (the
    server asks :meth:`needs_load` and merges :func:`read_run`). Entries are idempotent, so a
    batch decoded twice (a retry after a failed write) leaves the same state.
    """

    #: a rank missing from a loaded run is looked up again after this long (another collector
    #: behind the same load balancer may have taken its registration)
    RELOAD_AFTER_S = 10.0

    def __init__(self) -> None:
        self._runs: dict[str, RunInfo] = {}
        self._loaded_at: dict[str, float] = {}

    def run(self, run_id: str) -> RunInfo:
        return self._runs.setdefault(run_id, RunInfo())

    def host(self, run_id: str, rank: int) -> str:
        run = self._runs.get(run_id)
        return run.hosts.get(rank, "") if run else ""

    def has_ended(self, run_id: str, rank: int) -> bool:
        run = self._runs.get(run_id)
        return bool(run) and rank in run.exits

    def needs_load(self, run_id: str, rank: int, now_s: float, registering: bool = False) -> bool:
        """Whether the store should be asked about this run before decoding (monotonic ``now_s``): once,
        and again for a rank it does not know, unless that rank is registering (it brings its host
        itself; while 100,000 ranks register, each reload would read the whole run again)."""
        loaded = self._loaded_at.get(run_id)
        if loaded is None:
            return True
        return not registering and rank not in self.run(run_id).hosts and now_s - loaded > self.RELOAD_AFTER_S

    def merge_loaded(self, run_id: str, stored: RunInfo, now_s: float) -> None:
        self.run(run_id).merge(stored)
        self._loaded_at[run_id] = now_s

    def stored(self, run_id: str, decoded: Decoded) -> None:
        """``decoded`` is in the store now: its groups need not be written again (a batch refused or
        failed before this is decoded again in full when it is sent again)."""
        groups = decoded.parts.get("groups")
        if groups is not None and groups.num_rows:
            known = self.run(run_id).groups
            for row in groups.select(["name", "description", "ranks"]).to_pylist():
                known[row["name"]] = _group_key(telemetry_pb2.Group(**row))


def read_run(query: Callable[[str, Mapping[str, object]], pa.Table], run_id: str) -> RunInfo:
    """What the store knows about ``run_id``: ``query(sql, params) -> pa.Table`` runs the SQL.

    Rows written by this process before a restart, or by another collector, are found here.
    """
    run_q = (
        "SELECT argMax(name, updated) AS name, toUnixTimestamp64Nano(min(start_time)) AS start,"
        " argMax(world_size, updated) AS ws,"
        " argMax(tp, updated) AS tp, argMax(pp, updated) AS pp, argMax(dp, updated) AS dp,"
        " argMax(config, updated) AS config FROM runs WHERE run_id = {run_id:String} HAVING count() > 0"
    )
    ranks_q = (
        "SELECT rank, argMax(host, registered) AS host, toUnixTimestamp64Nano(max(registered)) AS newest,"
        " argMax(pp_rank, registered) >= 0 AS placed, max(attempt) AS attempt FROM ranks WHERE run_id = {run_id:String} GROUP BY rank"
    )
    exits_q = (
        "SELECT rank, argMax(reason, time) AS reason, toUnixTimestamp64Nano(max(time)) AS t"
        " FROM exits WHERE run_id = {run_id:String} GROUP BY rank"
    )
    params = {"run_id": run_id}
    info = RunInfo()
    for row in query(run_q, params).to_pylist():
        info = RunInfo(row["name"], row["start"], row["ws"], row["tp"], row["pp"], row["dp"], row["config"])
    ranks = query(ranks_q, params).to_pylist()
    info.hosts = {r["rank"]: r["host"] for r in ranks}
    info.registered = {r["rank"]: Registration(0, 0, r["newest"], r["attempt"]) for r in ranks}
    info.placed = any(r["placed"] for r in ranks)
    info.exits = {r["rank"]: (r["reason"], r["t"]) for r in query(exits_q, params).to_pylist()}
    worlds_q = "SELECT world, min(attempt) AS attempt FROM ranks WHERE run_id = {run_id:String} AND world != '' GROUP BY world"
    info.worlds = {r["world"]: r["attempt"] for r in query(worlds_q, params).to_pylist()}
    return info


class LastHeard:
    """When the collector last heard from each rank, by its own clock, whatever its writer has stored.

    A collector that falls behind (short of CPU, replaying a spool, a slow store) stores heartbeats
    late: judged by its newest stored heartbeat, every rank would look silent while it keeps
    sending. A rank is heard when a heartbeat batch of it arrives, at the arrival time; a batch
    whose newest heartbeat is older than ``stale_ns`` on arrival (a spool replayed after the rank's
    end) says only that the rank lived until that heartbeat. Written on the event loop, read by the
    diagnosis thread (``of`` copies).

    Silence counts only the time the collector could listen. While its event loop stalls (the
    process stopped, or starved of CPU) the ranks' calls wait unread in its sockets, so a stall is
    added to every rank's last-heard time: ``listening()``, called by the loop every ``tick_s``,
    counts a tick that came more than a tick late as a stall, and ``of`` counts the stall in
    progress too (a diagnosis pass can run before the loop catches up).
    """

    def __init__(self, stale_ns: int, tick_s: float = 1.0) -> None:
        self.stale_ns = stale_ns
        self._heard: dict[tuple[str, int], dict[int, int]] = {}
        self._tick_ns = int(tick_s * 1e9)
        self._ticked_ns: int | None = None  # monotonic: the loop's last tick
        self._deaf_ns = 0  # the stalls so far; heard times are kept less the stalls before them

    def listening(self, now_ns: int | None = None) -> None:
        """The event loop's tick (``now_ns``: monotonic): the time since the last one beyond a tick's
        lateness was time the collector could not listen."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        self._deaf_ns += self._stalled(now_ns)
        self._ticked_ns = now_ns

    def _stalled(self, now_ns: int) -> int:
        if self._ticked_ns is None:
            return 0
        late = now_ns - self._ticked_ns - self._tick_ns
        return late if late > self._tick_ns else 0

    def note(self, decoded: Decoded, received_ns: int) -> None:
        """Every rank with a heartbeat in ``decoded`` is heard, each by its own newest heartbeat."""
        beats = decoded.parts.get("heartbeats")
        if beats is None or beats.num_rows == 0:
            return
        run_id = beats["run_id"][0].as_py()
        newest = beats["time"].cast(pa.int64()).to_numpy()
        heard = np.where(received_ns - newest <= self.stale_ns, received_ns, newest) - self._deaf_ns
        attempts = beats["attempt"].to_numpy()
        for attempt in np.unique(attempts).tolist():
            mine = attempts == attempt
            ranks = self._heard.setdefault((run_id, attempt), {})
            for rank, at in zip(beats["rank"].to_numpy()[mine].tolist(), heard[mine].tolist()):
                if at > ranks.get(rank, 0):
                    ranks[rank] = at

    def of(self, run_id: str, attempt: int, now_ns: int | None = None) -> dict[int, int]:
        """rank -> when it was last heard (ns, collector clock), for one attempt of a run, moved later
        by the stalls since (``now_ns``: monotonic, for the stall in progress)."""
        deaf = self._deaf_ns + self._stalled(time.monotonic_ns() if now_ns is None else now_ns)
        return {rank: heard + deaf for rank, heard in self._heard.get((run_id, attempt), {}).items()}

    def forget(self, run_id: str) -> None:
        self._heard = {key: ranks for key, ranks in self._heard.items() if key[0] != run_id}


# --- decoding ---------------------------------------------------------------------------------


class _Context:
    """One batch being decoded: envelope values, the clock, and the time-window check."""

    def __init__(self, batch: ingest_pb2.Batch, now_ns: int, window: TimeWindow, kind: str):
        self.kind = kind
        self.run_id = batch.run_id
        self.rank = batch.rank
        self.attempt = batch.attempt
        #: the ranks the rows speak for and each row's attempt, when rows name their ranks (``_row_ranks``)
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
        shifted = value_ns + self.offset
        self.check_times(what, shifted, shifted)
        return shifted


def _iso(ns: int) -> str:
    try:
        return datetime.fromtimestamp(ns / 1e9, timezone.utc).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return f"{ns} ns"


class _Columns:
    """The ``bytes`` columns of one columnar payload, each checked before it is used."""

    def __init__(self, ctx: _Context, message: object):
        self.ctx = ctx
        self.msg = message
        self.count: int = message.count  # type: ignore[attr-defined]
        self.strings = pa.array(list(message.strings), type=pa.string())  # type: ignore[attr-defined]

    def _where(self, column: str) -> str:
        return f"{self.ctx.kind}.{column}"

    def array(self, column: str, dtype: str) -> np.ndarray:
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
            ranks: np.ndarray = _row_ranks(self.ctx, registry, self.array("rank", "<i4"), self._where("rank"))
        else:
            ranks = np.full(self.count, self.ctx.rank, dtype=np.uint32)
        return {"run_id": pa.repeat(pa.scalar(self.ctx.run_id), self.count), "rank": ranks}


def _row_ranks(ctx: _Context, registry: RunRegistry, ranks: np.ndarray, where: str) -> np.ndarray:
    """Check the ranks rows name (>= 0, inside the run's world once it is known) and note them in
    ``ctx``: the batch speaks for them, and its rows take each rank's attempt (``_Context.row_attempts``)."""
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


def _register(ctx: _Context, reg: telemetry_pb2.Register, registry: RunRegistry) -> dict[str, pa.Table]:
    return _registrations(ctx, [(ctx.rank, reg)], registry, lambda i: "register")


def _registers(ctx: _Context, msg: telemetry_pb2.RegisterBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    """Several ranks' registrations from one sender: one call and one table each for all of them."""
    if not msg.registers:
        raise IngestError("registers.registers is empty: a registration batch holds at least one registration")
    if len(msg.ranks) != len(msg.registers):
        raise IngestError(f"registers: {len(msg.ranks)} ranks for {len(msg.registers)} registrations: give each registration its rank")
    worlds = sorted({reg.world for reg in msg.registers})
    if len(worlds) > 1:
        raise IngestError(f"registers: registrations of {len(worlds)} worlds ({', '.join(map(repr, worlds[:3]))}) in one batch: send each world's in a batch of its own")
    ctx.ranks = tuple(sorted(set(msg.ranks)))
    return _registrations(ctx, list(zip(msg.ranks, msg.registers)), registry, lambda i: f"registers.registers[{i}]")


def _registrations(
    ctx: _Context, regs: list[tuple[int, telemetry_pb2.Register]], registry: RunRegistry, where: Callable[[int], str]
) -> dict[str, pa.Table]:
    """The rows of ``regs`` (rank, its registration), each checked before any is noted: a batch is
    stored whole or refused whole, and a refused one leaves the registry as it was."""
    times, keys = [], []
    checked: set[tuple[bytes, int]] = set()  # (group, world size) found inside the world: a batch's ranks share their groups
    for i, (rank, reg) in enumerate(regs):
        if reg.world_size < 1:
            raise IngestError(f"{where(i)}.world_size is {reg.world_size}: it must be at least 1")
        if rank < 0:
            raise IngestError(f"the rank of {where(i)} is {rank}: ranks are >= 0")
        if rank >= reg.world_size:
            raise IngestError(f"rank {rank} is not below {where(i)}.world_size {reg.world_size}")
        keys.append([_group_key(g) for g in reg.groups])
        for g, key in zip(reg.groups, keys[-1]):
            if (key, reg.world_size) in checked:
                continue
            if g.ranks and (min(g.ranks) < 0 or max(g.ranks) >= reg.world_size):  # min and max first: thousands of members
                outside = [r for r in g.ranks if not 0 <= r < reg.world_size]
                raise IngestError(f"{where(i)}.groups[{g.name!r}]: ranks {outside} outside 0 .. {reg.world_size - 1}")
            checked.add((key, reg.world_size))
        start = ctx.time(f"{where(i)}.start_time_ns", reg.start_time_ns)
        times.append((start, ctx.time(f"{where(i)}.time_ns", reg.time_ns) if reg.time_ns else ctx.now_ns))
    run = registry.run(ctx.run_id)
    if not run.registered:  # the user needs the id for `rankscope diagnose --run` and the dashboard's ?run=
        rank, reg = regs[0]
        log.info("run %s: rank %d of %d registered from %s", ctx.run_id, rank, reg.world_size, reg.host)
    rows: list[tuple[int, telemetry_pb2.Register, int]] = []
    groups: dict[str, tuple[telemetry_pb2.Group, int]] = {}
    alive = late = False
    for (rank, reg), (start, at_ns), group_keys in zip(regs, times, keys):
        ended = run.ended_since(rank, at_ns)
        version = run.register(rank, reg.start_time_ns, reg.time_ns, at_ns, ctx.attempt)
        if version is None:
            continue  # an older registration than the rank's newest (or than its end), delivered late
        rows.append((rank, reg, version))
        for g, key in zip(reg.groups, group_keys):  # stored once, not once per member
            if run.groups.get(g.name) != key:
                groups[g.name] = (g, version)
        # A rank that does not know its coordinates yet (registered before the script set the topology)
        # does not undo the sizes a rank that knew them sent.
        placed = min(reg.tp_rank, reg.pp_rank, reg.dp_rank) >= 0
        if placed or not run.placed:
            run.tp, run.pp, run.dp, run.placed = max(reg.tp, 1), max(reg.pp, 1), max(reg.dp, 1), placed
        run.world_size = reg.world_size
        run.start_ns = min(run.start_ns, start) if run.start_ns else start
        # Ranks that leave the name or config empty do not erase what another rank sent.
        run.name, run.config = reg.run_name or run.name, reg.config_json or run.config
        run.hosts[rank] = reg.host
        if ended:  # the rank's identity is news, its being alive is not: it has ended since
            late = True
        else:
            run.exits.pop(rank, None)  # registered again: the rank (or its restart) is alive
            alive = True
    if not rows:
        return {}
    n, regs_of = len(rows), [reg for _, reg, _ in rows]
    # Rows versioned by when the agent registered, not by arrival: the newest stands whatever the order.
    parts = {
        "ranks": _table(
            "ranks",
            {
                "run_id": [ctx.run_id] * n, "rank": [rank for rank, _, _ in rows], "host": [r.host for r in regs_of],
                "pid": [max(r.pid, 0) for r in regs_of], "local_rank": [r.local_rank for r in regs_of],
                "device": [r.device for r in regs_of], "tp_rank": [r.tp_rank for r in regs_of],
                "pp_rank": [r.pp_rank for r in regs_of], "dp_rank": [r.dp_rank for r in regs_of],
                "clock_offset_ns": [ctx.offset] * n, "agent_version": [r.agent_version for r in regs_of],
                "registered": pa.array([v for _, _, v in rows], type=TIMESTAMP), "world": [r.world for r in regs_of],
            },
            ctx.attempt,
        ),
        "groups": _table(
            "groups",
            {
                "run_id": [ctx.run_id] * len(groups), "name": list(groups),
                "description": [g.description for g, _ in groups.values()], "ranks": [list(g.ranks) for g, _ in groups.values()],
                "registered": pa.array([v for _, v in groups.values()], type=TIMESTAMP),
            },
        ),
    }
    if alive:
        parts["runs"] = _runs_row(ctx, run, "running", end_ns=0)
    elif late:  # the world's size may be news too: the ends that came first may be all of it
        _add_ended_row(parts, ctx, run)
    return parts


def _group_key(group: telemetry_pb2.Group) -> bytes:
    """A group's name, description and members as one comparable value (12 us for 782 members,
    against 48 us for a tuple of them)."""
    return telemetry_pb2.Group(name=group.name, description=group.description, ranks=group.ranks).SerializeToString()


def _runs_row(ctx: _Context, run: RunInfo, status: str, end_ns: int) -> pa.Table:
    return _table(
        "runs",
        {
            "run_id": [ctx.run_id], "name": [run.name], "start_time": [run.start_ns], "end_time": [end_ns],
            "world_size": [run.world_size], "tp": [run.tp], "pp": [run.pp], "dp": [run.dp],
            "config": [run.config], "status": [status], "updated": [ctx.now_ns],
        },
    )


def _spans(ctx: _Context, msg: telemetry_pb2.SpanBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    c = _Columns(ctx, msg)
    who = c.run_rank(registry)
    return {
        "spans": _table(
            "spans",
            {
                **who, "step": c.unsigned("step", "<i4"), "name": c.strings_at("name"),
                "kind": c.enum("kind", SPAN_KINDS), "start_time": c.times("start_ns"), "end_time": c.times("end_ns"),
                "microbatch": c.array("microbatch", "<i4"), "attributes": c.strings_at("attributes", none_allowed=True),
                "cpu_ns": c.optional("cpu_ns", "<i8", missing=-1),
            },
            ctx.attempts,
        )
    }


def _collectives(ctx: _Context, msg: telemetry_pb2.CollectiveBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    c = _Columns(ctx, msg)
    who = c.run_rank(registry)
    return {
        "collectives": _table(
            "collectives",
            {
                **who, "group_name": c.strings_at("group"), "seq": c.array("seq", "<i8"),
                "op": c.strings_at("op"), "nbytes": c.unsigned("nbytes", "<i8"), "dtype": c.strings_at("dtype"),
                "peer": c.array("peer", "<i4"), "issue_time": c.times("issue_ns"),
                "start_time": c.times("start_ns", zero_is_unknown=True), "end_time": c.times("end_ns", zero_is_unknown=True),
                "state": c.enum("state", COLLECTIVE_STATES), "step": c.unsigned("step", "<i4"),
            },
            ctx.attempts,
        )
    }


def _heartbeats(ctx: _Context, msg: telemetry_pb2.HeartbeatBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    # One pass over the messages, each field read once, the checks on whole columns: at 100,000
    # ranks 10,000 heartbeats a second arrive, and this runs on the collector's event loop.
    beats = msg.heartbeats
    n = len(beats)
    fields = [(hb.time_ns, hb.step, hb.phase, hb.status, hb.last_progress_ns, hb.events_dropped, hb.in_flight) for hb in beats]
    time_ns, step, phase, status, progress, dropped, flights = zip(*fields) if n else ((),) * 7
    steps = np.array(step, dtype=np.int64)
    if n and steps.min() < 0:
        i = int(np.argmax(steps < 0))
        raise IngestError(f"heartbeats[{i}].step is {steps[i]}: steps are numbered from 1 (0 outside any step)")
    times = np.array(time_ns, dtype=np.int64) + np.int64(ctx.offset)
    if n and (times.min() < ctx.lo or times.max() > ctx.hi):
        i = int(np.argmax((times < ctx.lo) | (times > ctx.hi)))
        ctx.check_times(f"heartbeats[{i}].time_ns", int(times[i]), int(times[i]))
    last = np.array(progress, dtype=np.int64)
    last = np.where(last != 0, last + np.int64(ctx.offset), 0)
    ops = [(op.group, op.seq, op.op, op.peer, op.issue_ns + ctx.offset, int(op.waiting)) for f in flights if f for op in f]
    offsets = pa.array(np.concatenate([[0], np.cumsum([len(f) for f in flights], dtype=np.int64)]).astype(np.int32))
    in_flight = zip(*ops) if ops else ((),) * len(_IN_FLIGHT_COLUMNS)
    if msg.ranks:
        if len(msg.ranks) != n:
            raise IngestError(f"heartbeats.ranks: {len(msg.ranks)} ranks for {n} heartbeats: name one rank per heartbeat, or none")
        ranks = _row_ranks(ctx, registry, np.array(msg.ranks, dtype=np.int64), "heartbeats.ranks").tolist()
    else:
        ranks = [ctx.rank] * n
    hosts = registry.run(ctx.run_id).hosts
    return {
        "heartbeats": _table(
            "heartbeats",
            {
                "run_id": [ctx.run_id] * n, "rank": ranks, "host": [hosts.get(r, "") for r in ranks],
                "time": pa.array(times, type=TIMESTAMP), "step": steps.astype(np.uint32), "phase": list(phase), "status": list(status),
                "last_progress": pa.array(last, type=TIMESTAMP), "events_dropped": list(dropped),
                **{name: _lists(name, offsets, values) for name, values in zip(_IN_FLIGHT_COLUMNS, in_flight)},
            },
            ctx.attempts,
        )
    }


#: a heartbeat's operations in flight, a list column each (the order of the tuples ``_heartbeats`` builds)
_IN_FLIGHT_COLUMNS = ("inflight_group", "inflight_seq", "inflight_op", "inflight_peer", "inflight_issue", "inflight_waiting")


def _lists(column: str, offsets: pa.Array, values: Sequence[object]) -> pa.ListArray:
    """Heartbeats' list column ``column`` from all their values in a row and where each heartbeat's begin."""
    type_ = _SCHEMAS["heartbeats"].field(column).type
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=type_.value_type), type=type_)


def _metrics(ctx: _Context, msg: telemetry_pb2.MetricBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    c = _Columns(ctx, msg)
    return {
        "metrics": _table(
            "metrics",
            {
                "run_id": pa.repeat(pa.scalar(ctx.run_id), c.count), "rank": np.full(c.count, ctx.rank, dtype=np.int32),
                "host": pa.repeat(pa.scalar(registry.host(ctx.run_id, ctx.rank)), c.count),
                "device": c.strings_at("device"), "time": c.times("time_ns"), "name": c.strings_at("name"),
                "value": c.array("value", "<f8"),
            },
            ctx.attempt,
        )
    }


def _step_metrics(ctx: _Context, msg: telemetry_pb2.StepMetricBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    c = _Columns(ctx, msg)
    who = c.run_rank(registry)
    return {
        "step_metrics": _table(
            "step_metrics",
            {
                **who, "step": c.unsigned("step", "<i4"), "name": c.strings_at("name"),
                "value": c.array("value", "<f8"), "time": c.times("time_ns"),
            },
            ctx.attempts,
        )
    }


def _stack(ctx: _Context, msg: telemetry_pb2.StackDump, registry: RunRegistry) -> dict[str, pa.Table]:
    return {
        "stacks": _table(
            "stacks",
            {
                "run_id": [ctx.run_id], "rank": [ctx.rank], "host": [registry.host(ctx.run_id, ctx.rank)],
                "time": [ctx.time("stack.time_ns", msg.time_ns)], "reason": [msg.reason], "method": [msg.method],
                "text": [msg.text],
            },
            ctx.attempt,
        )
    }


def _end(ctx: _Context, msg: telemetry_pb2.EndOfRank, registry: RunRegistry) -> dict[str, pa.Table]:
    run = registry.run(ctx.run_id)
    current = ctx.attempt >= run.attempt(ctx.rank)  # else the end of a process an earlier attempt left behind
    return _exits(ctx, [(ctx.rank, msg, current)], registry, lambda i: "end")


def _ends(ctx: _Context, msg: telemetry_pb2.EndBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    """Several ranks' ends from one sender, each of its rank's newest registration's attempt."""
    if not msg.ends:
        raise IngestError("ends.ends is empty: an end batch holds at least one end")
    if len(msg.ranks) != len(msg.ends):
        raise IngestError(f"ends: {len(msg.ranks)} ranks for {len(msg.ends)} ends: give each end its rank")
    ranks = _row_ranks(ctx, registry, np.asarray(msg.ranks, dtype=np.int64), "ends.ranks")
    return _exits(ctx, [(int(r), end, True) for r, end in zip(ranks, msg.ends)], registry, lambda i: f"ends.ends[{i}]")


def _exits(ctx: _Context, ends: list[tuple[int, telemetry_pb2.EndOfRank, bool]], registry: RunRegistry, where: Callable[[int], str]) -> dict[str, pa.Table]:
    """The rows of ``ends`` (rank, its end, whether it ends the rank's current attempt), each checked
    before any is noted; the run's end once every rank of its world has ended."""
    checked = []
    for i, (rank, msg, current) in enumerate(ends):
        if not 0 <= msg.reason < len(EXIT_REASONS):
            known = ", ".join(f"{k}={name}" for k, name in enumerate(EXIT_REASONS))
            raise IngestError(f"{where(i)}.reason: unknown value {msg.reason} (known: {known})")
        checked.append((rank, msg, current, EXIT_REASONS[msg.reason], ctx.time(f"{where(i)}.time_ns", msg.time_ns)))
    run = registry.run(ctx.run_id)
    for rank, _, current, reason, time_ns in checked:
        if current:
            run.exits[rank] = (reason, time_ns)
    parts = {
        "exits": _table(
            "exits",
            {
                "run_id": [ctx.run_id] * len(checked), "rank": [c[0] for c in checked],
                "host": [registry.host(ctx.run_id, c[0]) for c in checked], "time": [c[4] for c in checked],
                "reason": [c[3] for c in checked], "exit_code": [c[1].exit_code for c in checked],
                "signal": [c[1].signal for c in checked], "message": [c[1].message for c in checked],
            },
            ctx.attempts,
        )
    }
    # Re-emitted when a retried last exit is decoded again: runs is a ReplacingMergeTree.
    if any(c[2] for c in checked):
        _add_ended_row(parts, ctx, run)
    return parts


def _add_ended_row(parts: dict[str, pa.Table], ctx: _Context, run: RunInfo) -> None:
    """Add the run's ``finished`` or ``failed`` row once every rank of its world has ended, whatever came
    first: a replay (or concurrent calls) can deliver ranks' ends before the registration that says
    how large the world is."""
    if not run.world_size or not all(r in run.exits for r in range(run.world_size)):
        return
    # Ranks past the world's end ran in an earlier, larger attempt: how they ended is history.
    ends = [run.exits[r] for r in range(run.world_size)]
    failed = any(why != EXIT_REASONS[0] for why, _ in ends)
    parts["runs"] = _runs_row(ctx, run, "failed" if failed else "finished", max(t for _, t in ends))


def _action(ctx: _Context, msg: telemetry_pb2.Action, registry: RunRegistry) -> dict[str, pa.Table]:
    if not msg.action:
        raise IngestError("action.action is empty: say what was decided or done")
    return {
        "actions": _table(
            "actions",
            {
                "run_id": [ctx.run_id], "time": [ctx.time("action.time_ns", msg.time_ns)], "action": [msg.action],
                "hosts": [list(msg.hosts)], "incident_id": [msg.incident_id], "reason": [msg.reason],
                "evidence": [msg.evidence_json],
            },
            ctx.attempt,
        )
    }


def _selfcheck(ctx: _Context, msg: telemetry_pb2.SelfCheck, registry: RunRegistry) -> dict[str, pa.Table]:
    if not msg.host:
        raise IngestError("selfcheck.host is empty: a self-check names the host it checked")
    n = len(msg.figures)
    return {
        "selfchecks": _table(
            "selfchecks",
            {
                "run_id": [ctx.run_id] * n, "host": [msg.host] * n, "time": [ctx.time("selfcheck.time_ns", msg.time_ns)] * n,
                "check": [f.check for f in msg.figures], "value": [f.value for f in msg.figures],
                "unit": [f.unit for f in msg.figures], "reference": [f.reference for f in msg.figures],
                "passed": [int(f.passed) for f in msg.figures], "host_passed": [int(msg.passed)] * n,
                "summary": [msg.summary] * n, "detail": [f.detail for f in msg.figures],
            },
        )
    }


# Payload field of Batch -> builder(context, payload message, registry) -> tables.
_PAYLOADS: dict[str, Callable[[_Context, Any, RunRegistry], dict[str, pa.Table]]] = {
    "register": _register,
    "registers": _registers,
    "spans": _spans,
    "collectives": _collectives,
    "heartbeats": _heartbeats,
    "metrics": _metrics,
    "step_metrics": _step_metrics,
    "stack": _stack,
    "end": _end,
    "ends": _ends,
    "action": _action,
    "selfcheck": _selfcheck,
}


def check_envelope(batch: ingest_pb2.Batch) -> str:
    """The payload kind of ``batch`` after checking its envelope; raises before any decoding."""
    if batch.schema_version != BATCH_SCHEMA_VERSION:
        raise UnsupportedSchemaVersion(
            f"schema_version {batch.schema_version} is not supported by this collector (it speaks"
            f" {BATCH_SCHEMA_VERSION}): upgrade the collector or run a matching agent"
        )
    if not batch.run_id:
        raise IngestError("run_id is empty: every batch names its run")
    if batch.rank < 0:
        raise IngestError(f"rank is {batch.rank}: ranks are >= 0")
    if len(batch.batch_id) != BATCH_ID_BYTES:
        raise IngestError(f"batch_id has {len(batch.batch_id)} bytes: it must have {BATCH_ID_BYTES}")
    kind = batch.WhichOneof("payload")
    if kind is None:
        raise IngestError(
            "the batch carries no payload (empty, or a payload type this collector does not know):"
            f" expected one of {', '.join(_PAYLOADS)}"
        )
    return kind


def decode(batch: ingest_pb2.Batch, registry: RunRegistry, now_ns: int, window: TimeWindow = TimeWindow()) -> Decoded:
    """The Arrow tables of ``batch``; raises IngestError or UnsupportedSchemaVersion.

    ``now_ns`` is the collector's clock when the batch arrived: it anchors the time window and
    stamps the versions of replaced rows (runs, ranks, groups).
    """
    kind = check_envelope(batch)
    ctx = _Context(batch, now_ns, window, kind)
    if kind not in RUN_LEVEL:
        ctx.attempt = registry.run(batch.run_id).attempt_of(batch)
    parts = _PAYLOADS[kind](ctx, getattr(batch, kind), registry)
    return Decoded(kind, parts, ctx.ranks or (() if kind in RUN_LEVEL else (batch.rank,)))
