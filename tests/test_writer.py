"""The batching writer on a real store: when it flushes, dedup, back-pressure, bad-batch isolation.

Runs on the same backends as tests/test_store.py (the embedded store, and a ClickHouse server
when RANKSCOPE_TEST_CLICKHOUSE_URL is set).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pytest
from test_store import NS_PER_DAY, T0, migrated, sample_rows, store  # noqa: F401 (fixtures)

from rankscope.collector.store.base import QueryError, Store, StoreError
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.migrations import migrate
from rankscope.collector.writer import BatchKey, Writer

T = TypeVar("T")
NEVER = 3600.0  # a flush interval that does not come within a test


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def key(n: int, run_id: str = "run-1", kind: str = "spans") -> BatchKey:
    return BatchKey(run_id, 0, n.to_bytes(16, "big"), kind)


def spans(n: int, run_id: str) -> dict[str, pa.Table]:
    return {"spans": sample_rows("spans", n, run_id=run_id)}


def counts(store: Store, table: str) -> dict[str, int]:
    rows = store.query_arrow(f"SELECT run_id, count() AS n FROM {store.database}.{table} GROUP BY run_id").to_pylist()
    return {r["run_id"]: r["n"] for r in rows}


def recorded(store: Store) -> list[tuple[str, bytes, str, int]]:
    rows = store.query_arrow(f"SELECT run_id, batch_id, kind, rows FROM {store.database}.batches ORDER BY run_id, batch_id")
    return [(r["run_id"], r["batch_id"], r["kind"], r["rows"]) for r in rows.to_pylist()]


def test_a_table_is_flushed_as_one_insert_once_it_holds_flush_rows(migrated: Store) -> None:
    async def scenario() -> tuple[list[bool], float, Writer]:
        writer = Writer(migrated, migrated.database, flush_rows=1000, flush_interval_s=NEVER)
        await writer.start()
        started = time.monotonic()
        done = await asyncio.gather(writer.write(spans(600, "a"), key(1)), writer.write(spans(600, "b"), key(2)))
        elapsed = time.monotonic() - started
        await writer.close()
        return done, elapsed, writer

    done, elapsed, writer = run(scenario())
    assert done == [True, True] and elapsed < 5
    assert counts(migrated, "spans") == {"a": 600, "b": 600}
    assert {t: n for t, n in writer.rows_written.items() if n} == {"spans": 1200, "batches": 2}
    assert {t: len(v) for t, v in writer.take_insert_latencies().items()} == {"spans": 1, "batches": 1}  # one insert each
    assert writer.take_insert_latencies() == {}  # taken
    assert writer.batches_written == 2 and writer.buffered_rows == 0
    assert recorded(migrated) == [("run-1", key(1).batch_id, "spans", 600), ("run-1", key(2).batch_id, "spans", 600)]


def test_a_small_table_is_flushed_when_its_oldest_row_is_flush_interval_old(migrated: Store) -> None:
    async def scenario() -> tuple[bool, float]:
        writer = Writer(migrated, migrated.database, flush_rows=10**9, flush_interval_s=0.3)
        await writer.start()
        started = time.monotonic()
        done = await writer.write(spans(5, "a"), key(1))
        elapsed = time.monotonic() - started
        await writer.close()
        return done, elapsed

    done, elapsed = run(scenario())
    assert done is True and 0.3 <= elapsed < 3
    assert counts(migrated, "spans") == {"a": 5}


def test_when_one_buffer_is_due_every_buffer_with_rows_shares_its_write_cycle(migrated: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    inserted: list[str] = []
    insert = migrated.insert_arrow
    monkeypatch.setattr(migrated, "insert_arrow", lambda table, rows, cycle=0: (inserted.append(table.split(".")[-1]), insert(table, rows, cycle=cycle))[1])

    async def scenario() -> Writer:
        writer = Writer(migrated, migrated.database, flush_rows=10**9, flush_interval_s=0.5)
        await writer.start()
        first = asyncio.create_task(writer.write(spans(7, "a"), key(1)))
        await asyncio.sleep(0.3)  # the heartbeats arrive when the spans are more than half-way due
        await asyncio.gather(first, writer.write({"heartbeats": sample_rows("heartbeats", 4, run_id="a")}, key(2)))
        await writer.close()
        return writer

    writer = run(scenario())
    assert counts(migrated, "heartbeats") == {"a": 4} and counts(migrated, "spans") == {"a": 7}
    # one cycle: one insert per table, and the two batch ids recorded by one insert
    assert {t: len(v) for t, v in writer.take_insert_latencies().items()} == {"heartbeats": 1, "spans": 1, "batches": 1}
    assert inserted == ["heartbeats", "spans", "batches"]  # who is alive and where it waits first, the timelines after


def test_the_event_loop_keeps_running_while_rows_are_inserted(migrated: Store) -> None:
    async def scenario() -> tuple[float, float]:
        writer = Writer(migrated, migrated.database, flush_rows=1, flush_interval_s=NEVER)
        await writer.start()
        write = asyncio.create_task(writer.write(spans(300_000, "a"), key(1)))
        longest, last = 0.0, time.monotonic()
        while not write.done():
            await asyncio.sleep(0.002)
            longest, last = max(longest, time.monotonic() - last), time.monotonic()
        await write
        (insert,) = writer.take_insert_latencies()["spans"]
        await writer.close()
        return longest, insert

    longest, insert = run(scenario())
    assert longest < insert / 2, f"the loop stalled {longest:.3f} s during a {insert:.3f} s insert"


def test_a_batch_sent_twice_is_stored_once(migrated: Store) -> None:
    async def scenario() -> tuple[list[bool], bool, Writer]:
        writer = Writer(migrated, migrated.database, flush_rows=10**9, flush_interval_s=0.1)
        await writer.start()
        concurrent = await asyncio.gather(writer.write(spans(7, "a"), key(1)), writer.write(spans(7, "a"), key(1)))
        again = await writer.write(spans(7, "a"), key(1))
        await writer.close()
        return concurrent, again, writer

    concurrent, again, writer = run(scenario())
    assert concurrent == [True, False]  # the second waited for the first, then reported a duplicate
    assert again is False
    assert writer.duplicates == 2 and writer.batches_written == 1
    assert counts(migrated, "spans") == {"a": 7}
    assert writer.stored == {"run-1": (1, 0)}  # what the live diagnosis sees: one batch of the run, no registration


def test_stored_counts_each_runs_batches_and_registrations(migrated: Store) -> None:
    async def scenario() -> Writer:
        writer = Writer(migrated, migrated.database, flush_rows=10**9, flush_interval_s=0.1)
        await writer.start()
        registration = {"runs": sample_rows("runs", 1, run_id="a"), "ranks": sample_rows("ranks", 1, run_id="a")}
        await asyncio.gather(writer.write(registration, key(1, "a-0", "register")), writer.write(spans(3, "a-0"), key(2, "a-0")),
                             writer.write(spans(3, "b"), key(3, "b")))  # fmt: skip
        await writer.close()
        return writer

    assert run(scenario()).stored == {"a-0": (2, 1), "b": (1, 0)}


def test_dedup_survives_a_restart_within_the_dedup_window(tmp_path: Path) -> None:
    path = tmp_path / "store"
    first = EmbeddedStore(path)
    migrate(first, first.database, None)

    async def write_once(store: Store, batch: BatchKey, window_h: float = 24.0) -> bool:
        writer = Writer(store, store.database, flush_interval_s=0.05, dedup_window_h=window_h)
        await writer.start()
        try:
            return await writer.write(spans(3, batch.run_id), batch)
        finally:
            await writer.close()

    assert run(write_once(first, key(1))) is True
    first.close()
    reopened = EmbeddedStore(path)
    try:
        assert run(write_once(reopened, key(1))) is False
        assert run(write_once(reopened, key(1, run_id="run-2"))) is True  # the same id in another run
        assert counts(reopened, "spans") == {"run-1": 3, "run-2": 3}
        # Ids older than the window are forgotten: a writer with a tiny window takes the batch again.
        assert run(write_once(reopened, key(1), window_h=1e-9)) is True
    finally:
        reopened.close()


def test_overloaded_while_more_than_max_buffered_rows_wait(migrated: Store) -> None:
    async def scenario() -> tuple[bool, int, bool, bool, bool]:
        writer = Writer(migrated, migrated.database, flush_rows=10**9, flush_interval_s=NEVER, max_buffered_rows=1000)
        await writer.start()
        small = asyncio.create_task(writer.write(spans(800, "a"), key(1)))
        await asyncio.sleep(0)
        below = writer.overloaded()
        big = asyncio.create_task(writer.write(spans(800, "b"), key(2)))
        await asyncio.sleep(0)
        buffered, above = writer.buffered_rows, writer.overloaded()
        await writer.close()  # writes everything buffered
        return below, buffered, above, await small and await big, writer.overloaded()

    below, buffered, above, written, after = run(scenario())
    assert (below, buffered, above) == (False, 1600, True)
    assert written is True and after is False
    assert counts(migrated, "spans") == {"a": 800, "b": 800}


def test_a_batch_with_a_wrongly_typed_column_fails_alone(migrated: Store) -> None:
    bad = sample_rows("spans", 10, run_id="bad")
    bad = bad.set_column(1, "rank", pa.array(["rank-zero"] * 10))

    async def scenario() -> tuple[list[object], bool, Writer]:
        writer = Writer(migrated, migrated.database, flush_rows=10**9, flush_interval_s=0.2)
        await writer.start()
        done = await asyncio.gather(
            writer.write(spans(10, "good-1"), key(1)),
            writer.write({"spans": bad}, key(2, run_id="bad")),
            writer.write(spans(10, "good-2"), key(3)),
            return_exceptions=True,
        )
        fixed = await writer.write(spans(10, "bad"), key(2, run_id="bad"))  # a failed id may come again
        await writer.close()
        return done, fixed, writer

    done, fixed, writer = run(scenario())
    assert done[0] is True and done[2] is True
    assert isinstance(done[1], QueryError) and "spans.rank: cannot store string as uint32" in str(done[1])
    assert fixed is True
    assert writer.batches_failed == 1 and writer.batches_written == 3
    assert counts(migrated, "spans") == {"good-1": 10, "good-2": 10, "bad": 10}


def test_a_batch_the_engine_refuses_fails_alone_after_a_retry_one_by_one(migrated: Store) -> None:
    # A rank with a broken clock: its rows fall on 101 different days, more partitions than
    # ClickHouse takes in one insert (max_partitions_per_insert_block = 100).
    broken = sample_rows("spans", 101, run_id="broken-clock")
    days = pa.array(T0 - np.arange(101) * NS_PER_DAY, pa.timestamp("ns", tz="UTC"))
    broken = broken.set_column(5, "start_time", days).set_column(6, "end_time", days)

    async def scenario() -> tuple[list[object], dict[str, list[float]]]:
        writer = Writer(migrated, migrated.database, flush_rows=10**9, flush_interval_s=0.2)
        await writer.start()
        done = await asyncio.gather(
            writer.write(spans(50, "good-1"), key(1)),
            writer.write({"spans": broken}, key(2)),
            writer.write(spans(50, "good-2"), key(3)),
            return_exceptions=True,
        )
        latencies = writer.take_insert_latencies()
        await writer.close()
        return done, latencies

    done, latencies = run(scenario())
    assert done[0] is True and done[2] is True
    assert isinstance(done[1], QueryError) and "Too many partitions" in str(done[1])
    assert len(latencies["spans"]) == 2  # the combined insert failed; the two good batches went in alone
    assert counts(migrated, "spans") == {"good-1": 50, "good-2": 50}
    assert [r[1] for r in recorded(migrated)] == [key(1).batch_id, key(3).batch_id]


def test_a_batch_over_several_tables_is_acknowledged_once_all_are_stored(migrated: Store) -> None:
    registration = {name: sample_rows(name, 2) for name in ("runs", "ranks", "groups")}

    async def scenario() -> tuple[bool, bool]:
        writer = Writer(migrated, migrated.database, flush_interval_s=0.05)
        await writer.start()
        done = await writer.write(registration, key(1, kind="register"))
        empty = await writer.write({"spans": sample_rows("spans", 0)}, key(2, kind="spans"))
        await writer.close()
        return done, empty

    assert run(scenario()) == (True, True)
    for name in ("runs", "ranks", "groups"):
        assert sum(counts(migrated, name).values()) == 2
    assert recorded(migrated) == [("run-1", key(1).batch_id, "register", 6), ("run-1", key(2).batch_id, "spans", 0)]


def test_close_writes_what_is_buffered_and_refuses_later_writes(migrated: Store) -> None:
    async def scenario() -> bool:
        writer = Writer(migrated, migrated.database, flush_rows=10**9, flush_interval_s=NEVER)
        with pytest.raises(StoreError, match="not running"):
            await writer.write(spans(1, "a"), key(1))
        await writer.start()
        with pytest.raises(StoreError, match="unknown table 'nope'"):
            await writer.write({"nope": pa.table({})}, key(3))
        pending = asyncio.create_task(writer.write(spans(9, "a"), key(1)))
        await asyncio.sleep(0)
        await writer.close()
        with pytest.raises(StoreError, match="not running"):
            await writer.write(spans(1, "a"), key(2))
        return await pending

    assert run(scenario()) is True
    assert counts(migrated, "spans") == {"a": 9}


def test_batch_ids_are_16_bytes() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        BatchKey("run", 0, b"short", "spans")


def _rolled_up(store: Store) -> list[dict[str, object]]:
    sql = (f"SELECT run_id, step, rank, sum(pieces) AS pieces FROM {store.database}.step_segments GROUP BY run_id, step, rank "
           "ORDER BY run_id, step, rank")
    return store.query_arrow(sql).to_pylist()


def test_rows_of_a_cycle_never_committed_are_rolled_back_with_their_rollups_at_start(migrated: Store) -> None:
    """A collector killed between a cycle's rows and its batch ids: the next writer removes those rows,
    from the tables, the projection and the rollups, and keeps every committed row; the batches sent
    again are then stored once."""
    async def first() -> int:
        writer = Writer(migrated, migrated.database, flush_interval_s=0.05)
        await writer.start()
        await writer.write({"spans": sample_rows("spans", 5, run_id="a"), "collectives": sample_rows("collectives", 5, run_id="a")}, key(1))
        await writer.close()
        return writer._cycle

    committed = run(first())
    before = _rolled_up(migrated)
    # the killed cycle: its rows went in, its ids did not (steps 1-3 again, so that the rollups would count them twice)
    for name in ("spans", "collectives", "heartbeats"):
        migrated.insert_arrow(f"{migrated.database}.{name}", sample_rows(name, 3, run_id="a"), cycle=committed + 1)
    migrated.insert_arrow(f"{migrated.database}.spans", sample_rows("spans", 4, run_id="b"), cycle=committed + 1)
    assert counts(migrated, "spans") == {"a": 8, "b": 4}

    async def second() -> bool:
        writer = Writer(migrated, migrated.database, flush_interval_s=0.05)
        await writer.start()
        again = await writer.write({"spans": sample_rows("spans", 4, run_id="b")}, key(2, run_id="b"))
        await writer.close()
        return again

    assert run(second()) is True
    assert counts(migrated, "spans") == {"a": 5, "b": 4} and counts(migrated, "collectives") == {"a": 5} and counts(migrated, "heartbeats") == {}
    by_seq = f"SELECT count() AS n FROM {migrated.database}.collectives WHERE run_id = 'a' AND group_name = 'tp[0]' AND seq <= 3"
    assert migrated.query_arrow(by_seq).to_pylist() == [{"n": 3}]  # the projection's answer (ordered by group, seq)
    entered = f"SELECT max(seq) AS seq, count() AS n FROM {migrated.database}.entered WHERE run_id = 'a'"
    assert migrated.query_arrow(entered).to_pylist()[0]["seq"] == 5
    assert _rolled_up(migrated) == before + [{"run_id": "b", "step": k + 1, "rank": k, "pieces": 1} for k in range(4)]
    assert migrated.query_arrow(f"SELECT count() AS n FROM {migrated.database}.rank_state").to_pylist() == [{"n": 0}]


def test_a_commit_that_fails_rolls_its_rows_back_and_fails_its_batches(migrated: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    insert = migrated.insert_arrow
    failures = [1]

    def flaky(table: str, rows: pa.Table, cycle: int = 0) -> None:
        if table.endswith(".batches") and failures:
            failures.pop()
            raise StoreError("the store went away")
        insert(table, rows, cycle=cycle)

    monkeypatch.setattr(migrated, "insert_arrow", flaky)

    async def scenario() -> tuple[object, bool]:
        writer = Writer(migrated, migrated.database, flush_interval_s=0.05)
        await writer.start()
        lost = await asyncio.gather(writer.write(spans(6, "a"), key(1)), return_exceptions=True)
        again = await writer.write(spans(6, "a"), key(1))  # the agent sends it again
        await writer.close()
        return lost[0], again

    lost, again = run(scenario())
    assert isinstance(lost, StoreError) and again is True
    assert counts(migrated, "spans") == {"a": 6} and len(recorded(migrated)) == 1


def test_a_refused_batch_whose_other_table_went_in_leaves_no_row(migrated: Store) -> None:
    """Its spans were stored before its collectives were refused: the cycle is rolled back (the spans'
    rollup too) and written again without it, so the agent's retry cannot store its spans twice."""
    broken = sample_rows("collectives", 101, run_id="broken-clock")
    days = pa.array(T0 - np.arange(101) * NS_PER_DAY, pa.timestamp("ns", tz="UTC"))
    broken = broken.set_column(broken.schema.get_field_index("issue_time"), "issue_time", days)

    async def scenario() -> list[object]:
        writer = Writer(migrated, migrated.database, flush_rows=10**9, flush_interval_s=0.2)
        await writer.start()
        done = await asyncio.gather(
            writer.write(spans(5, "good"), key(1)),
            writer.write({"spans": sample_rows("spans", 7, run_id="broken-clock"), "collectives": broken}, key(2)),
            return_exceptions=True,
        )
        await writer.close()
        return done

    done = run(scenario())
    assert done[0] is True and isinstance(done[1], QueryError)
    assert counts(migrated, "spans") == {"good": 5} and counts(migrated, "collectives") == {}
    assert [r["run_id"] for r in _rolled_up(migrated)] == ["good"] * 5
    assert [r[1] for r in recorded(migrated)] == [key(1).batch_id]
