"""The simulation's main process: plan it, start the workers, follow them, sum up.

Workers are spawned (never forked: gRPC and chDB do not survive a fork), each gets a slice of
whole hosts and one Transport. They register their ranks first; once every worker is done, the
main process picks a common start time a moment ahead, so that all of them play the same steps
at the same wall-clock times.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from rankscope.harness.simulate import topology, worker
from rankscope.harness.simulate.plan import SUPPORTED, Cadence, Plan
from rankscope.common.fault_spec import FaultSpecError, parse

#: calls in flight over all workers. The collector's gRPC server cancels calls beyond about 1,500
#: pending at once (measured), and a batch waits up to a flush interval for its acknowledgement.
#: Through relays, each worker's calls go to a relay of its own, which holds them up to its flush
#: (``node_relay.MAX_FLUSH_S``): each worker gets the whole window.
TOTAL_WINDOW = 1000
START_DELAY_NS = 500_000_000


@dataclass(frozen=True)
class Options:
    """``rankscope simulate``'s flags (their defaults and meaning are in ``rankscope/cli/simulate.py``)."""

    tp: int
    pp: int
    dp: int
    steps: int
    step_time_s: float
    microbatches: int
    inject: str
    collector: str
    run_id: str
    batches_per_s: float
    heartbeat_s: float | None
    flush_s: float | None
    sample_every: int
    report_after_s: float
    hold_s: float
    seed: int
    noise: float = 0.02
    ranks_per_host: int = 8
    ranks_per_batch: int = 256
    via: str = "direct"


@dataclass
class Summary:
    """What a simulation sent; ``events`` by kind (span and collective rows, heartbeats, step scalars)."""

    run_id: str
    world_size: int
    seconds: float = 0.0
    register_s: float = 0.0
    steps: int = 0
    acked: int = 0
    refused: int = 0
    dropped: int = 0
    spooled: int = 0
    events: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)


def make_plan(options: Options) -> Plan:
    """Check the options and faults (FaultSpecError, ValueError) and build the plan."""
    faults = tuple(parse(options.inject))
    topo = topology.build(options.tp, options.pp, options.dp, options.ranks_per_host)
    for fault in faults:
        if fault.kind not in SUPPORTED:
            raise FaultSpecError(f"{fault.kind}: the simulator plays {', '.join(SUPPORTED)} only")
        fault.check_ranks(topo.world_size, options.steps)
    if sum(f.kind in ("hang", "crash") for f in faults) > 1:
        raise FaultSpecError("at most one hang or crash per simulation")
    cadence = Cadence.for_world(topo.world_size, options.batches_per_s, options.heartbeat_s, options.flush_s, options.ranks_per_batch,
                                sample_every=options.sample_every, report_after_s=options.report_after_s)  # fmt: skip
    if options.via == "relay":  # the same cadence, but each host's ranks send their own batches to the relay
        cadence = replace(cadence, ranks_per_batch=options.ranks_per_host)
    elif options.via != "direct":
        raise ValueError(f"via {options.via!r}: direct or relay")
    run_id = options.run_id or f"sim-{uuid.uuid4().hex[:8]}"
    return Plan(topo, run_id, f"simulated {options.tp}x{options.pp}x{options.dp}", options.collector, "", options.steps,
                options.step_time_s, options.microbatches, options.seed, options.noise, faults, cadence, options.hold_s, options.via)  # fmt: skip


def slices(plan: Plan, workers: int) -> list[tuple[int, int]]:
    """Contiguous rank ranges of whole hosts, one per worker."""
    topo = plan.topo
    hosts = -(-topo.world_size // topo.ranks_per_host)
    cuts = np.linspace(0, hosts, min(workers, hosts) + 1).astype(int) * topo.ranks_per_host
    return [(int(lo), int(min(hi, topo.world_size))) for lo, hi in zip(cuts[:-1], cuts[1:])]


def run(plan: Plan, workers: int = 2, log: Callable[[str], None] = print) -> Summary:
    """Simulate ``plan`` until it ends (or SIGTERM / SIGINT); every worker is stopped before it returns.

    Batches the collector cannot take go to a spool in a temporary directory, removed at the end
    (``Summary.spooled`` counts them): a simulation is not worth replaying. Via relays, a relay
    process per worker listens on a socket in that directory.
    """
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    report: mp.Queue = ctx.Queue()
    spool = tempfile.mkdtemp(prefix=f"rankscope-simulate-{plan.run_id}-")
    plan = replace(plan, spool_dir=spool)
    parts = slices(plan, workers)
    inboxes = [ctx.Queue() for _ in parts]
    window = TOTAL_WINDOW if plan.via == "relay" else TOTAL_WINDOW // len(parts)
    relays = [f"unix:{spool}/relay-{lo}.sock" if plan.via == "relay" else None for lo, _ in parts]
    procs = [
        ctx.Process(target=worker.main, args=(plan, lo, hi, window, inbox, report, stop, relay), name=f"simulate-{lo}")
        for (lo, hi), inbox, relay in zip(parts, inboxes, relays)
    ]
    summary = Summary(plan.run_id, plan.topo.world_size)
    restore = _stop_on_signals(stop)
    started = time.monotonic()
    relay_procs: list = []
    try:
        relay_procs = [_start_relay(ctx, plan, address) for address in relays if address is not None]
        for p in procs:
            p.start()
        _follow(plan, report, procs, inboxes, stop, summary, log)
    finally:
        stop.set()
        for p in procs:
            p.join(150)
            if p.is_alive():
                p.kill()
                p.join()
        for p in relay_procs:  # after the workers: what they sent last is spooled, then sent within seconds
            p.terminate()
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        restore()
        shutil.rmtree(spool, ignore_errors=True)
    summary.seconds = time.monotonic() - started
    return summary


def _start_relay(ctx: object, plan: Plan, address: str) -> object:
    """A relay process on ``address`` for one worker's hosts, once it listens."""
    ready = ctx.Event()  # type: ignore[attr-defined]
    proc = ctx.Process(target=worker.relay_main, args=(plan, address, ready), name=f"relay-{address}")  # type: ignore[attr-defined]
    proc.start()
    if not ready.wait(60):
        proc.kill()
        raise RuntimeError(f"the relay on {address} did not start within 60 s")
    return proc


def _follow(plan: Plan, report: mp.Queue, procs: list, inboxes: list, stop: object, summary: Summary, log: Callable[[str], None]) -> None:
    """Read the workers' reports until every worker is done (or gone): registration, start, progress lines, totals."""
    registered, began = 0, time.monotonic()
    latest: dict[int, tuple[int, object, dict[str, int]]] = {}  # worker -> (step, Transport stats, events)
    done: set[int] = set()
    last_line = (time.monotonic(), 0)
    while len(done) < len(procs):
        try:
            kind, lo, value, stats = report.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
            continue
        if kind == "registered":
            registered += value
            if registered == plan.topo.world_size:
                summary.register_s = time.monotonic() - began
                start_ns = time.time_ns() + START_DELAY_NS
                for inbox in inboxes:
                    inbox.put(start_ns)
                log(f"registered {registered:,} ranks in {summary.register_s:.1f} s; steps start now")
        elif kind == "failed":
            summary.failed.append(value)
            log(f"worker for ranks from {lo} failed: {value}")
            stop.set()  # type: ignore[attr-defined]
        else:  # progress or done
            latest[lo] = (value, *stats)
            if kind == "done":
                done.add(lo)
            elif time.monotonic() - last_line[0] >= worker.PROGRESS_EVERY_S:
                last_line = _progress(latest, last_line, log)
    summary.steps = min((step for step, _, _ in latest.values()), default=0)
    for _, stats, events in latest.values():
        summary.acked += stats.acked  # type: ignore[attr-defined]
        summary.refused += stats.rejected  # type: ignore[attr-defined]
        summary.dropped += stats.dropped  # type: ignore[attr-defined]
        summary.spooled += stats.spooled  # type: ignore[attr-defined]
        for k, v in events.items():
            summary.events[k] = summary.events.get(k, 0) + v


def _progress(latest: dict, last: tuple[float, int], log: Callable[[str], None]) -> tuple[float, int]:
    now = time.monotonic()
    acked = sum(stats.acked for _, stats, _ in latest.values())
    rate = (acked - last[1]) / max(now - last[0], 1e-9)
    refused = sum(stats.rejected + stats.dropped for _, stats, _ in latest.values())
    step = min(step for step, _, _ in latest.values())
    log(f"step {step}: {acked:,} batches acknowledged ({rate:,.0f}/s), {refused:,} refused or dropped")
    return now, acked


def _stop_on_signals(stop: object) -> Callable[[], None]:
    """SIGTERM and SIGINT stop the workers (they close their Transports); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}  # type: ignore[attr-defined]

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
