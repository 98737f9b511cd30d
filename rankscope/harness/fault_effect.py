"""How much an injected slowdown slowed its job, read from the store. A fault that slowed nothing leaves
nothing for a detector to find: a CPU quota above what a host's ranks got anyway on shared cores (campaign
seeds 1097788339, 1854299062: a host cut 1.12x and 1.64x beside a second job, no incident live or offline).
The campaign records the figure beside each trial so that such a miss is told from a detector's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rankscope.collector.compare import CompareError, Side, step_time_s

if TYPE_CHECKING:
    from rankscope.collector.diagnosis.context import Query

#: the fault lands a step or so after the store shows its step (the store hears of a step late under
#: load), so the steps after it are counted from this many steps on, where when it landed is not known
LANDS_WITHIN_STEPS = 2
#: the first step the job began after ``at`` (the collector's clock, this machine's): a fault set from
#: outside lands when the store shows its step and after a measurement, steps later on a job of short
#: steps (campaign seeds 1143207437, 955132934: jobs of 21 steps of 0.1-0.25 s that a CPU cut "at step 5"
#: did not slow)
LANDED_SQL = (
    "SELECT min(step) AS step FROM (SELECT step, min(start_time) AS began FROM spans WHERE run_id = {run:String} AND step > 0 "
    "GROUP BY step) WHERE began >= fromUnixTimestamp64Nano({at:Int64})"
)
_LAST = 2**32 - 1
#: the incident kinds whose faults slow a job that goes on (a hang or a crash stops it)
SLOWDOWNS = ("straggler", "slow_link")


def landed_step(query: Query, run_id: str, at_ns: int) -> int | None:
    """The first step ``run_id`` began after ``at_ns`` (None: none did, the fault landed after the job)."""
    step = query(LANDED_SQL, {"run": run_id, "at": at_ns}).to_pylist()[0]["step"]
    return int(step) if step else None


def slowdown(query: Query, run_id: str, fault_step: int, landed: int | None = None) -> float | None:
    """The job's median step time from the step the fault ``landed`` in (else ``fault_step`` +
    LANDS_WITHIN_STEPS) on, over its median before ``fault_step`` (step 1, the warm-up, left out); None
    where either side has no completed step."""
    if fault_step < 3:
        return None
    try:
        before = step_time_s(query, Side(run_id, 2, fault_step - 1))
        after = step_time_s(query, Side(run_id, landed or fault_step + LANDS_WITHIN_STEPS, _LAST))
    except CompareError:
        return None
    return round(after / before, 3) if before > 0 else None
