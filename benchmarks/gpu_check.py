"""The CUDA paths on a real GPU, checked and measured in one table (``make gpu-check``).

    python benchmarks/gpu_check.py [--parts 1,2,3,4] [--pairs 3] [--steps 40] [--mfu-steps 8]

On a machine without a CUDA GPU it refuses in one line and exits 1. On one with a GPU it runs:

1. CUDA-event timing: the agent's CUDA clock (rankscope/agent/timing.py: a pool of CUDA events, resolved
   off the hot path) times a bf16 matmul of known size, against torch.cuda.Event measured
   directly around the same kernel; then spans taken through the public API while the GPU is
   busy with queued matmuls must return before the GPU finishes (no synchronisation on the hot
   path; torch's sync debug mode set to "error" meanwhile), and the cost of a span with the
   agent on and off.
2. NCCL completion: a 1-rank NCCL process group (FileStore) with the agent's collective
   recorder (rankscope/agent/collective_patches.py and collective_tracker.py) on a CUDA clock;
   every all_reduce must become a completed row with start and end times, its duration compared
   with NCCL's own (``Work._get_duration()``, TORCH_NCCL_ENABLE_TIMING=1), and torch's flight
   recorder must hold a duration for every completed NCCL entry, which the agent's reader
   (rankscope/agent/flight_recorder.py) turns into start and end times.
3. The agent's cost on the bundled trainer (one GPU, tp = pp = dp = 1): runs with the agent off
   and on, alternating which goes first in each pair, against a local collector on an embedded
   store in a temporary directory (or, where chDB is not installed, against a gRPC sink in this
   script that acknowledges every batch and stores nothing); median step time of each side and their ratio,
   and what reached the collector.
4. MFU: the trainer on a ~1B-parameter GPT (18 layers, hidden 2048, 16 heads, seq 2048, vocab
   32768) for a few steps; tokens/s and MFU from rankscope/trainer/flops.py against the device's bf16 peak.
   The trainer computes in bf16 under torch.autocast with fp32 weights and AdamW state: that is
   what is measured.

Each part runs in child processes with a time limit; a part that fails or runs over gets a row
saying why, and the table still prints. The exit status is 1 when any row failed its check.

Runs from a checkout without ``pip install`` too (``python benchmarks/gpu_check.py`` from the
repository root): when ``rankscope`` is not installed, the checkout's folders are mapped onto
``rankscope.<folder>`` in this process and in every child it starts. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
REFUSAL = "make gpu-check needs a CUDA GPU: torch.cuda.is_available() is False on this machine"
ROW_MARK = "GPU_CHECK_ROW "  # a child's result lines: ROW_MARK + one Row as JSON

PARTS = {"1": "CUDA timing", "2": "NCCL", "3": "agent cost", "4": "MFU"}
#: trainer flags of part 3 (agent on vs off): a step of tens of ms on an H100, GPU-bound
OVERHEAD_MODEL = {"tp": 1, "pp": 1, "dp": 1, "layers": 12, "hidden": 1024, "heads": 16, "seq": 1024, "vocab": 32768,
                  "micro_batch": 4, "global_batch": 16}  # fmt: skip
#: trainer flags of part 4 (MFU): ~1.04B parameters by rankscope/trainer/flops.py's count
MFU_MODEL = {"tp": 1, "pp": 1, "dp": 1, "layers": 18, "hidden": 2048, "heads": 16, "seq": 2048, "vocab": 32768,
             "micro_batch": 4, "global_batch": 16}  # fmt: skip
#: the agent's goal for its cost in step time (docs/benchmarks.md)
OVERHEAD_GOAL = 1.03
#: variables a child must not inherit: the agent's own, a launcher's rank identity, NCCL timing
_CHILD_DROPS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCH_NCCL_ENABLE_TIMING")  # fmt: skip


# --- making rankscope importable --------------------------------------------------------------------


def bootstrap() -> str:
    """Make ``rankscope`` importable: "installed" when it already is, else "checkout".

    Without an installed package (the lent GPU machine, where nothing can be installed), the
    repository root goes on sys.path: the package is rankscope/ there, as installed.
    """
    try:
        if importlib.util.find_spec("rankscope.trainer") is not None:
            return "installed"
    except ImportError:  # no rankscope package at all
        pass
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return "checkout"


# --- rows and the table (pure) ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: what was checked, its value and unit, and whether it passed (None: no check)."""

    part: str
    what: str
    value: str
    unit: str
    ok: bool | None
    note: str = ""

    def line(self) -> str:
        return ROW_MARK + json.dumps(dataclasses.asdict(self))


def failure(part: str, what: str, why: str) -> Row:
    """The row of a part (or check) that could not run: its reason in the note."""
    return Row(part, what, "-", "-", False, why)


def parse_rows(output: str) -> list[Row]:
    """The rows a child printed (lines starting with ROW_MARK), in order; other lines are ignored."""
    rows = []
    for line in output.splitlines():
        if not line.startswith(ROW_MARK):
            continue
        try:
            fields = json.loads(line[len(ROW_MARK) :])
            rows.append(Row(**fields))
        except (ValueError, TypeError):
            continue
    return rows


def _cell(text: str) -> str:
    return " ".join(str(text).replace("|", "/").split())


def format_table(rows: Iterable[Row]) -> str:
    """The markdown table: part, check, value, unit, sanity (pass / FAIL / -), note."""
    lines = ["| part | check | value | unit | sanity | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        sanity = "-" if r.ok is None else "pass" if r.ok else "FAIL"
        part = f"{r.part} {PARTS[r.part]}" if r.part in PARTS else r.part
        lines.append(f"| {' | '.join(_cell(c) for c in (part, r.what, r.value, r.unit, sanity, r.note))} |")
    return "\n".join(lines)


def exit_status(rows: list[Row]) -> int:
    """0 when there are rows and none failed its check, else 1."""
    return 0 if rows and all(r.ok is not False for r in rows) else 1


def last_error(output: str, limit: int = 300) -> str:
    """What a failed child said last: its exception line if it raised, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip() and not line.startswith(ROW_MARK)]
    for line in reversed(lines):
        if re.match(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt)\b|.*: error: )", line):
            return line[:limit]
    return lines[-1][:limit] if lines else "no output"


def relative(value: float, reference: float) -> float:
    """|value / reference - 1|, inf when the reference is not positive."""
    return abs(value / reference - 1) if reference > 0 else math.inf


def trainer_flags(model: dict[str, Any]) -> list[str]:
    """The trainer's command line for a model dict: ``--micro-batch=4`` for ``micro_batch``."""
    return [f"--{name.replace('_', '-')}={value}" for name, value in model.items()]


def model_args(model: dict[str, Any]) -> Any:
    """rankscope/trainer/model.py's ModelArgs for a model dict (ffn 4 x hidden, the trainer's default)."""
    from rankscope.trainer.model import ModelArgs

    return ModelArgs(vocab=model["vocab"], hidden=model["hidden"], heads=model["heads"], ffn=4 * model["hidden"],
                     layers=model["layers"], seq=model["seq"])  # fmt: skip


def describe(model: dict[str, Any]) -> str:
    return (f"{model['layers']} layers, hidden {model['hidden']}, {model['heads']} heads, seq {model['seq']}, "
            f"vocab {model['vocab']}, micro-batch {model['micro_batch']}, global batch {model['global_batch']}")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StepStats:
    steps: int
    step_s: list[float]
    tokens_per_s: float
    mfu: float | None


def step_stats(lines: list[dict[str, Any]], warmup: int) -> StepStats:
    """Medians of the trainer's --metrics-json lines after the first ``warmup`` steps."""
    kept = [line for line in lines if line["step"] > warmup]
    if not kept:
        raise ValueError(f"no steps after the {warmup} warm-up steps (got {len(lines)})")
    mfus = [line["mfu"] for line in kept if line.get("mfu") is not None]
    return StepStats(
        steps=len(kept),
        step_s=[line["step_time_s"] for line in kept],
        tokens_per_s=statistics.median(line["tokens_per_s"] for line in kept),
        mfu=statistics.median(mfus) if mfus else None,
    )


def pair_order(pairs: int) -> list[tuple[bool, bool]]:
    """Agent (on?) of the two runs of each pair: off first in even pairs, on first in odd ones."""
    return [(False, True) if i % 2 == 0 else (True, False) for i in range(pairs)]


@dataclasses.dataclass(frozen=True)
class Overhead:
    off_s: float  # median step time over every measured step of the off runs
    on_s: float
    ratio: float  # on_s / off_s
    pair_ratios: list[float]  # per pair: median on / median off


def overhead(pairs: list[tuple[list[float], list[float]]]) -> Overhead:
    """The agent's cost from (off step times, on step times) per pair of runs."""
    off = [t for o, _ in pairs for t in o]
    on = [t for _, n in pairs for t in n]
    off_s, on_s = statistics.median(off), statistics.median(on)
    return Overhead(off_s, on_s, on_s / off_s, [statistics.median(n) / statistics.median(o) for o, n in pairs])


def agent_activated(output: str) -> bool:
    """Whether a run's output holds the agent's start line (RANKSCOPE_DEBUG=1)."""
    return re.search(r"^rankscope agent: active in rank", output, re.M) is not None


@dataclasses.dataclass(frozen=True)
class FrSummary:
    entries: int  # NCCL entries of the flight recorder
    completed: int
    timed: int  # completed entries with a duration
    durations_ms: list[float]


def fr_summary(traces: Iterable[dict[str, Any]]) -> FrSummary:
    """NCCL entries of flight-recorder dumps (unpickled): how many completed, how many carry duration_ms."""
    unique: dict[tuple[Any, ...], dict[str, Any]] = {}  # two dump functions may list the same recorder's entries
    for trace in traces:
        for e in trace.get("entries", ()):
            if str(e.get("profiling_name", "")).startswith("nccl:"):
                group = e.get("process_group") or ("",)
                key = (str(group[0]), e.get("collective_seq_id"), e.get("p2p_seq_id"), e.get("record_id"), e.get("time_created_ns"))
                unique[key] = e
    entries = list(unique.values())
    done = [e for e in entries if e.get("state") == "completed"]
    durations = [float(e["duration_ms"]) for e in done if isinstance(e.get("duration_ms"), (int, float))]
    return FrSummary(len(entries), len(done), len(durations), durations)


def fmt(x: float, digits: int = 3) -> str:
    return f"{x:,.{digits}f}"


# --- children: the parts that run in a CUDA process of their own ------------------------------------


def _emit(rows: Iterator[Row], part: str) -> int:
    """Print each row as it is made; an exception becomes a failing row of its own."""
    try:
        for row in rows:
            print(row.line(), flush=True)
    except Exception as exc:  # noqa: BLE001 - the parent prints the table whatever happened here
        import traceback

        traceback.print_exc()
        print(failure(part, "(the rest of this part)", f"{type(exc).__name__}: {exc}").line(), flush=True)
        return 1
    return 0


def _anchor(clock: Any, torch: Any) -> None:
    """Give a fresh CudaClock its device and reference event, as the agent's background thread does."""
    import numpy as np

    token = clock.now()
    clock.calibrate()  # records the reference on a side stream
    torch.cuda.synchronize()
    clock.calibrate()  # the GPU has reached it: it is the reference now
    _, ready = clock.resolve(np.array([token], dtype=np.int64))
    if ready is not None and not ready.all():
        raise RuntimeError("the CUDA clock did not take its reference event")


def child_timing(args: argparse.Namespace) -> Iterator[Row]:
    """Part 1: the agent's CUDA clock against torch.cuda.Event, and no device sync on the hot path."""
    import numpy as np
    import torch

    from rankscope import agent as api
    from rankscope.agent.recorder import Recorder
    from rankscope.agent.state import RankState
    from rankscope.agent.timing import EVENT_LIMIT, CudaClock, TorchCuda
    from rankscope.protos.v1 import telemetry_pb2 as pb

    torch.cuda.set_device(0)
    n = args.matmul
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    for _ in range(5):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    clock = CudaClock(TorchCuda())
    _anchor(clock, torch)

    # 1a. the same kernel timed by the agent's events and by torch.cuda.Event around them
    iters = 20
    tokens: list[int] = []
    direct = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        tokens.append(clock.now())
        torch.matmul(a, b, out=c)
        tokens.append(clock.now())
        e1.record()
        direct.append((e0, e1))
    torch.cuda.synchronize()
    events = all(0 < t < EVENT_LIMIT for t in tokens)
    ns, ready = clock.resolve(np.array(tokens, dtype=np.int64))
    resolved = ready is None or bool(ready.all())
    agent_ms = [(int(ns[2 * i + 1]) - int(ns[2 * i])) / 1e6 for i in range(iters)]
    direct_ms = [e0.elapsed_time(e1) for e0, e1 in direct]
    ratios = [x / y for x, y in zip(agent_ms, direct_ms)]
    med_agent, med_direct = statistics.median(agent_ms), statistics.median(direct_ms)
    worst = max(ratios, key=lambda r: abs(r - 1))
    ok = events and resolved and relative(med_agent, med_direct) <= 0.03
    yield Row(
        "1", f"{n}x{n}x{n} bf16 matmul timed by the agent's CUDA event pool (median of {iters})", fmt(med_agent), "ms", ok,
        f"torch.cuda.Event around the same kernel {fmt(med_direct)} ms; agent/direct {med_agent / med_direct:.4f} "
        f"(worst {worst:.4f}; check: within 3%); {2 * n**3 / (med_direct / 1e3) / 1e12:,.0f} TFLOP/s"
        + ("" if events else "; the clock fell back to CPU tokens") + ("" if resolved else "; tokens left unresolved"),
    )  # fmt: skip

    # 1b. the cost of a span through the public API, agent on (CUDA clock) and off
    rec = Recorder(clock, RankState())
    spans = args.spans

    def per_span() -> float:
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(spans):
                with api.span("forward", step=1, microbatch=0):
                    pass
            best = min(best, (time.perf_counter_ns() - t0) / spans)
            torch.cuda.synchronize()
            list(rec.drain())  # gives the event slots back to the pool
        return best

    api._may_start = False
    api._attach(None)
    off_ns = per_span()
    api._attach(rec)
    try:
        on_ns = per_span()
    finally:
        api._attach(None)
    cost_us = (on_ns - off_ns) / 1e3
    yield Row("1", f"a span through rankscope.agent.span on the CUDA clock, on minus off (best of 5 x {spans})",
              f"{cost_us:.2f}", "us/span", cost_us < 30,
              f"on {on_ns / 1e3:.2f} us, off {off_ns / 1e3:.2f} us (two CUDA event records per span); check: under 30 us")  # fmt: skip

    # 1b, continued: what one token costs, the clock's torch.Event against torch.cuda.Event, which it recorded
    # until 2026-11 (its record() builds a Python Stream object for the current stream first)
    cuda_events = [torch.cuda.Event(enable_timing=True) for _ in range(spans)]
    token_ns, cuda_event_ns = math.inf, math.inf
    for _ in range(5):
        t0 = time.perf_counter_ns()
        taken = [clock.now() for _ in range(spans)]
        token_ns = min(token_ns, (time.perf_counter_ns() - t0) / spans)
        t0 = time.perf_counter_ns()
        for event in cuda_events:
            event.record()
        cuda_event_ns = min(cuda_event_ns, (time.perf_counter_ns() - t0) / spans)
        torch.cuda.synchronize()
        clock.resolve(np.array(taken, dtype=np.int64))  # gives the slots back
    yield Row("1", f"a CUDA token (clock.now(): a torch.Event record on the current stream; best of 5 x {spans})",
              f"{token_ns / 1e3:.2f}", "us", token_ns < cuda_event_ns,
              f"torch.cuda.Event.record() {cuda_event_ns / 1e3:.2f} us, ratio {token_ns / cuda_event_ns:.2f}; "
              "check: cheaper than torch.cuda.Event")  # fmt: skip

    # 1c. no device sync on the hot path: spans taken while the GPU works through queued matmuls
    # (few big ones: a long launch queue could itself make the CPU wait)
    del a, b, c
    big = [torch.randn(2 * n, 2 * n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.matmul(big[0], big[1], out=big[2])
    e1.record()
    torch.cuda.synchronize()
    big_ms = e0.elapsed_time(e1)
    busy = max(1, math.ceil(args.busy_ms / big_ms))
    for _ in range(busy):
        torch.matmul(big[0], big[1], out=big[2])
    marker = torch.cuda.Event()
    marker.record()
    fallbacks = clock.fallbacks
    count = 200  # few: event records queued behind the matmuls must not fill the launch queue
    api._attach(rec)
    raised = ""
    torch.cuda.set_sync_debug_mode("error")  # an implicit synchronisation raises instead of waiting
    try:
        t0 = time.perf_counter_ns()
        for i in range(count):
            with api.span("forward", step=2, microbatch=i):
                pass
        hot_ns = time.perf_counter_ns() - t0
    except RuntimeError as exc:
        hot_ns, raised = time.perf_counter_ns() - t0, str(exc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        api._attach(None)
    gpu_busy = not marker.query()
    torch.cuda.synchronize()
    rows = 0
    for batch in rec.drain():
        if isinstance(batch, pb.SpanBatch):
            start, end = np.frombuffer(batch.start_ns, "<i8"), np.frombuffer(batch.end_ns, "<i8")
            rows += int(((start > 0) & (end >= start)).sum())
    fell_back = clock.fallbacks - fallbacks
    ok = gpu_busy and not raised and fell_back == 0 and rows == count
    note = [
        f"{count} spans took {hot_ns / 1e6:.2f} ms of CPU while {busy} queued matmuls (~{busy * big_ms:.0f} ms) ran",
        "the GPU was still busy after them" if gpu_busy else "the GPU had finished before them: they waited for it",
        f"sync debug mode 'error' raised {raised!r}" if raised else "sync debug mode 'error' raised nothing",
        f"{rows}/{count} spans resolved after the GPU finished",
    ]
    if fell_back:
        note.append(f"{fell_back} tokens fell back to the CPU clock")
    yield Row("1", "no CUDA synchronisation on the hot path (spans while the GPU is busy)",
              f"{hot_ns / count / 1e3:.2f}", "us/span", ok, "; ".join(note))  # fmt: skip


def child_nccl(args: argparse.Namespace) -> Iterator[Row]:
    """Part 2: NCCL collectives recorded by the agent with GPU start/end times; flight-recorder timing."""
    import torch
    import torch.distributed as dist

    from rankscope.agent import collective_patches

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        try:
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
        except TypeError:  # a torch without device_id
            dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            yield from _nccl_checks(args)
        finally:
            collective_patches.uninstall()
            dist.destroy_process_group()


def _nccl_checks(args: argparse.Namespace) -> Iterator[Row]:
    import pickle

    import numpy as np
    import torch
    import torch.distributed as dist

    from rankscope.agent import collective_patches
    from rankscope.agent.collective_tracker import Collectives
    from rankscope.agent.process_groups import Groups
    from rankscope.agent.recorder import COMPLETED, Recorder
    from rankscope.agent.state import RankState
    from rankscope.agent.timing import CudaClock, TorchCuda
    from rankscope.protos.v1 import telemetry_pb2 as pb

    x = torch.ones(args.nccl_mib * 2**20 // 4, device="cuda")
    clock = CudaClock(TorchCuda())
    _anchor(clock, torch)
    rec = Recorder(clock, RankState())
    collectives = Collectives(rec, Groups())
    collective_patches.install(collectives)  # before the group's first collective: no gap to fill from the flight recorder
    n = 10
    dist.all_reduce(x)  # the communicator's first use
    torch.cuda.synchronize()
    works = [dist.all_reduce(x, async_op=True) for _ in range(n)]  # completion callbacks
    for w in works:
        w.wait()
    for _ in range(n):
        dist.all_reduce(x)  # blocking: completed when its wait returns
    torch.cuda.synchronize()
    collective_patches.uninstall()
    clock.calibrate()  # what the agent's background thread does before it drains (runtime.Agent.tick)
    collectives.poll()

    # 2a. the agent's rows
    starts, ends, states = [], [], []
    for batch in rec.drain():
        if isinstance(batch, pb.CollectiveBatch):
            starts += np.frombuffer(batch.start_ns, "<i8").tolist()
            ends += np.frombuffer(batch.end_ns, "<i8").tolist()
            states += np.frombuffer(batch.state, "u1").tolist()
    good = sum(1 for s, e, st in zip(starts, ends, states) if st == COMPLETED and s > 0 and e >= s)
    durations_us = [(e - s) / 1e3 for s, e in zip(starts, ends) if e >= s > 0]
    total = 2 * n + 1
    yield Row("2", f"NCCL all_reduce rows recorded by the agent (1 rank, {args.nccl_mib} MiB; {n} async, {n + 1} blocking)",
              f"{good}/{total}", "rows", good == total and len(starts) == total,
              f"{len(starts)} rows; check: every one completed, with start > 0 and end >= start")  # fmt: skip

    # 2b. their durations against NCCL's own timing of the async ones
    nccl_us: list[float] = []
    why = ""
    for w in works:
        try:
            nccl_us.append(float(w._get_duration()) * 1e3)
        except Exception as exc:  # noqa: BLE001 - reported in the note
            why = f"Work._get_duration(): {type(exc).__name__}: {exc}"
            break
    if durations_us:
        med = statistics.median(durations_us)
        if nccl_us:
            ref = statistics.median(nccl_us)
            ok = med > 0 and 0.8 * ref - 5 <= med <= 2 * ref + 200
            note = (f"NCCL's own (Work._get_duration, async ones) {ref:.1f} us; agent/NCCL {med / ref if ref else math.inf:.2f}; "
                    "check: 0.8x NCCL - 5 us <= agent <= 2x NCCL + 200 us (the agent's events bracket the kernel on "
                    "the issuing and the completion stream)")  # fmt: skip
        else:
            ok = 0 < med < 1e6
            note = f"no NCCL figure to compare with ({why or 'none'}); check: 0 < duration < 1 s"
        yield Row("2", "NCCL all_reduce duration from the agent's CUDA events (median)", f"{med:.1f}", "us", ok,
                  f"min {min(durations_us):.1f}, max {max(durations_us):.1f} us; {note}")  # fmt: skip
    else:
        yield failure("2", "NCCL all_reduce duration from the agent's CUDA events", "the agent recorded no timed rows")

    # 2c. torch's flight recorder with TORCH_NCCL_ENABLE_TIMING=1: the watchdog marks entries completed
    c10d = torch._C._distributed_c10d
    dumps = [getattr(c10d, name) for name in ("_dump_nccl_trace", "_dump_fr_trace") if hasattr(c10d, name)]

    def read() -> list[dict[str, Any]]:
        traces = []
        for dump in dumps:
            try:
                raw = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
            except TypeError:
                raw = dump()
            traces.append(pickle.loads(raw))
        return traces

    deadline = time.monotonic() + 10
    summary = fr_summary(read())
    while time.monotonic() < deadline and (summary.entries == 0 or summary.timed < summary.entries):
        time.sleep(0.2)
        summary = fr_summary(read())
    timing = os.environ.get("TORCH_NCCL_ENABLE_TIMING", "")
    med = f"median {statistics.median(summary.durations_ms) * 1e3:.1f} us" if summary.durations_ms else "no durations"
    yield Row("2", f"flight recorder, TORCH_NCCL_ENABLE_TIMING={timing}: NCCL entries with a duration",
              f"{summary.timed}/{summary.entries}", "entries",
              summary.entries >= total and summary.timed == summary.completed == summary.entries,
              f"{summary.completed} completed; {med}; check: every entry of the {total} all_reduces completed with duration_ms")  # fmt: skip

    # 2d. the agent's reader of the flight recorder (how it fills in DDP's and compiled graphs' collectives)
    dump = collectives.fr.read()
    mine = [e for e in (dump.entries if dump else []) if e.op == "all_reduce" and not e.p2p]
    ended = [e for e in mine if dump is not None and dump.done(e) and e.end_ns > 0]
    ordered = [e for e in ended if 0 < e.start_ns <= e.end_ns]
    yield Row("2", "the agent's flight-recorder reader on NCCL: all_reduce entries done with an end time / also a start <= end",
              f"{len(ended)}/{len(mine)} / {len(ordered)}/{len(mine)}", "entries", bool(mine) and len(ordered) == len(mine),
              "start and end from time_discovered_started_ns / time_discovered_completed_ns, which NCCL's watchdog and "
              "the dump itself set when they find the events passed; check: every entry has both, in order")  # fmt: skip


def child_trainer(argv: list[str]) -> int:
    """One training rank (the environment holds RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    from rankscope.trainer.train import main as train_main

    return train_main(argv)


def child_cli(argv: list[str]) -> int:
    """The ``rankscope`` command line (the collector of part 3)."""
    from rankscope.cli.main import main as cli_main

    return cli_main(argv)


def run_as_child(argv: list[str]) -> int:
    """``gpu_check.py --child KIND ...``: one part (or a trainer rank, or the collector) in this process."""
    bootstrap()
    kind, rest = argv[0], argv[1:]
    if kind == "trainer":
        return child_trainer(rest)
    if kind == "cli":
        return child_cli(rest)
    args = build_parser().parse_args(rest)
    if kind == "timing":
        return _emit(child_timing(args), "1")
    if kind == "nccl":
        return _emit(child_nccl(args), "2")
    print(f"gpu_check.py: unknown child {kind!r}", file=sys.stderr)
    return 2


# --- the parent: parts 1 and 2 through children, 3 and 4 through trainer runs ------------------------


class PartFailed(Exception):
    """A part could not finish; the message is its row's note."""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without the agent's variables or a launcher's rank identity, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_") and k not in _CHILD_DROPS}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_child(argv: list[str], env: dict[str, str], timeout_s: float, log: Path) -> tuple[int | None, str]:
    """Run ``gpu_check.py --child ARGV`` in a session of its own; (exit status or None on timeout, output)."""
    from rankscope.harness.orchestration import start, stop

    proc = start([sys.executable, str(SCRIPT), "--child", *argv], log, env)
    try:
        code: int | None = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc, 10)
        code = None
    except BaseException:  # Ctrl-C: the child lives in a session of its own, stop it too
        stop(proc, 10)
        raise
    output = log.read_text(errors="replace")
    if code != 0:  # its log goes with the temporary directory: show its end now
        tail = "\n".join(output.splitlines()[-40:])
        print(f"-- {argv[0]} child {'timed out' if code is None else f'exited {code}'}; the end of its output:\n{tail}\n--",
              file=sys.stderr, flush=True)  # fmt: skip
    return code, output


def part_child(part: str, kind: str, args: argparse.Namespace, workdir: Path, env: dict[str, str]) -> list[Row]:
    """Parts 1 and 2: a child prints its rows; a crash or timeout adds a failing row."""
    passed = [f"--matmul={args.matmul}", f"--spans={args.spans}", f"--busy-ms={args.busy_ms}", f"--nccl-mib={args.nccl_mib}"]
    code, output = run_child([kind, *passed], env, args.part_timeout, workdir / f"part{part}.log")
    rows = parse_rows(output)
    if code is None:
        rows.append(failure(part, f"part {part}", f"timed out after {args.part_timeout:.0f} s"))
    elif code != 0 and all(r.ok is not False for r in rows):
        rows.append(failure(part, f"part {part}", f"exit {code}: {last_error(output)}"))
    elif not rows:
        rows.append(failure(part, f"part {part}", f"no result: {last_error(output)}"))
    return rows


@dataclasses.dataclass(frozen=True)
class TrainRun:
    lines: list[dict[str, Any]]
    output: str


def train(model: dict[str, Any], steps: int, extra_env: dict[str, str], workdir: Path, name: str, timeout_s: float) -> TrainRun:
    """One 1-GPU run of the bundled trainer (rank 0 of 1, this machine's loopback as its rendezvous)."""
    from rankscope.harness.orchestration import free_port

    metrics = workdir / f"{name}.jsonl"
    argv = [*trainer_flags(model), f"--steps={steps}", f"--metrics-json={metrics}", f"--log-every={steps}"]
    env = child_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", **extra_env})  # fmt: skip
    code, output = run_child(["trainer", *argv], env, timeout_s, workdir / f"{name}.log")
    if code is None:
        raise PartFailed(f"{name}: training ran over {timeout_s:.0f} s")
    if code != 0:
        raise PartFailed(f"{name}: training failed (exit {code}): {last_error(output)}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    if len(lines) != steps:
        raise PartFailed(f"{name}: {len(lines)} of {steps} steps in its metrics")
    return TrainRun(lines, output)


class Sink:
    """Part 3 where chDB is missing: a gRPC Ingest service that acknowledges every batch and keeps
    only counts, so the agent runs as it would beside a collector (no retries, no spool) and
    what is measured is the agent alone."""

    def __init__(self) -> None:
        import threading
        from concurrent import futures

        import grpc

        from rankscope.protos.v1 import ingest_pb2, ingest_pb2_grpc

        sink = self

        class Servicer(ingest_pb2_grpc.IngestServicer):
            def Send(self, request: Any, context: Any) -> Any:
                received = time.time_ns()
                with sink._lock:
                    sink.batches += 1
                    sink.bytes += request.ByteSize()
                    sink.kinds.add(request.WhichOneof("payload") or "")
                return ingest_pb2.Ack(batch_id=request.batch_id, received_ns=received, replied_ns=time.time_ns())

        self._lock = threading.Lock()
        self.batches, self.bytes, self.kinds = 0, 0, set()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        ingest_pb2_grpc.add_IngestServicer_to_server(Servicer(), self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0)


def start_collector(workdir: Path, timeout_s: float) -> tuple[Any, str, str]:
    """(process or Sink, address, what the agent sends to): a real collector when chDB is installed."""
    from rankscope.harness.orchestration import start, stop, wait_for_address

    if importlib.util.find_spec("chdb") is None:
        sink = Sink()
        return sink, sink.address, ("a gRPC sink in this script that acknowledges every batch and stores nothing "
                                    "(chDB is not installed here)")  # fmt: skip
    log = workdir / "collector.log"
    cmd = [sys.executable, str(SCRIPT), "--child", "cli", "collector", "--store", str(workdir / "store"), "--listen", "127.0.0.1:0"]
    proc = start(cmd, log, child_env())
    try:
        address = wait_for_address(proc, log, timeout_s)
    except RuntimeError as exc:
        stop(proc, 10)
        raise PartFailed(f"the collector did not start: {last_error(str(exc))}") from None
    return proc, address, f"a local collector at {address} on an embedded chDB store (defaults: live diagnosis, --nice 10)"


@dataclasses.dataclass(frozen=True)
class Stored:
    """What the collector holds of one run."""

    spans: int
    forward: int  # forward spans with a duration
    collectives: int
    device: str
    compute_ns: dict[int, int]  # step -> forward + backward span time


def stored(address: str, run_id: str, wait_s: float = 20.0) -> Stored:
    """What the collector holds for ``run_id``, once its spans and its rank's device have arrived (or ``wait_s``)."""
    from rankscope.collector.client import Client

    params = {"run": run_id}
    found = Stored(0, 0, 0, "", {})
    deadline = time.monotonic() + wait_s
    with Client(address, timeout_s=10) as client:
        while time.monotonic() < deadline:
            spans = client.query("SELECT count() AS n, countIf(name = 'forward' AND duration_ns > 0) AS f FROM spans "
                                 "WHERE run_id = {run:String}", params).to_pylist()[0]  # fmt: skip
            colls = client.query("SELECT count() AS n FROM collectives WHERE run_id = {run:String}", params).to_pylist()[0]
            device = client.query("SELECT any(device) AS d FROM ranks FINAL WHERE run_id = {run:String}", params).to_pylist()
            steps = client.query("SELECT step, sumIf(duration_ns, name IN ('forward', 'backward')) AS ns FROM spans "
                                 "WHERE run_id = {run:String} GROUP BY step", params).to_pylist()  # fmt: skip
            found = Stored(int(spans["n"]), int(spans["f"]), int(colls["n"]), str(device[0]["d"]) if device else "",
                           {int(r["step"]): int(r["ns"]) for r in steps})  # fmt: skip
            if found.forward and found.device:
                break
            time.sleep(1.0)
    return found


def compute_share(compute_ns: dict[int, int], lines: list[dict[str, Any]], last: int) -> float | None:
    """Median over the run's ``last`` steps of (forward + backward span time) / step time; None without data."""
    shares = [compute_ns[line["step"]] / (line["step_time_s"] * 1e9) for line in lines[-last:]
              if line["step"] in compute_ns and line["step_time_s"] > 0]  # fmt: skip
    return statistics.median(shares) if shares else None


def part_overhead(args: argparse.Namespace, workdir: Path) -> list[Row]:
    """Part 3: the trainer with the agent off and on, alternating, against a local collector."""
    from rankscope.common.agent_env import agent_environment
    from rankscope.harness.orchestration import stop

    proc, address, target = start_collector(workdir, timeout_s=args.part_timeout)
    pairs: list[tuple[list[float], list[float]]] = []
    activation: list[str] = []
    last_on: tuple[str, list[dict[str, Any]]] = ("", [])
    try:
        for i, sides in enumerate(pair_order(args.pairs)):
            times: dict[bool, list[float]] = {}
            for on in sides:
                name = f"pair{i}-{'on' if on else 'off'}"
                run_id = f"gpu-check-{os.getpid()}-{name}"
                env = {**agent_environment(address, run_id, spool_dir=workdir / f"spool-{name}"), "RANKSCOPE_DEBUG": "1"} if on else {}
                print(f"   {name} ({args.steps} steps)", file=sys.stderr, flush=True)
                run = train(OVERHEAD_MODEL, args.steps, env, workdir, name, args.run_timeout)
                times[on] = step_stats(run.lines, args.warmup).step_s
                print(f"   {name}: median step {statistics.median(times[on]) * 1e3:.2f} ms", file=sys.stderr, flush=True)
                if agent_activated(run.output) != on:
                    activation.append(f"{name}: agent {'did not start' if on else 'started'}")
                if on:
                    last_on = (run_id, run.lines)
            pairs.append((times[False], times[True]))
        result = overhead(pairs)
        reached = _reached(proc, address, last_on, workdir)
    finally:
        if isinstance(proc, Sink):
            proc.stop()
        else:
            stop(proc, 15)
    measured = f"{args.steps - args.warmup} steps after {args.warmup} warm-up x {args.pairs} runs"
    spread = f"{min(result.pair_ratios):.3f}-{max(result.pair_ratios):.3f}"
    rows = [
        Row("3", "trainer step time, agent off (median)", fmt(result.off_s * 1e3, 2), "ms", None,
            f"GPT {describe(OVERHEAD_MODEL)}; {measured}"),
        Row("3", "trainer step time, agent on (median)", fmt(result.on_s * 1e3, 2), "ms", None, f"RANKSCOPE_ENABLE=1, {target}"),
        Row("3", "the agent's cost: step time on / off", f"{result.ratio:.3f}", "x",
            result.ratio <= OVERHEAD_GOAL and not activation,
            f"pairs {spread} (off first in even pairs, on first in odd); check: <= {OVERHEAD_GOAL} (the agent's goal)"
            + (f"; {'; '.join(activation)}" if activation else "")),
        reached,
    ]  # fmt: skip
    return rows


def _reached(proc: Any, address: str, last_on: tuple[str, list[dict[str, Any]]], workdir: Path) -> Row:
    """What of the last on-run reached the collector (or, without one, the sink)."""
    if isinstance(proc, Sink):
        spooled = sum(p.stat().st_size for d in workdir.glob("spool-*") for p in d.rglob("*") if p.is_file())
        ok = proc.batches > 0 and {"spans", "end"} <= proc.kinds
        return Row("3", "the on-runs' batches at the sink (no collector here)", f"{proc.batches:,}", "batches", ok,
                   f"{proc.bytes / 1024:,.0f} KiB, kinds {', '.join(sorted(proc.kinds))}; {spooled / 1024:,.0f} KiB spooled; "
                   "check: spans and every run's end arrived")  # fmt: skip
    run_id, lines = last_on
    try:
        got = stored(address, run_id)
    except Exception as exc:  # noqa: BLE001 - reported as the row's reason
        return failure("3", "the last on-run at the collector", f"query failed: {type(exc).__name__}: {exc}")
    share = compute_share(got.compute_ns, lines, 10)
    covered = f"{100 * share:.0f}%" if share is not None else "n/a"
    return Row("3", "the last on-run at the collector: spans (forward spans with a duration)", f"{got.spans} ({got.forward})",
               "rows", got.forward > 0 and got.device.startswith("cuda"),
               f"device {got.device or 'unknown'}; {got.collectives} collectives (a 1-GPU trainer skips groups of one); "
               f"forward + backward spans cover {covered} of the step time over its last 10 steps (GPU time once the "
               "agent's clock has switched to CUDA events); check: forward spans timed, a CUDA device")  # fmt: skip


def part_mfu(args: argparse.Namespace, workdir: Path, device_name: str) -> list[Row]:
    """Part 4: tokens/s and MFU of a ~1B GPT on one GPU, as rankscope/trainer/flops.py counts them."""
    from rankscope.trainer import flops
    from rankscope.trainer.model import count_parameters

    margs = model_args(MFU_MODEL)
    params = count_parameters(margs)
    per_token = flops.flops_per_token(margs)
    rows = [Row("4", "GPT parameters (rankscope/trainer/flops.py: count_parameters)", f"{params:,}", "params", 0.9e9 <= params <= 1.3e9,
                f"{describe(MFU_MODEL)}; {per_token / 1e9:.2f} GFLOP per token (6N + 12LHQT); check: ~1B")]  # fmt: skip
    print(f"   GPT {params / 1e9:.2f}B ({args.mfu_steps} steps)", file=sys.stderr, flush=True)
    run = train(MFU_MODEL, args.mfu_steps, {}, workdir, "mfu", args.run_timeout)
    stats = step_stats(run.lines, args.mfu_warmup)
    peak = flops.peak_flops(device_name)
    step_ms = statistics.median(stats.step_s) * 1e3
    rows.append(Row("4", "training throughput, bf16 autocast with fp32 weights and AdamW (the trainer's own dtype)",
                    fmt(stats.tokens_per_s, 0), "tokens/s", stats.tokens_per_s > 0,
                    f"median step {step_ms:,.1f} ms over {stats.steps} steps after {args.mfu_warmup} warm-up; "
                    f"{MFU_MODEL['global_batch'] * MFU_MODEL['seq']:,} tokens per step"))  # fmt: skip
    if peak is None:
        rows.append(Row("4", "MFU", "n/a", "%", None, f"rankscope/trainer/flops.py knows no bf16 peak for {device_name!r}"))
        return rows
    mfu = flops.mfu(stats.tokens_per_s, margs, 1, peak)
    assert mfu is not None
    own = stats.mfu
    agree = own is not None and abs(own - mfu) <= 0.005
    said = f"the trainer's own figure {100 * own:.1f}%" if own is not None else "the trainer reported no MFU"
    rows.append(Row("4", f"MFU against {device_name}'s dense bf16 peak ({peak / 1e12:.0f} TFLOP/s)", f"{100 * mfu:.1f}", "%",
                    0.05 <= mfu <= 0.8 and agree,
                    f"{said}; {mfu * peak / 1e12:.0f} TFLOP/s achieved; check: 5-80% and the trainer's figure agrees"))  # fmt: skip
    return rows


def guarded(part: str, make: Callable[[], list[Row]]) -> list[Row]:
    """A part's rows, or one failing row with the reason."""
    try:
        return make()
    except PartFailed as exc:
        return [failure(part, f"part {part}", str(exc))]
    except Exception as exc:  # noqa: BLE001 - the table prints whatever happened
        return [failure(part, f"part {part}", f"{type(exc).__name__}: {exc}")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run, comma-separated (1 timing, 2 NCCL, 3 agent cost, 4 MFU)")
    parser.add_argument("--pairs", type=int, default=3, help="part 3: pairs of trainer runs, agent off and on")
    parser.add_argument("--steps", type=int, default=40, help="part 3: steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="part 3: first steps of each run left out")
    parser.add_argument("--mfu-steps", type=int, default=8, help="part 4: steps of the ~1B run")
    parser.add_argument("--mfu-warmup", type=int, default=3, help="part 4: first steps left out")
    parser.add_argument("--matmul", type=int, default=8192, help="part 1: size of the timed square bf16 matmul")
    parser.add_argument("--spans", type=int, default=2000, help="part 1: spans per timing of the span cost")
    parser.add_argument("--busy-ms", type=float, default=300.0, help="part 1: GPU work queued while spans are taken")
    parser.add_argument("--nccl-mib", type=int, default=64, help="part 2: all_reduce size in MiB")
    parser.add_argument("--part-timeout", type=float, default=180.0, help="seconds a part 1/2 child or the collector may take")
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds one trainer run may take")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return run_as_child(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(f"make gpu-check needs a CUDA GPU and PyTorch: torch cannot be imported ({exc})", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print(REFUSAL, file=sys.stderr)
        return 1
    origin = bootstrap()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or args.warmup >= args.steps or args.mfu_warmup >= args.mfu_steps or args.pairs < 1:
        print("gpu_check.py: error: --parts takes 1-4; warm-up steps must be fewer than the steps; --pairs at least 1", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0)
    import rankscope

    caption = (f"gpu-check: {device_name}, torch {torch.__version__} (CUDA {torch.version.cuda}), Python "
               f"{sys.version.split()[0]}, rankscope {rankscope.__version__} ({origin}: {Path(rankscope.__file__).parent.parent})")  # fmt: skip
    rows: list[Row] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rankscope-gpu-check-") as tmp:
        workdir = Path(tmp)
        for part in parts:
            print(f"== part {part}: {PARTS[part]} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
            if part == "1":
                rows += guarded(part, lambda: part_child("1", "timing", args, workdir, child_env()))
            elif part == "2":
                env = child_env({"TORCH_NCCL_ENABLE_TIMING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000"})
                rows += guarded(part, lambda: part_child("2", "nccl", args, workdir, env))
            elif part == "3":
                rows += guarded(part, lambda: part_overhead(args, workdir))
            else:
                rows += guarded(part, lambda: part_mfu(args, workdir, device_name))
    print(f"{caption}; {time.monotonic() - started:.0f} s")
    print(format_table(rows), flush=True)
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
