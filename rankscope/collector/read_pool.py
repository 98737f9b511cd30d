"""The Query service's reads: threads of their own, a bounded number at once, each stopped when its caller gives up.

Reads once ran on the event loop's default executor, the one the ingest path's run look-ups use
too: six slow queries held all its threads (2 cores + 4), and a new run's first batch, which
reads what the store knows of its run, waited behind them past its deadline. Now reads run on
``max_running`` threads of their own; up to ``WAITING_PER_SLOT`` times as many more wait for a
thread (and stop waiting when their caller gives up); beyond that a read is refused at once
(``QueryBusy``). Each read also has the engine's own bounds (``query.engine_settings``:
memory, threads, time, result size).

Reads come after inserts for the CPU. Chiefly the engine's threads: they are where a read's time
goes. chDB runs reads and inserts at once (separate connections) and releases the GIL while it
works, so nothing queues an insert behind a read; but on a busy machine they share the
collector's slice of the CPU, and four CPU-bound reads took an insert from 62-98 ms to 221-322 ms
(median; two busy processes in other sessions). With the reads at nice 19, their threads in the
engine (``os_thread_priority``, ``Limits.nice``) and this pool's own, the insert took 47-105 ms.
The engine puts a thread it lowered back to nice 0 when the read ends, above the collector's own
priority (``rankscope collector --nice``, 10), so after each read the threads of the process below
its priority are brought back to it (``_renice``).

A caller that goes away (its deadline, Ctrl-C, a closed channel) cancels the call's task; the
read is then killed in the engine by its tag (``query.cancel_read``), again until its thread
returns, so its thread, slot and memory are free within moments instead of at its time limit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait

from prometheus_client import CollectorRegistry, Gauge

from rankscope.collector.query import Limits, QueryBusy, ReadOnlyGuard, cancel_read, run_read_only, to_reply
from rankscope.collector.store.base import Store, StoreError
from rankscope.common.processes import lower_threads

log = logging.getLogger(__name__)

#: reads that may wait for a thread, per thread
WAITING_PER_SLOT = 4
#: seconds between two kills of a cancelled read that has not returned yet
KILL_AGAIN_S = 0.5


class ReadPool:
    """Runs guarded reads of ``store`` under ``limits``, ``max_running`` at once; see the module docstring."""

    def __init__(self, store: Store, guard: ReadOnlyGuard, limits: Limits, max_running: int = 4):
        self._store = store
        self._guard = guard
        self._limits = limits
        self.max_running = max_running
        self.max_waiting = max_running * WAITING_PER_SLOT
        self._threads = ThreadPoolExecutor(
            max_workers=max_running, thread_name_prefix="rankscope-query", initializer=_renice, initargs=(limits.nice,)
        )
        self._killer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rankscope-query-kill")
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0

    async def read(
        self, sql: str, params: Mapping[str, object], max_rows: int = 0, within_s: float | None = None, started_s: float | None = None
    ) -> bytes:
        """The Query service's reply to ``sql``, serialised (``query.to_reply``; ``started_s``: when the
        call came, by ``time.perf_counter``, for its elapsed time); the guard's and the limits' errors
        (QueryRefused, ResultTooLarge), QueryBusy when too many reads wait already, StoreError."""
        started_s = time.perf_counter() if started_s is None else started_s
        if self._slots.locked() and self.waiting >= self.max_waiting:
            raise QueryBusy(
                f"collector busy: {self.running} queries run and {self.waiting} wait, the most it takes;"
                " retry in a few seconds"
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        tag = f"rankscope-read-{uuid.uuid4().hex}"
        done = self._threads.submit(self._read, tag, sql, params, max_rows, within_s, started_s)
        done.add_done_callback(self._released(asyncio.get_running_loop()))
        try:
            return await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self._killer.submit(self._kill, tag, done)
            raise

    def close(self) -> None:
        """Wait for the reads in flight (their callers are gone or answered by now) and end the threads."""
        self._threads.shutdown(wait=True)
        self._killer.shutdown(wait=True)

    def export(self, registry: CollectorRegistry) -> None:
        """Gauges of the reads running and waiting, on ``registry`` (the collector's /metrics)."""
        Gauge("rankscope_queries_running", "Queries running in the store now.", registry=registry).set_function(lambda: self.running)
        Gauge("rankscope_queries_waiting", "Queries waiting for a query thread.", registry=registry).set_function(lambda: self.waiting)

    def _released(self, loop: asyncio.AbstractEventLoop) -> Callable[[Future[bytes]], None]:
        """A callback that frees the read's slot on the loop once its thread has returned, not before:
        the slots count the reads in the engine, cancelled ones included."""

        def release(_: Future[bytes]) -> None:
            loop.call_soon_threadsafe(self._release)

        return release

    def _release(self) -> None:
        self.running -= 1
        self._slots.release()

    def _read(
        self, tag: str, sql: str, params: Mapping[str, object], max_rows: int, within_s: float | None, started_s: float
    ) -> bytes:
        try:
            table = run_read_only(self._store, self._guard, sql, params, self._limits, max_rows, tag=tag, within_s=within_s)
        finally:
            _renice(self._limits.nice)
        return to_reply(table, time.perf_counter() - started_s)

    def _kill(self, tag: str, read: Future[bytes]) -> None:
        """Kill the read until its thread returns: a read that has not reached the engine yet is not in its list."""
        while not read.done():
            try:
                cancel_read(self._store, tag)
            except StoreError as e:
                log.warning("could not stop an abandoned query: %s", e)
                return
            wait([read], timeout=KILL_AGAIN_S)


def _renice(nice: int) -> None:
    """This thread at ``nice``, and every thread of the process below the process's own priority
    (the engine's, reset to 0 after a read) back to it."""
    lower_threads(os.getpriority(os.PRIO_PROCESS, os.getpid()))
    lower_threads(nice, [threading.get_native_id()])
