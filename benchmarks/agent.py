"""What the agent costs: training step time on vs off, per span and per collective, events/s.

    python benchmarks/agent.py [--repeats 5] [--steps 8] [--seconds 10]

1. The bundled trainer's default 8-rank CPU job, alternately with the agent off and on
   (RANKSCOPE_ENABLE=1, default settings), ``--repeats`` pairs of runs (off first in one pair, on
   first in the next: neither side always runs on a machine just woken or just warmed), against a
   collector on this machine (where the demo runs it): with its defaults (live diagnosis, ``--nice
   10``), the same at the job's own priority (``--nice 0``), ingesting only (``--no-diagnosis``),
   and paused (SIGSTOP: what is left is the agent's own cost in the ranks); median step time of
   each side, the median and range of the pairs' ratios, and the CPU the collector used during
   the measured steps (on a machine the job saturates, that CPU is taken from training).
2. In two fresh processes side by side: the cost of one recorded span and one recorded
   collective (a 1-rank gloo all-reduce, agent on minus agent off), and of one OpenTelemetry SDK
   span with a batch span processor; the ratio OTel / agent span.
3. Events/s one agent's Transport hands to the collector (4096-event span batches).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

from prometheus_client.process_collector import ProcessCollector

from ingest import sender  # benchmarks/ingest.py, beside this file
from rankscope.collector.orchestration import start_collector, stop

MICRO = textwrap.dedent(
    """
    import json, os, sys, tempfile, time
    import torch, torch.distributed as dist
    from rankscope import agent
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    N = 100_000
    def per_call(fn, n):
        best = float("inf")
        for _ in range(5):  # best of 5: the least disturbed by the other processes on the machine
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter_ns() - t0) / n)
        return best
    def one_span():
        with agent.span("forward", step=1, microbatch=0):
            pass
    t = torch.ones(1)
    out = {"agent_on": agent.enabled(), "span_ns": per_call(one_span, N), "all_reduce_ns": per_call(lambda: dist.all_reduce(t), 5_000)}
    if not agent.enabled():
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
        class Drop(SpanExporter):
            def export(self, spans):
                return SpanExportResult.SUCCESS
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(Drop()))
        tracer = provider.get_tracer("bench")
        def otel_span():
            with tracer.start_as_current_span("forward"):
                pass
        out["otel_span_ns"] = per_call(otel_span, N // 4)
        provider.shutdown()
    print(json.dumps(out), flush=True)
    """
)


#: the collectors the job runs against, on this machine: name -> (extra flags, paused). A paused
#: collector (SIGSTOP while the job runs) uses no CPU: what is left is the agent's own cost in the
#: ranks (its calls wait, its batches are kept in memory and spooled at the end).
COLLECTORS = {
    "collector with its defaults (live diagnosis, --nice 10)": ((), False),
    "collector at the job's priority (--nice 0)": (("--nice", "0"), False),
    "collector ingesting only (--no-diagnosis)": (("--no-diagnosis",), False),
    "collector paused (the agent in the ranks alone)": ((), True),
}


class Run(NamedTuple):
    """One training run: its step times after the first two, and the collector's CPU during those steps."""

    steps: list[float]
    collector_cpu_s: float


def train(on: bool, address: str, steps: int, workdir: Path, collector_pid: int) -> Run:
    """One run of the default 8-rank job; the collector's CPU is read when its 2nd and its last step end."""
    metrics = workdir / f"metrics-{time.monotonic_ns()}.jsonl"
    # A spool of its own: no run adopts (and replays) what an earlier one left.
    spool = workdir / f"spool-{time.monotonic_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKSCOPE_COLLECTOR": address, "RANKSCOPE_SPOOL_DIR": str(spool)}
    env.pop("RANKSCOPE_ENABLE", None)
    if on:
        env["RANKSCOPE_ENABLE"] = "1"
    cmd = [sys.executable, "-m", "rankscope.cli.main", "train", "--steps", str(steps), "--metrics-json", str(metrics), "--log-every", "1000"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        marks = []  # the collector's CPU seconds when the 2nd and the last step ended: the window of the measured steps
        for wanted in (2, steps):
            while proc.poll() is None and _lines(metrics) < wanted:
                time.sleep(0.02)
            marks.append(cpu_seconds(collector_pid))
        if proc.wait() != 0 or len(marks) < 2:
            log.seek(0)
            sys.exit(f"training failed (agent {'on' if on else 'off'}):\n{log.read()[-4000:]}")
    times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()][2:]
    return Run(times, marks[1] - marks[0])


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) so far."""
    families = ProcessCollector(pid=lambda: pid, registry=None).collect()
    return next(f.samples[0].value for f in families if f.name == "process_cpu_seconds")


class Job(NamedTuple):
    """Interleaved off/on runs against one collector."""

    pairs: list[tuple[Run, Run]]  # (agent off, agent on), neighbours in time

    def wall_ratios(self) -> list[float]:
        """Per pair: median step on / median step off."""
        return [statistics.median(on.steps) / statistics.median(off.steps) for off, on in self.pairs]

    def collector_cores(self) -> float:
        """The collector's CPU while the measured steps of the agent-on runs ran, in cores."""
        return sum(on.collector_cpu_s for _, on in self.pairs) / sum(sum(on.steps) for _, on in self.pairs)

    def row(self, name: str) -> str:
        ratios = self.wall_ratios()
        off = [t for o, _ in self.pairs for t in o.steps]
        on = [t for _, o in self.pairs for t in o.steps]
        return (f"| default 8-rank CPU job, {name} (it used {self.collector_cores():.3f} cores during the measured steps): "
                f"median step, {len(self.pairs)} interleaved pairs of runs | {statistics.median(off) * 1e3:.0f} ms | "
                f"{statistics.median(on) * 1e3:.0f} ms | {statistics.median(ratios):.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f}) |")  # fmt: skip


def step_times(flags: tuple[str, ...], paused: bool, args: argparse.Namespace, workdir: Path) -> Job:
    """Interleaved off/on runs against a collector started with ``flags`` (stopped with SIGSTOP
    while they run when ``paused``). The ratio of each neighbouring pair, not of the pooled
    medians: the machine's speed drifts between runs."""
    name = ("".join(flags).replace("-", "") or "defaults") + ("-paused" if paused else "")
    collector, address = start_collector(workdir / f"store-{name}", workdir / f"collector-{name}.log", *flags)
    if paused:
        os.kill(collector.pid, signal.SIGSTOP)
    job = Job([])
    try:
        for pair in range(1, args.repeats + 1):
            if pair % 2:
                off = train(False, address, args.steps, workdir, collector.pid)
                on = train(True, address, args.steps, workdir, collector.pid)
            else:
                on = train(True, address, args.steps, workdir, collector.pid)
                off = train(False, address, args.steps, workdir, collector.pid)
            job.pairs.append((off, on))
            setup = f"{' '.join(flags) or '(defaults)'}{', paused' if paused else ''}"
            print(f"  collector {setup}: pair {pair}/{args.repeats}, on/off step {job.wall_ratios()[-1]:.3f}, "
                  f"collector {on.collector_cpu_s / sum(on.steps):.3f} cores",
                  file=sys.stderr, flush=True)  # fmt: skip
    finally:
        if paused:
            os.kill(collector.pid, signal.SIGCONT)
        stop(collector, 60)
    return job


def micro(on: bool, address: str, workdir: Path) -> dict:
    env = {**os.environ, "RANKSCOPE_COLLECTOR": address, "RANKSCOPE_SPOOL_DIR": str(workdir / "spool"), "RANK": "0", "WORLD_SIZE": "1"}
    env.pop("RANKSCOPE_ENABLE", None)
    if on:
        env["RANKSCOPE_ENABLE"] = "1"
    done = subprocess.run([sys.executable, "-c", MICRO], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        sys.exit(f"micro-benchmark failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="pairs of runs (agent off, on) per collector")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rankscope-agent-bench-"))
    collector = None
    try:
        jobs = {name: step_times(flags, paused, args, workdir) for name, (flags, paused) in COLLECTORS.items()}
        # the micro-benchmarks and the sender measure the agent, not a collector beside training: full priority
        collector, address = start_collector(workdir / "store", workdir / "collector.log", "--no-diagnosis", "--nice", "0")
        off, on = micro(False, address, workdir), micro(True, address, workdir)
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=sender, args=(address, "agent-bench", 0, args.seconds, 4096, str(workdir / "spool"), out))
        proc.start()
        submitted, _, dropped, _, began, ended = out.get(timeout=args.seconds + 120)
        proc.join()
        events_per_s = (submitted - dropped) / (ended - began)
    finally:
        if collector is not None:
            stop(collector, 60)
        shutil.rmtree(workdir, ignore_errors=True)
    if not on["agent_on"]:
        sys.exit("the agent did not start in the micro-benchmark process (is the package installed with its .pth?)")
    print("| measure | agent off | agent on | ratio |")
    print("|---|---|---|---|")
    for name, job in jobs.items():
        print(job.row(name))
    print(f"| one span (`with agent.span(...)`) | {off['span_ns'] / 1e3:.2f} us | {on['span_ns'] / 1e3:.2f} us | |")
    print(f"| OpenTelemetry SDK span, batch processor | {off['otel_span_ns'] / 1e3:.2f} us | | "
          f"OTel / agent span = {off['otel_span_ns'] / on['span_ns']:.1f}x |")  # fmt: skip
    extra = on["all_reduce_ns"] - off["all_reduce_ns"]
    print(f"| one all-reduce, 1-rank gloo group (agent cost = on - off) | {off['all_reduce_ns'] / 1e3:.1f} us | "
          f"{on['all_reduce_ns'] / 1e3:.1f} us | {extra / 1e3:+.1f} us per collective (noise when negative) |")  # fmt: skip
    print(f"| events/s one agent's Transport hands to the collector (4096-event span batches) | | {events_per_s:,.0f} | |")


if __name__ == "__main__":
    main()
