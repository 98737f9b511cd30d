"""What one simulation is: the job, its faults, and how much of it is sent, how often.

The collector's limit at scale is batches: a batch costs the collector about a millisecond of CPU
whatever its size, and is acknowledged only once written. So the simulator's batches speak for up
to ``ranks_per_batch`` ranks each (rows name their rank), and the cadence is derived from a budget
of batches per second (``Cadence.for_world``): each rank beats every ``heartbeat_s`` and sends its
recorded steps every ``flush_s``; a rank that has made no progress for ``report_after_s`` beats at
once, so the state of a hung job reaches the collector within seconds whatever the heartbeat
interval.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from rankscope.harness.simulate.step_model import StepModel, Timing
from rankscope.harness.simulate.topology import Topology
from rankscope.common.fault_spec import Fault

#: fault kinds the simulator plays (the trainer's grammar has more)
SUPPORTED = ("straggler", "hang", "crash")
#: heartbeats a second over all ranks, at most, by default: a heartbeat is decoded row by row (its
#: in-flight lists), and at 100,000 ranks more would take most of one collector's interpreter
BEATS_PER_S = 10_000


@dataclass(frozen=True)
class Cadence:
    """How often each simulated rank talks to the collector, and how much it says."""

    heartbeat_s: float
    flush_s: float
    #: every n-th step (and the first) is recorded in full; the others as per-rank summaries
    sample_every: int = 10
    report_after_s: float = 5.0
    #: a heartbeat says "stalled" after this long without progress (the agent's RANKSCOPE_STALL_S)
    stall_s: float = 20.0
    #: ranks one batch speaks for (a heartbeat batch, a flush's span or collective batch)
    ranks_per_batch: int = 256

    @classmethod
    def for_world(
        cls, world_size: int, batches_per_s: float, heartbeat_s: float | None = None, flush_s: float | None = None,
        ranks_per_batch: int = 256, **rest: Any,
    ) -> Cadence:
        """A heartbeat every ``heartbeat_s`` (by default 2 s at least, two heartbeat batches' worth of the
        budget per rank: 2 * world / ranks_per_batch / batches_per_s, and no more than ``BEATS_PER_S``
        heartbeats a second in all) and a flush every ``flush_s`` (by default every other heartbeat);
        ``rest``: the other fields."""
        batches = -(-world_size // ranks_per_batch)
        heartbeat = heartbeat_s or max(2.0, 2 * batches / batches_per_s, world_size / BEATS_PER_S)
        return cls(heartbeat_s=heartbeat, flush_s=flush_s or 2 * heartbeat, ranks_per_batch=ranks_per_batch, **rest)

    def batches_per_s(self, world_size: int, reporters: int) -> float:
        """Steady-state batches per second (heartbeats, spans, collectives, step scalars of the reporters)."""
        batches, reporting = -(-world_size // self.ranks_per_batch), -(-reporters // self.ranks_per_batch)
        return batches / self.heartbeat_s + (2 * batches + reporting) / self.flush_s


@dataclass(frozen=True)
class Plan:
    """Everything a worker process needs (picklable, no torch)."""

    topo: Topology
    run_id: str
    run_name: str
    collector: str
    spool_dir: str
    steps: int
    step_time_s: float
    microbatches: int
    seed: int
    noise: float
    faults: tuple[Fault, ...]
    cadence: Cadence
    #: after a hang, heartbeats go on this long before the launcher stops every rank
    hold_s: float
    #: "direct": each worker's Transport sends to the collector; "relay": through a relay process per
    #: worker (``rankscope relay``), a host's ranks to a batch, as a real job's ranks do
    via: str = "direct"

    def model(self) -> StepModel:
        timing = Timing.for_step(self.step_time_s, self.topo.pp, self.microbatches, self.noise)
        stragglers = [(f.rank, f.from_step, f.factor) for f in self.faults if f.kind == "straggler"]
        return StepModel(self.topo, timing, self.microbatches, self.seed, stragglers)

    @property
    def stop(self) -> Fault | None:
        """The hang or crash, if one is injected (at most one)."""
        return next((f for f in self.faults if f.kind in ("hang", "crash")), None)

    def config_json(self) -> str:
        """What the run's ``runs.config`` says about the simulation."""
        topo = self.topo
        return json.dumps({
            "simulated": True, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "steps": self.steps,
            "step_time_s": self.step_time_s, "microbatches": self.microbatches, "seed": self.seed,
            "inject": [asdict(f) for f in self.faults], "cadence": asdict(self.cadence),
        })  # fmt: skip
