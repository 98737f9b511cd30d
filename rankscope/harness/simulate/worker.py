"""One worker process: a contiguous slice of simulated ranks, one Transport, wall-clock time.

The worker registers its ranks, waits for the common start time, then follows the steps of the
job as they end in real time (every worker computes the same world from the same seed and keeps
only its slice). Ranks are visited in turn: heartbeats cycle through them every ``heartbeat_s``,
flushes cycle through cohorts of neighbouring ranks every ``flush_s``, so the load on the
collector is even instead of arriving in bursts at step boundaries. What is due together travels
together: one batch per ``ranks_per_batch`` ranks, its rows naming their rank.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from rankscope.agent.clock import ClockEstimator
from rankscope.agent.config import load_config
from rankscope.agent.heartbeat_columns import to_columns
from rankscope.agent.transport import Transport
from rankscope.common.agent_env import agent_environment
from rankscope.harness.simulate import payloads
from rankscope.harness.simulate.freeze import PHASES, Frozen, freeze
from rankscope.harness.simulate.step_model import Step
from rankscope.harness.simulate.plan import Plan
from rankscope.harness.simulate.rows import Rows, Slice
from rankscope.protos.v1 import telemetry_pb2 as pb

TICK_S = 0.05
#: a cohort is flushed about this often: small cohorts spread the load
COHORT_EVERY_S = 0.25
REGISTER_TIMEOUT_S = 300.0
PROGRESS_EVERY_S = 5.0
#: after a crash, the launcher stops the other ranks this much later
LAUNCHER_DELAY_NS = 1_000_000_000


@dataclass
class _Block:
    """What the worker's ranks recorded at one step and have not all sent yet."""

    step: int
    spans: Rows
    collectives: Rows
    metrics: tuple[np.ndarray, np.ndarray] | None  # (values, times) of the slice's reporters


class HeldClock(ClockEstimator):
    """One clock offset for all the ranks of a worker: the best of the first exchanges, then held.

    The simulated ranks share one clock, so their timelines must be shifted alike; a moving
    estimate would shift each batch differently (under load, tens of milliseconds apart) and
    scramble who arrived first at a collective.
    """

    def __init__(self, samples: int = 64):
        super().__init__(window=samples)
        self.left = samples

    def add(self, t0: int, t1: int, t2: int, t3: int) -> None:
        if self.left > 0:
            self.left -= 1
            super().add(t0, t1, t2, t3)


class Cycle:
    """Items 0..n-1 visited in turn, each once per ``period_s``, evenly spread: which are due by now."""

    def __init__(self, n: int, period_s: float, start_ns: int):
        self.n, self.period_ns, self.start_ns = n, max(1, int(period_s * 1e9)), start_ns
        self.done = 0

    def due(self, now_ns: int) -> Iterator[int]:
        target = (now_ns - self.start_ns) * self.n // self.period_ns + 1
        self.done = max(self.done, target - self.n)  # fallen behind by a whole cycle: skip the missed round
        while self.done < target:
            yield self.done % self.n
            self.done += 1


class Worker:
    """The simulated ranks ``lo .. hi-1``: their steps, heartbeats and flushes, through one Transport."""

    def __init__(self, plan: Plan, lo: int, hi: int, window: int, relay: str | None = None):
        self.plan, self.lo, self.n, self.window = plan, lo, hi - lo, window
        self.topo = plan.topo
        self.model = plan.model()
        self.slice = Slice(self.model, lo, hi)
        config = load_config(agent_environment(plan.collector, spool_dir=plan.spool_dir, relay=relay))
        if config is None:
            raise ValueError(f"bad collector address {plan.collector!r}")
        self.transport = Transport(config, plan.run_id, lo, name=f"simulate-{lo}", window=window, max_queue_bytes=256 << 20,
                                   clock=HeldClock())  # fmt: skip
        cohorts = max(1, min(self.n, round(plan.cadence.flush_s / COHORT_EVERY_S)))
        self.bounds = np.linspace(0, self.n, cohorts + 1).astype(int)
        self.sent = np.zeros(cohorts, dtype=np.int64)  # last step each cohort has sent
        self.blocks: list[_Block] = []
        self.step: Step | None = None
        self.last_end_ns = 0
        self.frozen: Frozen | None = None
        self.reported = np.zeros(self.n, dtype=bool)
        self.ended = np.zeros(self.n, dtype=bool)
        self.partial_at: int | None = None
        self.events: dict[str, int] = {}  # what was submitted, by kind (rows, heartbeats, ...)
        self.submitted = 0  # batches

    # --- the phases of a worker's life ---------------------------------------------------------

    def register(self) -> None:
        """Every rank's Register, ``ranks_per_batch`` to a batch; returns once all are acknowledged
        (data before it would lack a host)."""
        self.transport.start()
        now, config, per = time.time_ns(), self.plan.config_json(), self.plan.cadence.ranks_per_batch
        for a in range(self.lo, self.lo + self.n, per):
            ranks = range(a, min(a + per, self.lo + self.n))
            regs = [payloads.register(self.topo, rank, run_name=self.plan.run_name, config_json=config, start_ns=now, pid=os.getpid())
                    for rank in ranks]  # fmt: skip
            self._send(pb.RegisterBatch(registers=regs, ranks=ranks), a, "register", len(regs))
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while self.transport.stats().acked < self.submitted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"registrations not acknowledged within {REGISTER_TIMEOUT_S:.0f} s: {self.transport.stats()}")
            time.sleep(0.05)

    def run(self, start_ns: int, stop: mp.synchronize.Event, report: mp.Queue) -> None:
        cadence = self.plan.cadence
        self.step = self.model.step(1, start_ns)
        beats = Cycle(self.n, cadence.heartbeat_s, start_ns)
        flushes = Cycle(len(self.sent), cadence.flush_s, start_ns)
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        while not stop.is_set() and not self.ended.all():
            now = time.time_ns()
            self._advance(now)
            self._send_beats([self._beat(i, now) for i in beats.due(now)])
            if self.frozen is not None:
                self._report_blocked(now)
            for j in flushes.due(now):
                self._flush(j)
            self._end_if_due(now)
            if time.monotonic() >= next_progress:
                next_progress += PROGRESS_EVERY_S
                report.put(("progress", self.lo, self.current_step, (self.transport.stats(), self.events)))
            time.sleep(TICK_S)

    @property
    def current_step(self) -> int:
        return self.step.number if self.step is not None else self.plan.steps

    # --- steps ---------------------------------------------------------------------------------

    def _advance(self, now: int) -> None:
        """Record the steps that have ended by ``now``; stop at an injected hang or crash."""
        stop = self.plan.stop
        if self.partial_at is not None and now >= self.partial_at and self.step is not None:
            # what the other replicas completed of the hung step before they blocked in its dp all-reduce
            others = self.topo.coords[self.lo : self.lo + self.n, 2] != self.frozen.replica  # type: ignore[union-attr]
            spans, collectives = self.slice.summary(self.step, upto_pipeline=True, keep=others)
            self.blocks.append(_Block(self.step.number, spans, collectives, None))
            self.partial_at = None
        while self.frozen is None and self.step is not None:
            step = self.step
            if stop is not None and step.number == stop.step:
                if now >= step.start_ns:
                    self.frozen = freeze(self.model, step, stop.rank)
                    self.partial_at = step.end_ns
                return
            if now < step.end_ns:
                return
            sampled = (step.number - 1) % self.plan.cadence.sample_every == 0
            spans, collectives = self.slice.full(step) if sampled else self.slice.summary(step)
            metrics = self.slice.step_metrics(step) if len(self.slice.reporters) else None
            self.blocks.append(_Block(step.number, spans, collectives, metrics))
            self.last_end_ns = step.end_ns
            self.step = self.model.step(step.number + 1, step.end_ns) if step.number < self.plan.steps else None

    # --- heartbeats ----------------------------------------------------------------------------

    def _beat(self, i: int, now: int) -> tuple[int, pb.Heartbeat] | None:
        """Local rank ``i``'s heartbeat now (None: it has ended or exited)."""
        if self.ended[i]:
            return None
        rank, fz = self.lo + i, self.frozen
        stall_ns = int(self.plan.cadence.stall_s * 1e9)
        if fz is not None and now >= fz.since_ns[rank]:
            if rank == fz.root and self.plan.stop.kind == "crash":  # type: ignore[union-attr]
                return None  # it has exited
            since = int(fz.since_ns[rank])
            self.reported[i] = True  # the collector hears of the blocked state now: no report needed
            beat = payloads.heartbeat(self.topo, rank, time_ns=now, step=fz.step, phase=PHASES[fz.phase[rank]],
                                      stalled=now - since >= stall_ns, last_progress_ns=since, in_flight=fz.in_flight(rank, since))  # fmt: skip
        else:
            step, phase = (self.step.number, self._phase(rank, now)) if self.step is not None else (self.plan.steps, "idle")
            beat = payloads.heartbeat(self.topo, rank, time_ns=now, step=step, phase=phase, stalled=False, last_progress_ns=now)
        return rank, beat

    def _send_beats(self, beats: list[tuple[int, pb.Heartbeat] | None]) -> None:
        """Heartbeats of several ranks, ``ranks_per_batch`` to a batch, in columns (as a relay sends them)."""
        due = [b for b in beats if b is not None]
        per = self.plan.cadence.ranks_per_batch
        for k in range(0, len(due), per):
            ranks, part = zip(*due[k : k + per])
            self._send(to_columns(part, ranks), ranks[0], "heartbeats", len(part))

    def _phase(self, rank: int, now: int) -> str:
        """The segment ``rank`` is in at ``now`` during the current step."""
        step = self.step
        assert step is not None
        t, p, d = (int(c) for c in self.topo.coords[rank])
        elapsed = now - step.start_ns
        for phase, until in (("forward", step.b_start[p, d, 0]), ("backward", step.pipe_end[p, d]), ("grad_sync", step.dp_end[p])):
            if elapsed < until:
                return phase
        return "optimizer"

    def _report_blocked(self, now: int) -> None:
        """A rank without progress for ``report_after_s`` beats at once (then on its normal cycle).

        Earliest blocked first, and only as many as fit in flight: thousands of ranks block within
        a second of each other, and a burst queued at once would hold up the periodic heartbeats
        behind it (the detectors read liveness and the stall's length from those).
        """
        since = self.frozen.since_ns[self.lo : self.lo + self.n]  # type: ignore[union-attr]
        due = np.flatnonzero(~self.reported & (now - since >= int(self.plan.cadence.report_after_s * 1e9)))
        room = max(0, self.window - self._backlog()) * self.plan.cadence.ranks_per_batch
        first = due[np.argsort(since[due], kind="stable")][:room]
        self._send_beats([self._beat(int(i), now) for i in first])
        self.reported[first] = True  # also for a crashed rank, which has nothing left to say

    # --- flushes -------------------------------------------------------------------------------

    def _flush(self, cohort: int, *, force: bool = False) -> None:
        """Send the steps cohort ``cohort``'s ranks recorded since its last flush: a span and a collective
        batch per ``ranks_per_batch`` ranks, and the step scalars of its reporters.

        While the collector is behind (more batches unacknowledged than fit in flight), the steps
        wait for the cohort's next turn: fewer, larger batches instead of a growing queue that
        would hold up the heartbeats behind it.
        """
        new = [b for b in self.blocks if b.step > self.sent[cohort]]
        if not new or not force and self._backlog() > self.window:
            return
        self.sent[cohort] = new[-1].step
        per = self.plan.cadence.ranks_per_batch
        first, last = int(self.bounds[cohort]), int(self.bounds[cohort + 1])
        payload_of = {"spans": payloads.spans, "collectives": functools.partial(payloads.collectives, self.topo)}
        for a in range(first, last, per):
            b = min(a + per, last)
            for kind, payload in payload_of.items():  # a block holds each kind's rows under that name
                ranks, cols = _rows_of([getattr(blk, kind).take(a, b) for blk in new], self.lo + a)
                if len(ranks):
                    self._send(payload(ranks, cols), int(ranks[0]), kind, len(ranks))
        mine = [k for k, i in enumerate(self.slice.reporters) if first <= i < last]
        with_metrics = [blk for blk in new if blk.metrics is not None]
        if mine and with_metrics:
            values = np.concatenate([blk.metrics[0][mine] for blk in with_metrics])  # type: ignore[index]
            times = np.concatenate([blk.metrics[1][mine] for blk in with_metrics])  # type: ignore[index]
            steps = np.repeat([blk.step for blk in with_metrics], len(mine))
            ranks = np.tile(self.lo + np.asarray(self.slice.reporters)[mine], len(with_metrics))
            self._send(payloads.step_metrics(ranks, steps, values, times), int(ranks[0]), "step_metrics", values.size)
        oldest = int(self.sent.min())
        self.blocks = [blk for blk in self.blocks if blk.step > oldest]

    # --- the end -------------------------------------------------------------------------------

    def _end_if_due(self, now: int) -> None:
        """The last words: normal after the last step; after a crash or a held hang, the launcher's SIGTERM."""
        fz, stop = self.frozen, self.plan.stop
        if fz is None:
            if self.step is None and now >= self.last_end_ns:
                self._final_flush()
                self._end_all(pb.EndOfRank.REASON_NORMAL, now)
            return
        if stop.kind == "crash":  # type: ignore[union-attr]
            root, crashed_ns = fz.root, int(fz.since_ns[fz.root])
            if self.lo <= root < self.lo + self.n and now >= crashed_ns and not self.ended[root - self.lo]:
                message = f"RuntimeError: rankscope injected crash: rank {root} at step {fz.step}"
                self._send(payloads.end(crashed_ns, pb.EndOfRank.REASON_EXCEPTION, message=message), root, "end", 1)
                self.ended[root - self.lo] = True
            if now >= int(fz.since_ns.max()) + LAUNCHER_DELAY_NS:
                self._final_flush()
                self._end_all(pb.EndOfRank.REASON_SIGNAL, now)
        elif now >= int(fz.since_ns.max()) + int(self.plan.hold_s * 1e9):
            self._final_flush()
            self._end_all(pb.EndOfRank.REASON_SIGNAL, now)

    def _final_flush(self) -> None:
        for cohort in range(len(self.sent)):
            self._flush(cohort, force=True)

    def _end_all(self, reason: int, now: int) -> None:
        """The ends of the ranks still running, ``ranks_per_batch`` to a batch: sent one by one, the
        last of 100,000 would arrive minutes after the first, and the others would look lost meanwhile."""
        sig = int(signal.SIGTERM) if reason == pb.EndOfRank.REASON_SIGNAL else 0
        end = payloads.end(now, reason, signal=sig, message="SIGTERM" if sig else "")
        running = self.lo + np.flatnonzero(~self.ended)
        per = self.plan.cadence.ranks_per_batch
        for k in range(0, len(running), per):
            ranks = running[k : k + per].tolist()
            self._send(pb.EndBatch(ends=[end] * len(ranks), ranks=ranks), ranks[0], "end", len(ranks))
        self.ended[:] = True

    def _send(self, payload: object, rank: int, kind: str, events: int) -> None:
        """Submit for ``rank``; a refusal (queue full) is counted by the Transport (``stats().rejected``)."""
        if self.transport.submit(payload, rank=rank):  # type: ignore[arg-type]
            self.events[kind] = self.events.get(kind, 0) + events
            self.submitted += 1

    def _backlog(self) -> int:
        """Batches submitted and neither acknowledged nor given up."""
        stats = self.transport.stats()
        return self.submitted - stats.acked - stats.dropped


def _rows_of(parts: list[tuple[dict[str, np.ndarray], np.ndarray]], first: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Each row's rank and the rows, from per-step pieces of consecutive ranks ``first``... (``Rows.take``)."""
    ranks = np.concatenate([np.repeat(np.arange(first, first + len(c)), c) for _, c in parts])
    return ranks, {k: np.concatenate([cols[k] for cols, _ in parts]) for k in parts[0][0]}


def main(plan: Plan, lo: int, hi: int, window: int, inbox: mp.Queue, report: mp.Queue, stop: mp.synchronize.Event,
         relay: str | None = None) -> None:  # fmt: skip
    """The spawned process: register, wait for the start time, simulate, report the Transport's counts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop (``stop``)
    worker = Worker(plan, lo, hi, window, relay)
    try:
        worker.register()
        report.put(("registered", lo, hi - lo, None))
        while not stop.is_set():
            try:
                start_ns = inbox.get(timeout=0.2)
                break
            except queue.Empty:
                continue
        else:
            return
        worker.run(start_ns, stop, report)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which exits non-zero
        report.put(("failed", lo, repr(exc), None))
        raise
    finally:
        worker.transport.close(timeout_s=2.0 if stop.is_set() else 120.0)
        report.put(("done", lo, worker.current_step, (worker.transport.stats(), worker.events)))


def relay_main(plan: Plan, listen: str, ready: mp.synchronize.Event) -> None:
    """A spawned relay process for a worker's hosts (``rankscope relay``); SIGTERM ends it."""
    from rankscope.agent.node_relay import serve

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    config = load_config(agent_environment(plan.collector, spool_dir=plan.spool_dir))
    if config is None:
        raise ValueError(f"bad collector address {plan.collector!r}")
    serve(config, listen, on_ready=ready.set)
