"""Simulated ranks' telemetry as the agent's own wire messages (telemetry.proto).

The columns come from ``rows`` already as numpy arrays; here they only become the packed
little-endian ``bytes`` fields of a batch. A data batch speaks for several ranks at once (its
``rank`` column, heartbeats, registrations and ends their ``ranks``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import rankscope
from rankscope.agent.heartbeat import IN_FLIGHT_LIMIT  # what the agent's heartbeat lists, oldest first
from rankscope.harness.simulate.freeze import Flight
from rankscope.harness.simulate.rows import BF16, OP_NAMES, SPAN_KINDS, SPAN_NAMES, STEP_METRICS
from rankscope.harness.simulate.topology import GROUP_KINDS, Topology
from rankscope.protos.v1 import telemetry_pb2 as pb


def register(topo: Topology, rank: int, *, run_name: str, config_json: str, start_ns: int, pid: int) -> pb.Register:
    tp, pp, dp = (int(c) for c in topo.coords[rank])
    groups = [pb.Group(name=name, description=f"{kind} group (simulated)", ranks=topo.groups[name])
              for kind, name in zip(GROUP_KINDS, topo.group_names(rank))]  # fmt: skip
    local = rank % topo.ranks_per_host
    return pb.Register(
        world_size=topo.world_size, host=topo.host(rank), pid=pid, local_rank=local, device=f"cuda:{local} (simulated)",
        tp=topo.tp, pp=topo.pp, dp=topo.dp, tp_rank=tp, pp_rank=pp, dp_rank=dp, groups=groups, run_name=run_name,
        config_json=config_json, start_time_ns=start_ns, agent_version=f"{rankscope.__version__} (simulate)",
    )  # fmt: skip


def spans(ranks: np.ndarray, cols: dict[str, np.ndarray]) -> pb.SpanBatch:
    """One batch of the rows of several ranks (``ranks``: each row's)."""
    n = len(cols["name"])
    return pb.SpanBatch(
        count=n, strings=SPAN_NAMES, name=cols["name"].astype("<i4").tobytes(),
        kind=SPAN_KINDS[cols["name"]].tobytes(), step=cols["step"].astype("<i4").tobytes(),
        microbatch=cols["microbatch"].astype("<i4").tobytes(), start_ns=cols["start_ns"].astype("<i8").tobytes(),
        end_ns=cols["end_ns"].astype("<i8").tobytes(), attributes=np.full(n, -1, "<i4").tobytes(),
        rank=ranks.astype("<i4").tobytes(),
    )  # fmt: skip


def collectives(topo: Topology, ranks: np.ndarray, cols: dict[str, np.ndarray]) -> pb.CollectiveBatch:
    """One batch of the rows of several ranks (``ranks``: each row's). ``rows`` indexes a rank's own
    three groups, then ``OP_NAMES``; here the string table holds the groups of every rank of the
    batch (three each, in rank order), then ``OP_NAMES``, and the indices are moved to match."""
    n = len(cols["seq"])
    present = np.unique(ranks)
    groups = len(GROUP_KINDS)
    names = [name for r in present for name in topo.group_names(int(r))]
    group = groups * np.searchsorted(present, ranks) + cols["group"]
    shift = len(names) - groups  # OP_NAMES came after one rank's groups; now after all of them
    issue = cols["issue_ns"].astype("<i8").tobytes()
    return pb.CollectiveBatch(
        count=n, strings=[*names, *OP_NAMES], group=group.astype("<i4").tobytes(),
        seq=cols["seq"].astype("<i8").tobytes(), op=(cols["op"] + shift).astype("<i4").tobytes(),
        nbytes=cols["nbytes"].astype("<i8").tobytes(), dtype=np.full(n, BF16 + shift, "<i4").tobytes(),
        peer=cols["peer"].astype("<i4").tobytes(), issue_ns=issue, start_ns=issue,
        end_ns=cols["end_ns"].astype("<i8").tobytes(), state=np.zeros(n, "u1").tobytes(),
        step=cols["step"].astype("<i4").tobytes(), rank=ranks.astype("<i4").tobytes(),
    )  # fmt: skip


def step_metrics(ranks: np.ndarray, steps: np.ndarray, values: np.ndarray, times: np.ndarray) -> pb.StepMetricBatch:
    """``values``: (rows, len(STEP_METRICS)), one row per (rank, step); ``ranks``, ``steps``, ``times``: (rows,)."""
    rows, names = values.shape
    return pb.StepMetricBatch(
        count=rows * names, strings=STEP_METRICS, step=np.repeat(steps, names).astype("<i4").tobytes(),
        name=np.tile(np.arange(names), rows).astype("<i4").tobytes(), value=values.astype("<f8").tobytes(),
        time_ns=np.repeat(times, names).astype("<i8").tobytes(), rank=np.repeat(ranks, names).astype("<i4").tobytes(),
    )  # fmt: skip


def heartbeat(
    topo: Topology, rank: int, *, time_ns: int, step: int, phase: str, stalled: bool, last_progress_ns: int,
    in_flight: Sequence[Flight] = (),
) -> pb.Heartbeat:
    names = [*topo.group_names(rank), *OP_NAMES]
    flights = [
        pb.InFlight(group=names[f.group], seq=f.seq, op=names[f.op], peer=f.peer, issue_ns=f.issue_ns, waiting=f.waiting)
        for f in in_flight[:IN_FLIGHT_LIMIT]
    ]
    return pb.Heartbeat(time_ns=time_ns, step=step, phase=phase, status="stalled" if stalled else "running",
                        last_progress_ns=last_progress_ns, in_flight=flights)  # fmt: skip


def end(time_ns: int, reason: int, *, signal: int = 0, message: str = "") -> pb.EndOfRank:
    exit_code = 1 if reason == pb.EndOfRank.REASON_EXCEPTION else 0
    return pb.EndOfRank(time_ns=time_ns, reason=reason, exit_code=exit_code, signal=signal, message=message)

