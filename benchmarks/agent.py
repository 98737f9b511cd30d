"""What the agent costs: training step time on vs off, per span and per collective, events/s.

    python benchmarks/agent.py [--repeats 5] [--steps 8] [--seconds 10] [--rounds 60] [--baseline REV]
                               [--parts steps,micro,transport]

1. The bundled trainer's default 8-rank CPU job, alternately with the agent off and on
   (RANKSCOPE_ENABLE=1, default settings), ``--repeats`` pairs of runs (off first in one pair, on
   first in the next: neither side always runs on a machine just woken or just warmed), against a
   collector on this machine (where the demo runs it): with its defaults (live diagnosis, ``--nice
   10``), the same at the job's own priority (``--nice 0``), ingesting only (``--no-diagnosis``),
   and paused (SIGSTOP: what is left is the agent's own cost in the ranks); median step time of
   each side, the median and range of the pairs' ratios, and the CPU the collector used during
   the measured steps (on a machine the job saturates, that CPU is taken from training).
2. In one fresh process, side by side: the cost of one span (``with agent.span(...)``) and of one
   collective (a 1-rank gloo ``dist.all_reduce``) with the agent off (torch's own methods, the
   API's no-op span), with this agent's wrappers installed but passing calls straight through,
   with this agent recording, and, with ``--baseline REV``, with the agent of git revision REV
   recording (its ``rankscope/agent/__init__.py`` and recording modules, ``LAYOUTS``, loaded
   beside this one). ``--rounds`` interleaved rounds (the order reversed every other round) of
   blocks of 1,000 collectives, 10,000 collectives with torch's calls stubbed (the method returns a
   completed Work, its ``wait`` returns at once: what is left is the agent's own work) and 10,000
   spans; per call, each block's CPU time of the calling thread (the work done there; on this
   shared machine wall time also counts whatever else ran) and wall time. The agent's cost is the
   median over the rounds of its block minus the same round's agent-off block. The agents run no
   threads here: between blocks the background thread's work on the rows (poll and drain) runs
   on the same thread and is timed on its own. Then what the parts of the agent's work per
   collective cost one by one (torch's calls it makes, the rows it keeps), the rest being the
   interpreter running its lines; last, one OpenTelemetry SDK span with a batch span processor,
   and the ratio OTel / agent span.
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
from rankscope.harness.orchestration import start_collector, stop

ROOT = Path(__file__).resolve().parent.parent
#: The modules an agent records with, besides its API (``__init__.py``), in import order (each
#: imports only those before it): this agent's, then those of an agent before collectives.py was
#: split into collective_patches, collective_tracker, process_groups and flight_recorder.
LAYOUTS = (
    ("recorder", "process_groups", "flight_recorder", "collective_tracker", "collective_patches"),
    ("recorder", "collectives"),
)

MICRO = textwrap.dedent(
    """
    import collections, importlib, importlib.util, json, os, sys, tempfile, time
    import torch, torch.distributed as dist
    from rankscope import agent
    from rankscope.agent.state import RankState
    from rankscope.agent.timing import CpuClock

    cfg = json.loads(sys.argv[1])
    THIS = {stem: importlib.import_module("rankscope.agent." + stem) for stem in cfg["modules"]}
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    PG, WORK = torch._C._distributed_c10d.ProcessGroup, torch._C._distributed_c10d.Work
    RAW = {"allreduce": PG.__dict__["allreduce"], "wait": WORK.__dict__["wait"]}  # torch's own: the agent off
    ORIGINAL = {"allreduce": PG.allreduce, "wait": WORK.wait}  # what the agent's wrappers call
    t = torch.ones(1)
    DONE = dist.all_reduce(t, async_op=True)
    DONE.wait()
    def stub_allreduce(pg, *args, **kwargs):  # torch taken out: a completed Work at once
        return DONE
    def stub_wait(work, *args, **kwargs):
        return True
    TORCH = {"real": (RAW, ORIGINAL), "stubbed": ({"allreduce": stub_allreduce, "wait": stub_wait},) * 2}

    def load(directory, name, stems):
        # A previous agent's API (__init__.py) and recording modules (``stems``, in import order), as
        # modules of their own beside this one; while they load, each stands in for this agent's
        # module of its name, so that their imports of one another find them.
        def module(file, as_name):
            spec = importlib.util.spec_from_file_location(as_name, os.path.join(directory, file))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[as_name] = mod
            spec.loader.exec_module(mod)
            return mod
        ours = {stem: sys.modules.get("rankscope.agent." + stem) for stem in stems}
        modules = {}
        try:
            for stem in stems:
                modules[stem] = sys.modules["rankscope.agent." + stem] = module(stem + ".py", f"{name}_{stem}")
            return module("__init__.py", name + "_api"), modules
        finally:
            for stem, mod in ours.items():
                if mod is None:
                    sys.modules.pop("rankscope.agent." + stem, None)
                else:
                    sys.modules["rankscope.agent." + stem] = mod

    def part(modules, stem):
        # before its split, collectives.py held the patches, the tracker and the process groups
        return modules[stem] if stem in modules else modules["collectives"]

    class Agent:
        # One agent's API and recording modules, with wrappers for the two calls measured; no
        # threads: its background work runs between the measured blocks, timed on its own.
        def __init__(self, api, modules):
            self.api = api
            self.patches = patches = part(modules, "collective_patches")
            recorder = modules["recorder"]
            self.rec = recorder.Recorder(CpuClock(), RankState(), capacity=1 << 20, flush_rows=1 << 19)  # no early wake-ups
            groups = part(modules, "process_groups").Groups()
            self.c = part(modules, "collective_tracker").Collectives(self.rec, groups, fr_interval_s=1e9)
            spec = patches.METHODS["allreduce"]
            self.wrappers = {side: {"allreduce": patches._method_wrapper(calls["allreduce"], spec),
                                    "wait": patches._wait_wrapper(calls["wait"])}
                             for side, (_, calls) in TORCH.items()}  # fmt: skip

        def select(self, active, side):
            PG.allreduce, WORK.wait = self.wrappers[side]["allreduce"], self.wrappers[side]["wait"]
            self.patches._active = self.c if active else None
            self.api._attach(self.rec if active else None)
            self.api._may_start = False

        def background(self):
            # What the background thread does with the rows (for this agent, its poll and drain);
            # the counter steps other blocks made while this agent was not installed are no gaps.
            self.c.poll()
            self.c._gaps.clear()
            for _ in self.rec.drain():
                pass

    agents = {"agent": Agent(agent, THIS)}
    if cfg["baseline"]:
        agents["baseline"] = Agent(*load(cfg["baseline"], "baseline", cfg["baseline_modules"]))
    API = agent  # the API the spans go through: the agent's own (the agent-off side uses this one's no-op)

    def select(label, side):
        global API
        for other in agents.values():
            other.select(False, side)
        if label == "off":
            PG.allreduce, WORK.wait = TORCH[side][0]["allreduce"], TORCH[side][0]["wait"]
            API = agent
        elif label == "wrappers":  # the agent's wrappers installed, passing every call straight through
            agents["agent"].select(False, side)
            API = agent
        else:
            agents[label].select(True, side)
            API = agents[label].api

    def collective():
        dist.all_reduce(t)
    def span():
        with API.span("forward", step=1, microbatch=0):
            pass
    def cost(fn, n):
        # (CPU ns of this thread, wall ns) per call: CPU time is the agent's own work on the caller's
        # thread; wall time also counts whatever else the machine ran meanwhile
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        for _ in range(n):
            fn()
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        return (c1 - c0) / n, (w1 - w0) / n

    labels = ["off", "wrappers", *agents]
    measures = (("collective", "real", collective, cfg["collectives"]), ("stubbed", "stubbed", collective, cfg["collectives"] * 10),
                ("span", "real", span, cfg["spans"]))  # fmt: skip
    out = {"labels": labels, **{name: {l: [] for l in labels} for name, *_ in measures},
           **{"background_" + name: {l: [] for l in agents} for name, *_ in measures}}
    for r in range(cfg["rounds"]):
        for label in labels if r % 2 == 0 else labels[::-1]:  # each side first in every other round
            for name, side, fn, n in measures:
                select(label, side)
                if label in agents:
                    agents[label].background()
                out[name][label].append(cost(fn, n))
                if label in agents:
                    c0 = time.thread_time_ns()
                    agents[label].background()
                    out["background_" + name][label].append((time.thread_time_ns() - c0) / n)
    select("off", "real")

    # What the agent's calls into torch and the interpreter's containers cost here, one by one
    # (best of 20 blocks of 20,000): the parts of its work on the caller's thread that Python cannot
    # do cheaper. The rows are kept, as the queues keep them until the background thread comes.
    group, opts, q, d, busy, pc = dist.group.WORLD, dist.AllreduceOptions(), collections.deque(), {}, [], time.perf_counter_ns
    spec = agents["agent"].patches.METHODS["allreduce"]
    parts = {
        "the group's counter (a pybind call)": lambda: group._get_sequence_number_for_group(),
        "opts.asyncOp (a pybind property)": lambda: getattr(opts, "asyncOp", True),
        "tensor bytes and dtype (two pybind properties)": lambda: (t.nbytes, t.dtype),
        "two clock readings": lambda: (pc(), pc()),
        "the row and its completion (two tuples of new integers, kept in two queues) and the Work's dict entry":
            lambda: (q.append(r := (0, spec, True, pc(), t, -1, pc(), 2, 3, pc(), None)), d.__setitem__(5, (r, None, False)),
                     d.pop(5), q.append((r, pc(), 1))),
        "the group's busy mark": lambda: (busy.append(None), busy.pop()),
    }  # fmt: skip
    def best(fn):
        times = []
        for _ in range(20):
            q.clear()
            times.append(cost(fn, 20_000)[0])
        return min(times)
    empty = best(lambda: None)
    out["parts"] = {k: best(fn) - empty for k, fn in parts.items()}
    clocks = best(lambda: (pc(), pc(), pc(), pc())) - empty  # the row part's own clock readings, not its cost
    out["parts"]["the row and its completion (two tuples of new integers, kept in two queues) and the Work's dict entry"] -= clocks

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
    out["otel_span"] = min(cost(otel_span, cfg["spans"] // 4) for _ in range(5))
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


def baseline_files(rev: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The agent of git revision ``rev``, at whichever layout it has: its recording modules (one of
    ``LAYOUTS``), and file name -> source of those and of its API (``__init__.py``)."""
    why = ""
    for folder in ("rankscope/agent", "agent"):  # the layout since session 24, and before it
        for stems in LAYOUTS:
            sources = {}
            for name in ("__init__.py", *(stem + ".py" for stem in stems)):
                source = subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], cwd=ROOT, capture_output=True, text=True)
                if source.returncode != 0:
                    why = why or source.stderr.strip()
                    break
                sources[name] = source.stdout
            else:
                return stems, sources
    sys.exit(f"--baseline {rev}: {why}")


def micro(args: argparse.Namespace, workdir: Path) -> dict:
    """Section 2, in a fresh process without the agent's start-up hook (it builds the agents it measures)."""
    baseline, stems = "", ()
    if args.baseline:
        baseline = str(workdir / "baseline")
        os.makedirs(baseline)
        stems, sources = baseline_files(args.baseline)
        for name, source in sources.items():
            Path(baseline, name).write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    cfg = {"rounds": args.rounds, "collectives": 1000, "spans": 10_000, "modules": LAYOUTS[0], "baseline": baseline,
           "baseline_modules": stems}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", MICRO, json.dumps(cfg)], env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        sys.exit(f"micro-benchmark failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def micro_rows(m: dict, baseline: str) -> list[str]:
    """Per span and per collective: CPU time of the calling thread (median over the rounds; the
    agent's cost is the median of its block minus the same round's agent-off block), wall time
    beside it, what the background thread spends on the same rows, and where the agent's time per
    collective goes."""
    agents = [label for label in m["labels"] if label not in ("off", "wrappers")]
    who = {"agent": "this agent", "baseline": f"the agent of {baseline}"}

    def med(name: str, label: str, i: int = 0) -> float:
        return statistics.median(x[i] for x in m[name][label])

    def extra(name: str, label: str, i: int = 0) -> float:
        return statistics.median(a[i] - b[i] for a, b in zip(m[name][label], m[name]["off"]))

    rounds = len(m["span"]["off"])
    rows = []
    measures = (
        ("span", "one span (`with agent.span(...)`)", "span"),
        ("collective", "one collective (1-rank gloo `dist.all_reduce`)", "collective"),
        ("stubbed", "one collective, torch's calls stubbed (the `all_reduce` method returns a completed Work, its `wait` returns at once): the agent's own work", "collective"),
    )  # fmt: skip
    for name, what, unit in measures:
        for label in agents:
            rows.append(
                f"| {what}, {who[label]}: CPU time of the calling thread (wall time), medians of {rounds} interleaved rounds | "
                f"{med(name, 'off') / 1e3:.2f} us ({med(name, 'off', 1) / 1e3:.2f} us) | "
                f"{med(name, label) / 1e3:.2f} us ({med(name, label, 1) / 1e3:.2f} us) | "
                f"+{extra(name, label) / 1e3:.2f} us per {unit} (wall +{extra(name, label, 1) / 1e3:.2f} us) |"
            )
    for label in agents:
        rows.append(
            f"| the background thread's work on those rows, {who[label]}: CPU time per span / per collective | | "
            f"{statistics.median(m['background_span'][label]) / 1e3:.2f} us / "
            f"{statistics.median(m['background_collective'][label]) / 1e3:.2f} us | |"
        )
    own = extra("stubbed", "agent")
    wrappers = extra("stubbed", "wrappers")
    parts = [f"the two wrappers' Python calls {wrappers / 1e3:.2f} us"]
    parts += [f"{what} {ns / 1e3:.2f} us" for what, ns in m["parts"].items()]
    rest = own - wrappers - sum(m["parts"].values())
    rows.append(f"| where this agent's {own / 1e3:.2f} us per collective (torch stubbed) go | | | {'; '.join(parts)}; "
                f"the rest, {rest / 1e3:.2f} us, is the interpreter running the wrappers' lines (local and attribute "
                f"loads, stores, tests) |")  # fmt: skip
    span = med("span", "agent")
    rows.append(f"| OpenTelemetry SDK span, batch processor (CPU time) | {m['otel_span'][0] / 1e3:.2f} us | | "
                f"OTel / agent span = {m['otel_span'][0] / span:.1f}x |")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="pairs of runs (agent off, on) per collector")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=60, help="interleaved rounds of the per-span and per-collective costs")
    parser.add_argument("--baseline", metavar="REV", default="",
                        help="also measure the per-span and per-collective costs of the agent of git revision REV "
                             "(its rankscope/agent/__init__.py and recording modules), side by side")  # fmt: skip
    parser.add_argument("--parts", default="steps,micro,transport",
                        help="comma-separated sections to run: steps (1.), micro (2.), transport (3.)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - {"steps", "micro", "transport"}:
        parser.error(f"--parts: unknown {', '.join(sorted(parts - {'steps', 'micro', 'transport'}))}")
    workdir = Path(tempfile.mkdtemp(prefix="rankscope-agent-bench-"))
    collector = None
    jobs: dict[str, Job] = {}
    m = None
    events_per_s = None
    try:
        if "steps" in parts:
            jobs = {name: step_times(flags, paused, args, workdir) for name, (flags, paused) in COLLECTORS.items()}
        if "micro" in parts:
            m = micro(args, workdir)
        if "transport" in parts:
            # the sender measures the agent, not a collector beside training: full priority
            collector, address = start_collector(workdir / "store", workdir / "collector.log", "--no-diagnosis", "--nice", "0")
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
    print("| measure | agent off | agent on | ratio |")
    print("|---|---|---|---|")
    for name, job in jobs.items():
        print(job.row(name))
    if m is not None:
        print("\n".join(micro_rows(m, args.baseline)))
    if events_per_s is not None:
        print(f"| events/s one agent's Transport hands to the collector (4096-event span batches) | | {events_per_s:,.0f} | |")


if __name__ == "__main__":
    main()
