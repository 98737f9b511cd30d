"""One training step of a TP x PP x DP job, timed for every rank at once with numpy.

What a step is, as the bundled trainer runs it:

- each rank's forward and backward compute per microbatch: a base time per stage (the last stage
  also computes the loss) with log-normal noise, times the factor of an injected straggler;
- a tensor-parallel all-reduce after every forward and backward chunk: the members of a tp group
  arrive when their own compute ends and leave together once the slowest has arrived, so the
  straggler arrives last and its peers wait (their compute stays normal: waiting is not compute);
- the 1F1B pipeline: stage s of P runs min(P - s - 1, M) warm-up forwards, then one forward and one
  backward in turn, then the cool-down backwards; a forward waits for the previous stage's
  activation and a backward for the next stage's gradient (point-to-point transfers);
- the data-parallel gradient all-reduce once the pipeline is done (every replica waits for the
  slowest), then the optimizer.

Steps are globally synchronous: step k + 1 starts when the last rank has finished step k. The
noise comes from a generator seeded with (seed, step), so every worker process computes the same
world and the ranks of different workers agree on who arrived when.

Array axes: ``[p, d, t]`` per rank (Megatron's order: ``rank = t + d*TP + p*TP*DP``, so a C-order
reshape of the world is exactly this), ``[p, d]`` per tp group (all of its members move together),
and a last axis ``m`` per microbatch. Times are int64 nanoseconds from the step's start.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from rankscope.harness.simulate.topology import Topology

#: the stage that also computes the loss and the head is this much slower
LAST_STAGE_EXTRA = 0.1


@dataclass(frozen=True)
class Timing:
    """Nominal durations (ns) of the parts of a step, derived from the step time."""

    forward_ns: int
    backward_ns: int
    data_ns: int
    tp_ns: int
    p2p_ns: int
    dp_ns: int
    optimizer_ns: int
    noise: float

    @classmethod
    def for_step(cls, step_time_s: float, pp: int, microbatches: int, noise: float = 0.02) -> Timing:
        """Durations that make a step last about ``step_time_s``: 80% pipeline, the rest gradients and optimizer.

        An ideal 1F1B pipeline takes M + P - 1 forward-and-backward slots; a backward is twice a forward.
        """
        forward = 0.8 * step_time_s / (3 * (microbatches + pp - 1))
        ns = lambda seconds: max(1, int(seconds * 1e9))  # noqa: E731
        return cls(
            forward_ns=ns(forward), backward_ns=ns(2 * forward), data_ns=ns(0.05 * forward), tp_ns=ns(0.1 * forward),
            p2p_ns=ns(0.05 * forward), dp_ns=ns(0.08 * step_time_s), optimizer_ns=ns(0.05 * step_time_s), noise=noise,
        )  # fmt: skip


@dataclass(frozen=True)
class Op:
    """One forward (``backward=False``) or backward chunk of microbatch ``m`` on stage ``p``."""

    p: int
    backward: bool
    m: int


def one_f_one_b(stages: int, microbatches: int) -> list[list[Op]]:
    """Each stage's chunks in 1F1B order (Megatron's non-interleaved schedule)."""
    out = []
    for p in range(stages):
        warmup = min(stages - p - 1, microbatches)
        ops = [Op(p, False, m) for m in range(warmup)]
        for i in range(microbatches - warmup):
            ops += [Op(p, False, warmup + i), Op(p, True, i)]
        ops += [Op(p, True, m) for m in range(microbatches - warmup, microbatches)]
        out.append(ops)
    return out


def dependency(op: Op, stages: int) -> Op | None:
    """The chunk of a neighbouring stage whose output this one receives (None: first forward, last backward)."""
    if not op.backward:
        return Op(op.p - 1, False, op.m) if op.p > 0 else None
    return Op(op.p + 1, True, op.m) if op.p < stages - 1 else None


def topological(per_stage: list[list[Op]]) -> list[Op]:
    """All chunks in an order where each comes after its dependency and after the previous chunk of its stage."""
    stages = len(per_stage)
    done: set[Op] = set()
    position = [0] * stages
    order: list[Op] = []
    total = sum(map(len, per_stage))
    while len(order) < total:
        before = len(order)
        for p, ops in enumerate(per_stage):
            while position[p] < len(ops):
                op = ops[position[p]]
                dep = dependency(op, stages)
                if dep is not None and dep not in done:
                    break
                done.add(op)
                order.append(op)
                position[p] += 1
        if len(order) == before:
            raise AssertionError("the 1F1B schedule cannot progress")
    return order


@dataclass
class Step:
    """The times of one step (see the module docstring for the axes); all ns, relative to ``start_ns`` but ``start_ns``."""

    number: int
    start_ns: int
    fwd: np.ndarray  # (P, D, T, M) each rank's own forward compute
    bwd: np.ndarray  # (P, D, T, M) its own backward compute
    opt: np.ndarray  # (P, D, T) its optimizer
    f_start: np.ndarray  # (P, D, M) a forward chunk's start (the tp group's, incoming activation received)
    f_end: np.ndarray  # (P, D, M) its end (the tp all-reduce done)
    f_post: np.ndarray  # (P, D, M) when the stage was ready to receive the activation
    b_start: np.ndarray
    b_end: np.ndarray
    b_post: np.ndarray
    pipe_end: np.ndarray  # (P, D) the stage's last chunk ended: it enters the dp all-reduce
    dp_end: np.ndarray  # (P,) the dp all-reduce ended for every replica of the stage
    duration_ns: int
    loss: np.ndarray  # (D,) each replica's loss

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns

    @cached_property
    def opt_end(self) -> np.ndarray:
        """(P, D, T) when each rank's optimizer ended."""
        return self.dp_end[:, None, None] + self.opt

    @cached_property
    def pipe_end_by_rank(self) -> np.ndarray:
        """(world,) ``pipe_end`` of each rank (its stage and replica), in rank order."""
        pp, dp = self.pipe_end.shape
        tp = self.opt.shape[2]
        return np.broadcast_to(self.pipe_end[:, :, None], (pp, dp, tp)).reshape(pp * dp * tp)


class StepModel:
    """Computes ``Step``s of one simulated job; identical in every process for the same arguments."""

    def __init__(self, topo: Topology, timing: Timing, microbatches: int, seed: int, factors: list[tuple[int, int, float]]):
        """``factors``: (rank, from_step, factor) of each injected straggler."""
        self.topo = topo
        self.timing = timing
        self.m = microbatches
        self.seed = seed
        self.factors = factors
        self.schedule = one_f_one_b(topo.pp, microbatches)
        self.order = topological(self.schedule)
        # index of each chunk within its stage's list: the tp all-reduces' order, hence their seqs
        self.chunk_index = np.zeros((topo.pp, 2, microbatches), dtype=np.int64)
        for ops in self.schedule:
            for i, op in enumerate(ops):
                self.chunk_index[op.p, int(op.backward), op.m] = i
        stage = np.arange(topo.pp)
        self.stage_scale = np.where(stage == topo.pp - 1, 1.0 + LAST_STAGE_EXTRA, 1.0)
        self.data_ns = np.where((stage == 0) | (stage == topo.pp - 1), timing.data_ns, 0)  # data: first and last stage
        self.tp_ns = timing.tp_ns if topo.tp > 1 else 0
        self.dp_ns = timing.dp_ns if topo.dp > 1 else 0

    def p2p_seq(self, step: int, microbatch: int | np.ndarray) -> int | np.ndarray:
        """Sequence number of a microbatch's point-to-point transfers at ``step`` (per sender and receiver)."""
        return (step - 1) * self.m + microbatch + 1

    def tp_seq(self, step: int, stage: int | np.ndarray, backward: bool, microbatch: int | np.ndarray | slice) -> int | np.ndarray:
        """Sequence number of the tp all-reduce after a forward (or backward) chunk: chunks in their stage's order."""
        return (step - 1) * 2 * self.m + self.chunk_index[stage, int(backward), microbatch] + 1

    def straggle(self, number: int) -> np.ndarray:
        """(P, D, T) compute factor of every rank at step ``number`` (1 but for injected stragglers)."""
        factor = np.ones(self.topo.world_size)
        for rank, from_step, f in self.factors:
            if number >= from_step:
                factor[rank] = max(factor[rank], f)
        return factor.reshape(self.topo.pp, self.topo.dp, self.topo.tp)

    def step(self, number: int, start_ns: int) -> Step:
        t, topo = self.timing, self.topo
        shape = (topo.pp, topo.dp, topo.tp)
        rng = np.random.default_rng([self.seed, number])
        noise = lambda *extra: np.exp(t.noise * rng.standard_normal(shape + extra))  # noqa: E731
        base = self.stage_scale[:, None, None, None] * self.straggle(number)[..., None]
        fwd = np.rint(t.forward_ns * base * noise(self.m)).astype(np.int64)
        bwd = np.rint(t.backward_ns * base * noise(self.m)).astype(np.int64)
        opt = np.rint(t.optimizer_ns * noise()).astype(np.int64)
        # a tp group's chunk lasts as long as its slowest member's compute, plus the all-reduce
        f_dur = self.data_ns[:, None, None] + fwd.max(axis=2) + self.tp_ns
        b_dur = bwd.max(axis=2) + self.tp_ns
        times = {name: np.zeros((topo.pp, topo.dp, self.m), dtype=np.int64) for name in ("fs", "fe", "fp", "bs", "be", "bp")}
        free = np.zeros((topo.pp, topo.dp), dtype=np.int64)
        for op in self.order:
            p, m = op.p, op.m
            start, end, post = ("bs", "be", "bp") if op.backward else ("fs", "fe", "fp")
            dep = dependency(op, topo.pp)
            times[post][p, :, m] = free[p]
            begin = free[p] if dep is None else np.maximum(free[p], times[end][dep.p, :, m]) + t.p2p_ns
            times[start][p, :, m] = begin
            free[p] = begin + (b_dur if op.backward else f_dur)[p, :, m]
            times[end][p, :, m] = free[p]
        dp_end = free.max(axis=1) + self.dp_ns
        duration = int((dp_end[:, None, None] + opt).max())
        loss = 2.0 + 8.0 * np.exp(-number / 300) + 0.02 * rng.standard_normal(topo.dp)
        return Step(number, start_ns, fwd, bwd, opt, times["fs"], times["fe"], times["fp"], times["bs"], times["be"],
                    times["bp"], free, dp_end, duration, loss)  # fmt: skip
