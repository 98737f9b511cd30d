"""How far a run got, as its collector heard it (the ranks' heartbeats).

A fault meant for "step N" waits on this rather than on a sleep that a slow machine outruns: the
test bed's ``fault --at-step``, the test-bed scenarios and the healing drills.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from rankscope.collector.client import QueryBusy, Reader, Unreachable

STEP_SQL = "SELECT max(step) AS step FROM heartbeats WHERE run_id = {run:String}"
#: the run heard from last among those heard since a moment: the job a command started beside it
NEWEST_RUN_SQL = (
    "SELECT run_id, max(step) AS step FROM heartbeats WHERE time >= fromUnixTimestamp64Nano({since:Int64}) "
    "GROUP BY run_id ORDER BY max(time) DESC LIMIT 1"
)


def reached(reader: Reader, step: int, *, run_id: str | None = None, since_ns: int = 0) -> str | None:
    """The run (``run_id``, or the newest heard since ``since_ns``) if it has reached ``step``, else None."""
    if run_id is not None:
        rows = reader.query(STEP_SQL, {"run": run_id}).to_pylist()
        return run_id if rows and (rows[0]["step"] or 0) >= step else None
    rows = reader.query(NEWEST_RUN_SQL, {"since": since_ns}).to_pylist()
    return rows[0]["run_id"] if rows and rows[0]["step"] >= step else None


def wait_for_step(
    reader: Reader, step: int, *, run_id: str | None = None, since_ns: int = 0, stop: Callable[[], bool] = lambda: False,
    timeout_s: float = math.inf, poll_s: float = 0.25,
) -> str | None:  # fmt: skip
    """Block until the run reaches ``step``: its id, or None once ``stop()`` says to give up (the job
    ended). A collector not up yet or busy is asked again; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not stop():
        try:
            found = reached(reader, step, run_id=run_id, since_ns=since_ns)
        except (Unreachable, QueryBusy):
            found = None
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{run_id or 'no run heard since the wait began'} did not reach step {step} in {timeout_s:.0f} s")
        time.sleep(poll_s)
    return None
