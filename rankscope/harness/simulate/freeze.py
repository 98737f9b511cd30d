"""Where every rank of a hung job ends up: the fixed point of the step's operations.

The root stops at step s before its next collective or point-to-point operation (the trainer's
``hang`` fault; a ``crash`` stops it the same way, and then it exits). Everybody else goes on
until they wait for an operation that cannot complete: a tp or dp all-reduce completes once every
member has entered it, a receive once the sender has posted the matching send; a send is
asynchronous (the sender goes on, the send stays in flight until the receiver posts). In the
root's data-parallel replica that stops its tp peers in their all-reduce, its pipeline neighbours
in their receives (and the waits spread along the pipeline and across each stage's tp group);
every other replica runs its pipeline to the end and waits in the dp all-reduce for its stage's
member of the root's replica. The hang detector has to walk exactly these chains back to the root.

Only the root's replica (TP x PP ranks) is played through, operation by operation; the other
replicas' state follows from the argument above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rankscope.harness.simulate.step_model import Step, StepModel
from rankscope.harness.simulate.rows import ALL_REDUCE, DP_GROUP, PP_GROUP, RECV, SEND, TP_GROUP

PHASES = ("forward", "backward", "recv_forward", "recv_backward", "grad_sync")


@dataclass(frozen=True)
class Flight:
    """An operation a rank has entered and not finished (a heartbeat's ``InFlight``); indices as in ``rows``."""

    group: int  # TP_GROUP, PP_GROUP or DP_GROUP
    seq: int
    op: int  # ALL_REDUCE, SEND or RECV
    peer: int
    issue_ns: int
    waiting: bool


@dataclass(frozen=True)
class _Comm:
    """One operation in a rank's list for the step; ``key`` identifies it across ranks."""

    flight: Flight
    key: tuple
    phase: int


@dataclass
class Frozen:
    """Every rank's state once the job stopped moving at step ``step`` because of ``root``."""

    root: int
    step: int
    since_ns: np.ndarray  # (world,) when each rank stopped making progress
    phase: np.ndarray  # (world,) index into PHASES
    #: ranks of the root's replica -> what they have in flight (the root: nothing)
    flights: dict[int, list[Flight]] = field(default_factory=dict)
    #: what every other rank waits in: its dp all-reduce of the step (seq = step)
    replica: int = 0

    def in_flight(self, rank: int, issue_ns: int) -> list[Flight]:
        """What ``rank`` has in flight; ``issue_ns``: when it entered the dp all-reduce (other replicas)."""
        if rank in self.flights:
            return self.flights[rank]
        return [Flight(DP_GROUP, self.step, ALL_REDUCE, -1, issue_ns, True)]


def freeze(model: StepModel, step: Step, root: int) -> Frozen:
    """The state of every rank after ``root`` stopped before its next operation of ``step``."""
    topo = model.topo
    replica = int(topo.coords[root, 2])
    members = [int(r) for r in np.flatnonzero(topo.coords[:, 2] == replica)]
    ops = {r: _operations(model, step, r) for r in members}
    position = dict.fromkeys(members, 0)
    entered: dict[tuple, set[int]] = {}
    moved = True
    while moved:
        moved = False
        for r in members:
            while r != root and position[r] < len(ops[r]):  # the root never enters another operation
                comm = ops[r][position[r]]
                inside = entered.setdefault(comm.key, set())
                moved |= r not in inside
                inside.add(r)
                if not _completes(model, comm, r, entered):
                    break
                position[r] += 1
                moved = True
    frozen = Frozen(root, step.number, step.pipe_end_by_rank + step.start_ns, np.full(topo.world_size, PHASES.index("grad_sync")), replica=replica)
    for r in members:
        blocked = ops[r][position[r]] if position[r] < len(ops[r]) else None
        if blocked is None:  # cannot happen in a hang: every chain leads to the root
            raise AssertionError(f"rank {r} finished step {step.number} despite the hang of rank {root}")
        unmatched_sends = [c.flight for c in ops[r][: position[r]] if c.flight.op == SEND and not _peer_entered(c, entered)]
        waiting = [] if r == root else [blocked.flight]
        frozen.flights[r] = waiting + [Flight(**{**vars(f), "waiting": False}) for f in unmatched_sends]
        frozen.since_ns[r] = blocked.flight.issue_ns
        frozen.phase[r] = blocked.phase
    return frozen


def _operations(model: StepModel, step: Step, rank: int) -> list[_Comm]:
    """``rank``'s communication at ``step``, in order, with the times it enters each in an undisturbed step."""
    topo, k, s0 = model.topo, step.number, step.start_ns
    t, p, d = (int(c) for c in topo.coords[rank])
    stride = topo.tp * topo.dp
    tp_group, _, dp_group = (int(g) for g in topo.group_of[rank])
    out: list[_Comm] = []

    def p2p(op: int, peer: int, seq: int, issue: int, phase: str) -> None:
        src, dst = (rank, peer) if op == SEND else (peer, rank)
        out.append(_Comm(Flight(PP_GROUP, seq, op, peer, s0 + int(issue), True), ("p2p", src, dst, seq), PHASES.index(phase)))

    def collective(group: int, group_id: int, seq: int, issue: int, phase: str) -> None:
        out.append(_Comm(Flight(group, seq, ALL_REDUCE, -1, s0 + int(issue), True), ("group", group_id, seq), PHASES.index(phase)))

    for op in model.schedule[p]:
        mb, seq_p2p = op.m, model.p2p_seq(k, op.m)
        seq_tp = int(model.tp_seq(k, p, op.backward, mb))
        if not op.backward:
            if p > 0:
                p2p(RECV, rank - stride, seq_p2p, step.f_post[p, d, mb], "recv_forward")
            if topo.tp > 1:
                collective(TP_GROUP, tp_group, seq_tp, step.f_start[p, d, mb] + model.data_ns[p] + step.fwd[p, d, t, mb], "forward")
            if p < topo.pp - 1:
                p2p(SEND, rank + stride, seq_p2p, step.f_end[p, d, mb], "forward")
        else:
            if p < topo.pp - 1:
                p2p(RECV, rank + stride, seq_p2p, step.b_post[p, d, mb], "recv_backward")
            if topo.tp > 1:
                collective(TP_GROUP, tp_group, seq_tp, step.b_start[p, d, mb] + step.bwd[p, d, t, mb], "backward")
            if p > 0:
                p2p(SEND, rank - stride, seq_p2p, step.b_end[p, d, mb], "backward")
    if topo.dp > 1:
        collective(DP_GROUP, dp_group, k, step.pipe_end[p, d], "grad_sync")
    return out


def _completes(model: StepModel, comm: _Comm, rank: int, entered: dict[tuple, set[int]]) -> bool:
    """Whether ``rank`` gets past ``comm`` (which it has entered) given who has entered what."""
    if comm.flight.op == SEND:
        return True  # asynchronous: in flight until the receiver posts, the sender goes on
    if comm.flight.op == RECV:
        return _peer_entered(comm, entered)
    topo, inside = model.topo, entered[comm.key]
    # members of other replicas (a dp group) have all entered: their replicas are not held up
    replica = topo.coords[rank, 2]
    return all(m in inside or topo.coords[m, 2] != replica for m in topo.groups[topo.names[comm.key[1]]])


def _peer_entered(comm: _Comm, entered: dict[tuple, set[int]]) -> bool:
    """For point-to-point: whether the other side has posted the matching operation."""
    return comm.flight.peer in entered.get(comm.key, ())
