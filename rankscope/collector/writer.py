"""The collector's batching writer: many small agent batches in, few large inserts out.

ClickHouse wants about one insert per table per second of thousands to 100k rows, while agents
send a batch of a few thousand rows per rank every so often. The writer keeps one buffer per
table and inserts it as one Arrow table when it holds ``flush_rows`` rows or its oldest row is
``flush_interval_s`` old, together with every other buffer that holds rows: a batch's rows all go
in one flush cycle. A batch is acknowledged (``write`` returns) only once all its rows are stored;
its id then goes into the ``batches`` table, after the data and in the same flush cycle, so a batch
that an agent sends again (after a lost acknowledgement, or to a restarted collector) is recognised
and not stored twice. A relay's batch (``parts``) holds its ranks' batches: their ids go into
``batches`` beside its own, in the same insert, so a part that its rank sends again itself after
the relay died is acknowledged as stored; and a relay's batch whose part was stored first is told
so (``PartsStored``) before anything of it is written, so the caller can leave that part out.

Exactly once, also across a kill at any moment: every row carries its flush cycle, and the cycle's
batch ids are its commit (``store/cycles.py``). A starting writer first rolls back the rows of
cycles never committed; a commit that fails rolls its cycle back at once, and its batches fail
(the agents send them again). A batch the engine refuses fails alone: a refused combined insert is
retried one batch at a time, and when the refused batch's other tables' rows were stored, the
cycle is rolled back and written again without it.

Within a cycle the tables that say who is alive and where it waits (heartbeats, ends,
registrations) go in before the bulk timelines (``BULK``: spans, collectives, metrics), so that a
cycle that carries a full-detail step does not hold back the reports a hang is named from.

Store calls block, so they run in one worker thread and never on the event loop; buffers and
futures are only touched on the event loop, and the worker only sees what it was handed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa

from rankscope.collector.decode import REGISTRATIONS
from rankscope.collector.store import cycles
from rankscope.collector.store.base import QueryError, Store, StoreError, arrow_schema, conform, table_spec
from rankscope.collector.store.schema import BY_NAME

log = logging.getLogger(__name__)

#: latency samples kept per table between two take_insert_latencies() calls
LATENCY_SAMPLES = 4096
#: default age at which buffers are written: an insert costs chDB about the same however few its
#: rows, and where the collector shares the job's machine that CPU is the job's
FLUSH_INTERVAL_S = 2.0
#: the timelines: most of the rows, inserted last in a cycle
BULK = frozenset({"spans", "collectives", "metrics"})


@dataclass(frozen=True)
class BatchKey:
    """Identifies one agent batch: the run and rank it came from and its 16-byte id."""

    run_id: str
    rank: int
    batch_id: bytes
    kind: str

    def __post_init__(self) -> None:
        if len(self.batch_id) != 16:
            raise ValueError(f"batch_id must be 16 bytes, got {len(self.batch_id)}")


class PartsStored(Exception):
    """Some parts of a relay's batch were stored before (their rank sent them itself)."""

    def __init__(self, stored: frozenset[bytes]) -> None:
        super().__init__(f"{len(stored)} parts stored before")
        self.stored = stored


@dataclass(eq=False)
class _Pending:
    """A batch between write() and its acknowledgement."""

    key: BatchKey
    future: asyncio.Future[None]
    rows: int
    received_ns: int
    error: StoreError | None = None
    stored: int = 0  # parts (tables) inserted in the cycle being written
    parts: tuple[BatchKey, ...] = ()  # a relay's batch: its ranks' batches, recorded with it


@dataclass
class _Buffer:
    parts: list[tuple[_Pending, pa.Table]] = field(default_factory=list)
    rows: int = 0
    since: float = 0.0  # time.monotonic() of the oldest part


class Writer:
    """Buffers Arrow rows per table and writes them in large inserts; see the module doc."""

    def __init__(
        self,
        store: Store,
        database: str,
        *,
        flush_rows: int = 50_000,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        max_buffered_rows: int = 2_000_000,
        dedup_window_h: float = 24.0,
    ):
        self.store = store
        self.database = database
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.max_buffered_rows = max_buffered_rows
        self.dedup_window_s = dedup_window_h * 3600.0
        # Published as metrics by the server. Every table has its entry from the start, so that
        # another thread can iterate these dicts while the worker updates them.
        self.rows_written: dict[str, int] = dict.fromkeys(BY_NAME, 0)
        self.batches_written = 0
        self.batches_failed = 0
        self.duplicates = 0
        # run -> (batches of it stored so far, registrations among them): what lets the live
        # diagnosis skip a run with nothing new and keep its topology until a rank registers
        self.stored: dict[str, tuple[int, int]] = {}
        self._latencies: dict[str, deque[float]] = {name: deque(maxlen=LATENCY_SAMPLES) for name in BY_NAME}
        self._buffered_rows = 0
        self._buffers: dict[str, _Buffer] = {}
        self._ready: list[_Pending] = []  # batches without rows: only their record is left to write
        self._inflight: dict[tuple[str, bytes], _Pending] = {}
        self._written: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # id -> wall time, oldest first
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rankscope-writer")
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._cycle = 0  # the last flush cycle begun (worker thread)
        self._committed = 0  # the last committed, as the store said when last rolled back
        self._roll_back_due = False  # a commit failed and its rollback too: roll back before the next cycle

    @property
    def buffered_rows(self) -> int:
        """Rows accepted and not yet acknowledged (buffered or being inserted)."""
        return self._buffered_rows

    def overloaded(self) -> bool:
        """True while more than max_buffered_rows wait: refuse new batches (RESOURCE_EXHAUSTED) then."""
        return self._buffered_rows > self.max_buffered_rows

    def take_insert_latencies(self) -> dict[str, list[float]]:
        """Insert durations in seconds since the last call, for the tables that had inserts (for a histogram)."""
        return {table: [samples.popleft() for _ in range(len(samples))] for table, samples in self._latencies.items() if samples}

    async def start(self) -> None:
        """Roll back what a killed collector left uncommitted, load the ids written within the dedup
        window (dedup survives restarts); start flushing."""
        if self._task is not None or self._closed:
            raise StoreError("a writer starts once")
        loop = asyncio.get_running_loop()
        self._committed, _ = await loop.run_in_executor(self._executor, cycles.roll_back, self.store, self.database)
        self._cycle = self._committed
        since_ns = time.time_ns() - int(self.dedup_window_s * 1e9)
        rows = await loop.run_in_executor(self._executor, self._load_written, since_ns)
        for row in rows.to_pylist():
            self._written[(row["run_id"], row["batch_id"])] = row["received_ns"] / 1e9
        self._task = asyncio.create_task(self._flusher(), name="rankscope-writer-flusher")

    async def write(self, parts: Mapping[str, pa.Table], key: BatchKey, held: tuple[BatchKey, ...] = ()) -> bool:
        """Store one batch: True once all its rows are written, False for an id already written.

        ``parts`` maps table names to rows (the table's insert columns). A batch whose id is
        being written right now waits for that write and answers like it. Raises StoreError
        when its rows could not be written. ``held``: the ranks' batches a relay's batch holds
        (recorded with it); raises PartsStored, writing nothing, when some were stored before.
        """
        if self._task is None or self._closed:
            raise StoreError("the writer is not running (start() it, and do not use it after close())")
        ident = (key.run_id, key.batch_id)
        if ident in self._written:
            self.duplicates += 1
            return False
        if ident in self._inflight:
            self.duplicates += 1
            await asyncio.shield(self._inflight[ident].future)
            return False
        held_ids = [(k.run_id, k.batch_id) for k in held]
        if busy := [self._inflight[i].future for i in held_ids if i in self._inflight]:
            await asyncio.wait(busy)  # a part its rank sent itself, being written: once stored or not, decide again
            return await self.write(parts, key, held)
        if stored := frozenset(i[1] for i in held_ids if i in self._written):
            raise PartsStored(stored)
        for name in parts:
            table_spec(name)  # an unknown table fails here, not in a flush
        nonempty = {name: rows for name, rows in parts.items() if rows.num_rows}
        pending = _Pending(
            key=key,
            future=asyncio.get_running_loop().create_future(),
            rows=sum(rows.num_rows for rows in nonempty.values()),
            received_ns=time.time_ns(),
            parts=held,
        )
        for i in (ident, *held_ids):
            self._inflight[i] = pending
        self._buffered_rows += pending.rows
        if not nonempty:
            self._ready.append(pending)
            self._wake.set()
        for name, rows in nonempty.items():
            buffer = self._buffers.setdefault(name, _Buffer())
            if not buffer.parts:
                buffer.since = time.monotonic()
                self._wake.set()  # the flusher's next deadline may now be sooner
            buffer.parts.append((pending, rows))
            buffer.rows += rows.num_rows
            if buffer.rows >= self.flush_rows:
                self._wake.set()
        await asyncio.shield(pending.future)
        return True

    async def close(self) -> None:
        """Write everything buffered, then stop (on SIGTERM). Later writes raise StoreError."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    # --- event loop side -------------------------------------------------------------------

    async def _flusher(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._closed:
                try:
                    await asyncio.wait_for(self._wake.wait(), self._next_deadline())
                except asyncio.TimeoutError:
                    pass
            self._wake.clear()
            due, ready = self._take_due(force=self._closed)
            if not due and not ready:
                if self._closed:
                    return
                continue
            completed = await loop.run_in_executor(self._executor, self._write_cycle, due, ready)
            self._settle(completed)

    def _next_deadline(self) -> float | None:
        """Seconds until the oldest buffer is due; None when there is nothing to wait for."""
        if self._ready:
            return 0.0
        starts = [b.since for b in self._buffers.values() if b.parts]
        if not starts:
            return None
        return max(0.0, min(starts) + self.flush_interval_s - time.monotonic())

    def _take_due(self, force: bool) -> tuple[dict[str, list[tuple[_Pending, pa.Table]]], list[_Pending]]:
        """The buffers to insert now: when one is full or old enough, every buffer with rows, so the
        tables share one write cycle (and one ``batches`` insert) per interval instead of each
        starting its own (an insert's cost hardly depends on its size), and a batch's rows are
        committed by one cycle."""
        now = time.monotonic()
        filled = {name: buffer for name, buffer in self._buffers.items() if buffer.parts}
        due = {}
        if force or any(now - b.since >= self.flush_interval_s or b.rows >= self.flush_rows for b in filled.values()):
            due = {name: buffer.parts for name, buffer in filled.items()}
            self._buffers = {}
        ready, self._ready = self._ready, []
        return due, ready

    def _settle(self, completed: list[_Pending]) -> None:
        """Answer the writers of the batches whose every part went through an insert attempt."""
        now = time.time()
        for pending in completed:
            idents = [(k.run_id, k.batch_id) for k in (pending.key, *pending.parts)]
            for ident in idents:
                del self._inflight[ident]
            self._buffered_rows -= pending.rows
            if pending.error is None:
                self._written.update(dict.fromkeys(idents, now))
                self.batches_written += 1
                batches, registrations = self.stored.get(pending.key.run_id, (0, 0))
                self.stored[pending.key.run_id] = (batches + 1, registrations + (pending.key.kind in REGISTRATIONS))
                pending.future.set_result(None)
            else:
                self.batches_failed += 1
                pending.future.set_exception(pending.error)
        horizon = now - self.dedup_window_s
        while self._written and next(iter(self._written.values())) < horizon:
            self._written.popitem(last=False)

    # --- worker thread side ----------------------------------------------------------------

    def _load_written(self, since_ns: int) -> pa.Table:
        return self.store.query_arrow(
            f"SELECT run_id, batch_id, toUnixTimestamp64Nano(received) AS received_ns FROM {self.database}.batches "
            "WHERE received >= fromUnixTimestamp64Nano({since:Int64}) ORDER BY received",
            {"since": since_ns},
        )

    def _write_cycle(self, due: dict[str, list[tuple[_Pending, pa.Table]]], ready: list[_Pending]) -> list[_Pending]:
        """Write the due tables and the ready batches in a new cycle, committed by their ids; returns
        every batch of it. When a refused batch's other rows are in, the cycle is rolled back and
        written again without it (once: a second such failure fails them all)."""
        batches = list(dict.fromkeys([*ready, *(pending for parts in due.values() for pending, _ in parts)]))
        if self._roll_back_due and not self._roll_back(batches):
            return batches
        for again in (False, True):
            writing = [p for p in batches if p.error is None]
            refused = self._try_cycle({name: [(p, rows) for p, rows in parts if p.error is None] for name, parts in due.items()}, writing)
            if not refused or not self._roll_back(writing):
                break
            if again:
                for pending in writing:
                    pending.error = pending.error or refused[0].error
        return batches

    def _try_cycle(self, due: dict[str, list[tuple[_Pending, pa.Table]]], writing: list[_Pending]) -> list[_Pending]:
        """Insert ``due`` as a new cycle, then commit the ids of ``writing`` that all went in; returns
        the refused batches whose other rows were stored (the cycle is then left uncommitted)."""
        self._cycle += 1
        cycle = self._cycle
        for pending in writing:
            pending.stored = 0
        for name, parts in sorted(due.items(), key=lambda item: item[0] in BULK):
            for pending, error in self._insert_parts(name, parts, cycle):
                if error is None:
                    pending.stored += 1
                else:
                    pending.error = pending.error or error
        refused = [p for p in writing if p.error is not None and p.stored]
        stored = [p for p in writing if p.error is None]
        if refused or not stored:
            return refused
        try:
            self._insert("batches", self._records(stored), cycle)
        except StoreError as e:
            log.warning("could not record %d batch ids, rolling their rows back: %s", len(stored), e)
            for pending in stored:
                pending.error = e
            if self._roll_back(stored) and self._committed >= cycle:  # the commit went in after all
                for pending in stored:
                    pending.error = None
        return []

    def _roll_back(self, batches: list[_Pending]) -> bool:
        """Roll back every uncommitted cycle; False (and ``batches`` failed) when the store cannot,
        which is tried again before the next cycle."""
        try:
            self._committed, _ = cycles.roll_back(self.store, self.database)
        except StoreError as e:
            log.warning("could not roll back uncommitted rows (tried again before the next write): %s", e)
            self._roll_back_due = True
            for pending in batches:
                pending.error = pending.error or e
            return False
        self._roll_back_due = False
        return True

    def _insert_parts(self, name: str, parts: list[tuple[_Pending, pa.Table]], cycle: int) -> list[tuple[_Pending, StoreError | None]]:
        """One insert for all parts; if the engine refuses it, one per part, so only bad ones fail."""
        spec = table_spec(name)
        results: list[tuple[_Pending, StoreError | None]] = []
        good: list[tuple[_Pending, pa.Table]] = []
        for pending, rows in parts:
            try:
                good.append((pending, conform(spec, rows)))
            except QueryError as e:
                results.append((pending, e))
        if not good:
            return results
        try:
            self._insert(name, pa.concat_tables([rows for _, rows in good]), cycle)
            return results + [(pending, None) for pending, _ in good]
        except QueryError as e:
            refused = e
        except StoreError as e:  # the store itself failed (unreachable, closed): no part can do better
            return results + [(pending, e) for pending, _ in good]
        if len(good) == 1:
            return results + [(good[0][0], refused)]
        for pending, rows in good:
            try:
                self._insert(name, rows, cycle)
                results.append((pending, None))
            except StoreError as e:
                results.append((pending, e))
        return results

    def _insert(self, name: str, rows: pa.Table, cycle: int) -> None:
        started = time.perf_counter()
        self.store.insert_arrow(f"{self.database}.{name}", rows, cycle=cycle)
        self._latencies[name].append(time.perf_counter() - started)
        self.rows_written[name] += rows.num_rows

    def _records(self, stored: list[_Pending]) -> pa.Table:
        """The ``batches`` rows for these batches, and for the ranks' batches they hold (rows 0:
        theirs are counted in the batch that holds them)."""
        records = [(k, p.rows if k is p.key else 0, p.received_ns) for p in stored for k in (p.key, *p.parts)]
        return pa.table(
            {
                "run_id": [k.run_id for k, _, _ in records],
                "rank": [k.rank for k, _, _ in records],
                "batch_id": [k.batch_id for k, _, _ in records],
                "kind": [k.kind for k, _, _ in records],
                "rows": [rows for _, rows, _ in records],
                "received": [received for _, _, received in records],
            },
            schema=arrow_schema(BY_NAME["batches"]),
        )
