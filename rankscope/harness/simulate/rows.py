"""What a slice of simulated ranks records for one step, as columns (never one object per event).

Two levels of detail (see the package docstring for when each is used):

- ``summary``: per rank one span per segment with microbatch -1 (data, forward, backward,
  grad_sync, optimizer), each lasting the segment's total, which is what ``step_segments`` rolls
  up and the straggler detector compares; plus the step's first tensor-parallel all-reduce and its
  data-parallel all-reduce, with their real per-group sequence numbers and arrival times;
- ``full``: the whole timeline: every microbatch's data, forward and backward span, the waits for
  the pipeline neighbours (recv_forward / recv_backward), every tp all-reduce, every point-to-point
  send and receive (per-(group, sender, receiver) sequence numbers), the dp all-reduce.

Rows are ordered by local rank; ``Rows.offsets`` says where each rank's rows begin, so a flush of
a range of ranks is one slice per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.harness.simulate.step_model import Step, StepModel

SPAN_NAMES = ("data", "forward", "backward", "recv_forward", "recv_backward", "grad_sync", "optimizer")
# telemetry.proto SpanKind: 0 compute, 1 comm, 2 data, 3 optimizer
SPAN_KINDS = np.array([2, 0, 0, 1, 1, 1, 3], dtype=np.uint8)
DATA, FORWARD, BACKWARD, RECV_FORWARD, RECV_BACKWARD, GRAD_SYNC, OPTIMIZER = range(len(SPAN_NAMES))

#: a collective's string table, per rank: its three groups, then the ops and the dtype
TP_GROUP, PP_GROUP, DP_GROUP, ALL_REDUCE, SEND, RECV, BF16 = range(7)
OP_NAMES = ("all_reduce", "send", "recv", "bfloat16")
TP_BYTES, P2P_BYTES, DP_BYTES = 32 << 20, 16 << 20, 1 << 30

STEP_METRICS = ("loss", "grad_norm", "step_time_s", "tokens_per_s")
TOKENS_PER_STEP = 4 << 20

SPAN_COLUMNS = ("name", "step", "microbatch", "start_ns", "end_ns")
COLLECTIVE_COLUMNS = ("group", "seq", "op", "nbytes", "peer", "issue_ns", "end_ns", "step")


@dataclass
class Rows:
    """Rows of ``n`` ranks (local indices 0..n-1), ordered by rank: columns plus where each rank starts."""

    columns: dict[str, np.ndarray]
    offsets: np.ndarray  # (n + 1,) int64

    def take(self, lo: int, hi: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The rows of ranks lo..hi-1 and how many each has."""
        a, b = self.offsets[lo], self.offsets[hi]
        return {k: v[a:b] for k, v in self.columns.items()}, np.diff(self.offsets[lo : hi + 1])


def _stack(parts: list[tuple[dict[str, np.ndarray | int], np.ndarray]], n: int, names: tuple[str, ...]) -> Rows:
    """Rows from parts of shape (n, x) each (columns and a mask), kept rank by rank."""
    width = [mask.shape[1] for _, mask in parts]
    mask = np.concatenate([m for _, m in parts], axis=1)
    columns = {}
    for name in names:
        pieces = [np.broadcast_to(np.asarray(cols[name]), (n, w)) for (cols, _), w in zip(parts, width)]
        columns[name] = np.concatenate(pieces, axis=1)[mask]
    counts = mask.sum(axis=1)
    return Rows(columns, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))


class Slice:
    """Rows for the ranks ``lo .. hi-1`` of a ``StepModel``'s world."""

    def __init__(self, model: StepModel, lo: int, hi: int):
        self.model = model
        self.lo, self.hi = lo, hi
        self.n = hi - lo
        topo = model.topo
        self.pp = topo.coords[lo:hi, 1].astype(np.int64)
        self.first = self.pp == 0
        self.last = self.pp == topo.pp - 1
        self.world = topo.world_size
        self.stride = topo.tp * topo.dp  # rank distance between neighbouring stages
        self.data_ns = model.data_ns[self.pp][:, None]
        self.reporters = np.flatnonzero(self.last & (topo.coords[lo:hi, 0] == 0))

    # --- per-rank views of the world's arrays --------------------------------------------------

    def _all(self, width: int = 1) -> np.ndarray:
        """A mask that keeps every row of an (n, width) part."""
        return np.ones((self.n, width), dtype=bool)

    def mine(self, a: np.ndarray) -> np.ndarray:
        """A (P, D, T[, M]) array as (n[, M]) for this slice."""
        return a.reshape(self.world, *a.shape[3:])[self.lo : self.hi]

    def group(self, a: np.ndarray, shift: int = 0) -> np.ndarray:
        """A per-tp-group (P, D, M) array as (n, M); ``shift``: the next (1) or previous (-1) stage's, which
        wraps around past the ends (the callers mask those rows out)."""
        topo = self.model.topo
        if shift:
            a = np.roll(a, -shift, axis=0)
        full = np.broadcast_to(a[:, :, None, :], (topo.pp, topo.dp, topo.tp, a.shape[-1]))
        return full.reshape(self.world, a.shape[-1])[self.lo : self.hi]

    # --- the two levels of detail --------------------------------------------------------------

    def summary(self, step: Step, *, upto_pipeline: bool = False, keep: np.ndarray | None = None) -> tuple[Rows, Rows]:
        """(spans, collectives) summarising ``step``; ``upto_pipeline`` leaves out what comes after the
        pipeline (gradient all-reduce, optimizer); ``keep``: the ranks that record anything."""
        s0, m = step.start_ns, self.model.m
        fwd, bwd = self.mine(step.fwd), self.mine(step.bwd)
        f0, b0 = self.group(step.f_start)[:, :1] + s0, self.group(step.b_start)[:, :1] + s0
        pipe_end, dp_end, opt_end = self._ends(step)
        keep_col = self._all() if keep is None else keep[:, None]
        after = keep_col & (not upto_pipeline)
        spans = [
            ({"name": DATA, "start_ns": f0, "end_ns": f0 + m * self.data_ns}, keep_col & (self.first | self.last)[:, None]),
            ({"name": FORWARD, "start_ns": f0 + self.data_ns, "end_ns": f0 + self.data_ns + fwd.sum(1, keepdims=True)}, keep_col),
            ({"name": BACKWARD, "start_ns": b0, "end_ns": b0 + bwd.sum(1, keepdims=True)}, keep_col),
            ({"name": GRAD_SYNC, "start_ns": pipe_end, "end_ns": dp_end}, after),
            ({"name": OPTIMIZER, "start_ns": dp_end, "end_ns": opt_end}, after),
        ]
        for cols, _ in spans:
            cols.update(step=step.number, microbatch=-1)
        first_tp, tp_mask = self._tp(step, backward=False, microbatches=1)
        collectives = [(first_tp, tp_mask & keep_col), (self._dp(step), after & (self.model.topo.dp > 1))]
        return _stack(spans, self.n, SPAN_COLUMNS), _stack(collectives, self.n, COLLECTIVE_COLUMNS)

    def full(self, step: Step) -> tuple[Rows, Rows]:
        """(spans, collectives): the whole timeline of ``step``."""
        s0, m, k = step.start_ns, self.model.m, step.number
        fs, fe, fp = (self.group(a) + s0 for a in (step.f_start, step.f_end, step.f_post))
        bs, be, bp = (self.group(a) + s0 for a in (step.b_start, step.b_end, step.b_post))
        fwd_end = fs + self.data_ns + self.mine(step.fwd)
        bwd_end = bs + self.mine(step.bwd)
        pipe_end, dp_end, opt_end = self._ends(step)
        mb = np.arange(m)[None, :]
        has_prev, has_next = ~self.first[:, None], ~self.last[:, None]
        all_m = self._all(m)
        spans = [
            ({"name": DATA, "start_ns": fs, "end_ns": fs + self.data_ns}, all_m & (self.first | self.last)[:, None]),
            ({"name": FORWARD, "start_ns": fs + self.data_ns, "end_ns": fwd_end}, all_m),
            ({"name": BACKWARD, "start_ns": bs, "end_ns": bwd_end}, all_m),
            ({"name": RECV_FORWARD, "start_ns": fp, "end_ns": fs}, all_m & has_prev),
            ({"name": RECV_BACKWARD, "start_ns": bp, "end_ns": bs}, all_m & has_next),
        ]
        for cols, _ in spans:
            cols.update(step=k, microbatch=mb)
        spans += [
            ({"name": GRAD_SYNC, "start_ns": pipe_end, "end_ns": dp_end, "step": k, "microbatch": -1}, self._all()),
            ({"name": OPTIMIZER, "start_ns": dp_end, "end_ns": opt_end, "step": k, "microbatch": -1}, self._all()),
        ]
        ranks = np.arange(self.lo, self.hi)[:, None]
        p2p = {"group": PP_GROUP, "seq": self.model.p2p_seq(k, mb), "nbytes": P2P_BYTES, "step": k}
        collectives = [
            self._tp(step, backward=False),
            self._tp(step, backward=True),
            ({**p2p, "op": SEND, "peer": ranks + self.stride, "issue_ns": fe, "end_ns": self.group(step.f_start, 1) + s0}, all_m & has_next),
            ({**p2p, "op": RECV, "peer": ranks - self.stride, "issue_ns": fp, "end_ns": fs}, all_m & has_prev),
            ({**p2p, "op": SEND, "peer": ranks - self.stride, "issue_ns": be, "end_ns": self.group(step.b_start, -1) + s0}, all_m & has_prev),
            ({**p2p, "op": RECV, "peer": ranks + self.stride, "issue_ns": bp, "end_ns": bs}, all_m & has_next),
            (self._dp(step), self._all() & (self.model.topo.dp > 1)),
        ]
        return _stack(spans, self.n, SPAN_COLUMNS), _stack(collectives, self.n, COLLECTIVE_COLUMNS)

    def step_metrics(self, step: Step) -> tuple[np.ndarray, np.ndarray]:
        """(values (r, len(STEP_METRICS)), times (r,)) of the ``reporters``: the last stage's first tp rank of
        each replica, where the loss is."""
        replica = self.model.topo.coords[self.lo + self.reporters, 2]
        seconds = step.duration_ns / 1e9
        ones = np.ones(len(replica))
        values = np.stack([step.loss[replica], ones + 0.1 / step.number, ones * seconds, ones * TOKENS_PER_STEP / seconds], axis=1)
        return values, self.mine(step.opt_end)[self.reporters] + step.start_ns

    # --- pieces ----------------------------------------------------------------------------------

    def _ends(self, step: Step) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(n, 1) each: pipeline end (enters the dp all-reduce), dp all-reduce end, optimizer end."""
        pipe = step.pipe_end_by_rank[self.lo : self.hi]
        dp_end = step.dp_end[self.pp]
        return (pipe + step.start_ns)[:, None], (dp_end + step.start_ns)[:, None], (self.mine(step.opt_end) + step.start_ns)[:, None]

    def _tp(self, step: Step, *, backward: bool, microbatches: int | None = None) -> tuple[dict[str, np.ndarray | int], np.ndarray]:
        """The tp all-reduce after each forward (or backward) chunk of the first ``microbatches`` (all):
        members arrive when their own compute ends."""
        s0, m = step.start_ns, self.model.m
        chunks = slice(0, microbatches)
        if backward:
            arrive = self.group(step.b_start) + s0 + self.mine(step.bwd)
            end = self.group(step.b_end) + s0
        else:
            arrive = self.group(step.f_start) + s0 + self.data_ns + self.mine(step.fwd)
            end = self.group(step.f_end) + s0
        cols = {"group": TP_GROUP, "seq": self.model.tp_seq(step.number, self.pp, backward, chunks), "op": ALL_REDUCE,
                "nbytes": TP_BYTES, "peer": -1, "issue_ns": arrive[:, chunks], "end_ns": end[:, chunks], "step": step.number}  # fmt: skip
        return cols, self._all(m)[:, chunks] & (self.model.topo.tp > 1)

    def _dp(self, step: Step) -> dict[str, np.ndarray | int]:
        pipe_end, dp_end, _ = self._ends(step)
        return {"group": DP_GROUP, "seq": step.number, "op": ALL_REDUCE, "nbytes": DP_BYTES, "peer": -1,
                "issue_ns": pipe_end, "end_ns": dp_end, "step": step.number}  # fmt: skip
