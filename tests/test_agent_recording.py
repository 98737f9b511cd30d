"""The agent's hot path in one process: recorder columns, string tables, segment splitting,
drops, timing (CPU and, through a fake GPU, CUDA events), automatic spans, OpenTelemetry spans
and the public API, on and off."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import pickle
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from conftest import ProcRunner
from rankscope import agent
from rankscope.agent.autospans import AutoSpans
from rankscope.agent.flight_recorder import FlightRecorder
from rankscope.agent.recorder import Recorder, StringTable
from rankscope.agent.state import RankState
from rankscope.agent.timing import EVENT_LIMIT, WALL_MIN, CpuClock, CudaClock
from rankscope.protos.v1 import telemetry_pb2 as pb


def recorder(**kwargs: Any) -> Recorder:
    return Recorder(CpuClock(), RankState(), **kwargs)


def span_rows(rec: Recorder) -> list[dict[str, Any]]:
    """Every span the recorder hands over, decoded from its columnar batches."""
    rows = []
    for batch in rec.drain():
        if not isinstance(batch, pb.SpanBatch):
            continue
        strings = list(batch.strings)
        cols = {
            "name": np.frombuffer(batch.name, "<i4"), "kind": np.frombuffer(batch.kind, "u1"),
            "step": np.frombuffer(batch.step, "<i4"), "mb": np.frombuffer(batch.microbatch, "<i4"),
            "start": np.frombuffer(batch.start_ns, "<i8"), "end": np.frombuffer(batch.end_ns, "<i8"),
            "attrs": np.frombuffer(batch.attributes, "<i4"), "cpu": np.frombuffer(batch.cpu_ns, "<i8"),
        }  # fmt: skip
        assert all(len(c) == batch.count for c in cols.values())
        for i in range(batch.count):
            row = {k: int(v[i]) for k, v in cols.items()}
            row["name"] = strings[row["name"]]
            row["attrs"] = json.loads(strings[row["attrs"]]) if row["attrs"] >= 0 else None
            rows.append(row)
    return rows


def test_a_span_arrives_as_one_row_of_columns() -> None:
    rec = recorder()
    rec.set_step(4)
    before = time.time_ns()
    with rec.span("forward", "compute", None, 2, {"layer": 1}):
        time.sleep(0.002)
    with rec.span("load", "data", 9, None, {}):
        pass
    after = time.time_ns()
    forward, load = span_rows(rec)
    assert forward["name"] == "forward" and forward["kind"] == pb.SPAN_KIND_COMPUTE
    assert (forward["step"], forward["mb"], forward["attrs"]) == (4, 2, {"layer": 1})
    assert before <= forward["start"] and forward["start"] + 2_000_000 <= forward["end"] <= after
    assert (load["name"], load["kind"], load["step"], load["mb"], load["attrs"]) == ("load", pb.SPAN_KIND_DATA, 9, -1, None)
    assert rec.state.phase == "idle" and span_rows(rec) == []


def test_each_batch_carries_only_the_strings_it_uses() -> None:
    table = StringTable()
    ids = np.array([table.id(s) for s in ("a", "b", "c", "b")], dtype="<i4")
    strings, (local,) = table.local(ids[1:])
    assert strings == ["b", "c"] and local.tolist() == [0, 1, 0]
    strings, (names, attrs) = table.local(ids[:1], np.array([-1, ids[2]], dtype="<i4"))
    assert strings == ["a", "c"] and names.tolist() == [0] and attrs.tolist() == [-1, 1]


def test_the_string_table_is_bounded() -> None:
    table = StringTable(limit=3)
    ids = [table.id(f"attr-{i}") for i in range(5)]
    assert ids[:3] == [0, 1, 2] and ids[3] == ids[4] and table.text(ids[4]) == StringTable.OVERFLOW


def test_a_wait_splits_every_open_non_comm_span_around_it() -> None:
    rec = recorder()
    with rec.span("forward", "compute", 1, 0, {"layer": 3}):
        with rec.span("attention", "compute", 1, 0, {}):
            with rec.span("exchange", "comm", 1, None, {}):
                for _ in range(2):  # two blocking collectives inside
                    paused = rec.pause()
                    time.sleep(0.01)
                    rec.resume(paused)
    rows = span_rows(rec)
    pieces = {name: sorted((r for r in rows if r["name"] == name), key=lambda r: r["start"]) for name in ("forward", "attention")}
    for name, parts in pieces.items():
        assert [p["attrs"]["part"] for p in parts] == [0, 1, 2], name
        for a, b in zip(parts, parts[1:]):
            assert b["start"] - a["end"] >= 10_000_000  # the waits are outside every piece
    assert pieces["forward"][0]["attrs"] == {"layer": 3, "part": 0}
    (exchange,) = [r for r in rows if r["name"] == "exchange"]
    assert exchange["attrs"] is None and exchange["end"] - exchange["start"] >= 20_000_000  # comm keeps its waits


def test_cpu_time_counts_work_on_the_spans_own_thread_only() -> None:
    rec = recorder()
    rec.measure_cpu = True  # as on a host whose ranks share cores
    with rec.span("load", "data", 1, None, {}):
        time.sleep(0.05)
    with rec.span("backward", "compute", 1, None, {}):
        paused = rec.pause()  # a wait on this thread ends piece 0
        resumer = threading.Thread(target=rec.resume, args=(paused,))  # ... and returns on an autograd worker
        resumer.start()
        resumer.join()
    rows = {(r["name"], (r["attrs"] or {}).get("part")): r for r in span_rows(rec)}
    load = rows["load", None]
    assert 0 <= load["cpu"] < (load["end"] - load["start"]) // 2  # sleeping is no work
    assert rows["backward", 0]["cpu"] >= 0
    assert rows["backward", 1]["cpu"] == -1  # the worker's CPU clock says nothing about this thread's


def test_a_span_can_end_on_another_thread() -> None:
    rec = recorder()
    span = rec.span("backward", "compute", 1, None, {})
    span.__enter__()
    assert rec.state.phase == "backward"
    ender = threading.Thread(target=span.__exit__, args=(None, None, None))
    ender.start()
    ender.join()
    assert [r["name"] for r in span_rows(rec)] == ["backward"]
    assert rec.state.phase == "idle" and rec._main_stack == []


def test_full_buffers_drop_and_count_instead_of_waiting() -> None:
    rec = recorder(capacity=8)
    started = time.perf_counter()
    for i in range(20):
        rec.add_span(rec.strings.id("s"), 0, i, -1, 1, 2, -1)
    assert time.perf_counter() - started < 0.1
    assert rec.state.dropped == 12
    assert [r["step"] for r in span_rows(rec)] == list(range(8))
    rec.add_span(rec.strings.id("s"), 0, 99, -1, 1, 2, -1)
    assert [r["step"] for r in span_rows(rec)] == [99]


def test_concurrent_writers_lose_and_tear_nothing() -> None:
    rec = recorder(capacity=1 << 16)

    def write(thread: int) -> None:
        for i in range(4000):
            with rec.span(f"t{thread}", "compute", i, thread, {}):
                pass

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = span_rows(rec)
    assert len(rows) == 16000 and rec.state.dropped == 0
    assert all(r["name"] == f"t{r['mb']}" for r in rows)  # every row whole
    steps = collections.defaultdict(list)
    for r in rows:
        steps[r["mb"]].append(r["step"])
    assert {t: sorted(s) for t, s in steps.items()} == {t: list(range(4000)) for t in range(4)}


def test_a_filling_buffer_asks_for_a_flush() -> None:
    rec = recorder(flush_rows=10)
    for _ in range(9):
        rec.add_span(rec.strings.id("s"), 0, 1, -1, 1, 2, -1)
    assert not rec.wake.is_set()
    rec.add_span(rec.strings.id("s"), 0, 1, -1, 1, 2, -1)
    assert rec.wake.is_set()


def test_rows_are_cut_into_batches() -> None:
    rec = recorder(batch_rows=4)
    for _ in range(10):
        rec.add_span(rec.strings.id("s"), 0, 1, -1, 1, 2, -1)
    assert [b.count for b in rec.drain()] == [4, 4, 2]


def test_scalars_keep_nan_and_read_tensors_off_the_hot_path() -> None:
    rec = recorder()
    now = rec.clock.wall_ns()
    given = {"loss": 2.5, "nan": math.nan, "inf": math.inf, "t": torch.tensor(3.0), "np": np.int64(7), "junk": "x"}
    for name, value in given.items():
        rec.add_scalar(5, rec.strings.id(name), value, now)
    (batch,) = list(rec.drain())
    values = dict(zip((batch.strings[i] for i in np.frombuffer(batch.name, "<i4")), np.frombuffer(batch.value, "<f8")))
    assert values["loss"] == 2.5 and values["inf"] == math.inf and values["t"] == 3.0 and values["np"] == 7.0
    assert math.isnan(values["nan"]) and math.isnan(values["junk"])
    assert set(np.frombuffer(batch.step, "<i4")) == {5} and set(np.frombuffer(batch.time_ns, "<i8")) == {now}


def test_tensor_scalars_are_bounded_and_keep_no_autograd_graph() -> None:
    rec = recorder(capacity=2)
    weight = torch.ones(1, requires_grad=True)
    for _ in range(3):
        rec.add_scalar(1, rec.strings.id("loss"), (weight * 2).sum(), 0)
    assert rec.state.dropped == 1 and all(value.grad_fn is None for _, _, value, _ in rec._deferred)
    (batch,) = list(rec.drain())
    assert np.frombuffer(batch.value, "<f8").tolist() == [2.0, 2.0]


def test_the_step_timeline_dates_late_events() -> None:
    rec = recorder()
    t0 = rec.clock.wall_ns()
    rec.set_step(1)
    time.sleep(0.001)
    t1 = rec.clock.wall_ns()
    rec.set_step(2)
    assert [rec.step_at(t) for t in (t0 - 1, t1, rec.clock.wall_ns())] == [0, 1, 2]


def test_the_cpu_clock_is_monotonic_and_resolves_to_the_wall_clock() -> None:
    clock = CpuClock()
    before = time.time_ns()
    ticks = np.array([clock.now() for _ in range(1000)] + [0, WALL_MIN + 5], dtype="<i8")
    after = time.time_ns()
    assert (np.diff(ticks[:1000]) >= 0).all() and EVENT_LIMIT < ticks[0] < WALL_MIN
    values, ready = clock.resolve(ticks)
    # within the wall-clock times around the ticks (a starved test may be descheduled between them)
    assert ready is None and before - 5_000_000 < int(values[0]) <= int(values[999]) < after + 5_000_000
    assert before - 5_000_000 < clock.wall_ns() and clock.wall_ns() < time.time_ns() + 5_000_000
    assert values[-2:].tolist() == [0, WALL_MIN + 5]  # unknown stays unknown, wall-clock stays as it is


# --- CUDA timing, on a fake GPU ------------------------------------------------------------------


class FakeGpu:
    """CudaApi: events take the GPU's current time when recorded and complete when it ``runs``."""

    def __init__(self) -> None:
        self.time_ms = 0.0
        self.capture = False
        self.recorded: list[FakeEvent] = []

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def capturing(self) -> bool:
        return self.capture

    def current_device(self) -> int:
        return 0

    def side_stream(self, device: int) -> str:
        return f"side:{device}"

    def on_device(self, device: int) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def run(self) -> None:
        for e in self.recorded:
            e.complete = True


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu, self.at_ms, self.complete = gpu, 0.0, False

    def record(self, stream: Any = None) -> None:
        self.at_ms, self.complete = self.gpu.time_ms, False
        self.gpu.recorded.append(self)

    def query(self) -> bool:
        return self.complete

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.complete and end.complete
        return end.at_ms - self.at_ms


class FixedCpu:
    """A CPU clock that says what the test sets."""

    def __init__(self) -> None:
        self.ns = 1_800_000_000_000_000_000

    def now(self) -> int:
        return self.ns

    wall_ns = now

    def resolve(self, tokens: np.ndarray) -> tuple[np.ndarray, None]:
        return tokens, None

    def calibrate(self) -> None:
        pass


def calibrated(gpu: FakeGpu, cpu: FixedCpu, clock: CudaClock, gpu_ms: float) -> None:
    """Record the reference at GPU time ``gpu_ms`` (= cpu.ns) and let the GPU reach everything."""
    gpu.time_ms = gpu_ms
    clock.calibrate()
    gpu.run()
    clock.calibrate()


def test_cuda_tokens_resolve_only_once_the_gpu_has_passed_them() -> None:
    gpu, cpu = FakeGpu(), FixedCpu()
    clock = CudaClock(gpu, pool_size=4, cpu=cpu)  # type: ignore[arg-type]
    gpu.time_ms = 100.0
    token = clock.now()
    assert 0 < token < EVENT_LIMIT
    values, ready = clock.resolve(np.array([token, 0, cpu.ns], dtype="<i8"))
    assert ready is not None and ready.tolist() == [False, True, True]  # no reference yet; 0 and ns need none
    gpu.time_ms = 150.0
    clock.calibrate()  # the reference is recorded, the GPU has not reached it
    assert clock.resolve(np.array([token]))[1].tolist() == [False]
    gpu.run()
    clock.calibrate()
    values, ready = clock.resolve(np.array([token], dtype="<i8"))
    assert ready.tolist() == [True] and values.tolist() == [cpu.ns - 50_000_000]  # 50 ms before the reference
    assert clock.done(token) and len(clock._free) == 4  # the slot is back in the pool


def test_cuda_clock_falls_back_to_cpu_time_rather_than_wait_or_break_a_capture() -> None:
    gpu, cpu = FakeGpu(), FixedCpu()
    clock = CudaClock(gpu, pool_size=2, cpu=cpu)  # type: ignore[arg-type]
    gpu.capture = True  # a CUDA graph is being captured: a timed event would break it
    assert clock.now() == cpu.ns and gpu.recorded == []
    gpu.capture = False
    assert [0 < clock.now() < EVENT_LIMIT for _ in range(3)] == [True, True, False]  # then the pool runs dry
    assert clock.fallbacks == 2 and len(gpu.recorded) == 2


def test_rows_wait_for_their_gpu_events_across_drains() -> None:
    gpu, cpu = FakeGpu(), FixedCpu()
    clock = CudaClock(gpu, pool_size=8, cpu=cpu)  # type: ignore[arg-type]
    rec = Recorder(CpuClock(), RankState())
    rec.use_clock(clock)
    gpu.time_ms = 1010.0
    with rec.span("forward", "compute", 1, None, {}):
        gpu.time_ms = 1012.5
    assert span_rows(rec) == []  # the GPU has not run the span yet: kept back
    calibrated(gpu, cpu, clock, 1000.0)  # runs the GPU, too
    (row,) = span_rows(rec)
    assert (row["start"] - cpu.ns, row["end"] - cpu.ns) == (10_000_000, 12_500_000)


# --- automatic spans ------------------------------------------------------------------------------


@pytest.fixture
def auto() -> Iterator[tuple[Recorder, AutoSpans]]:
    rec = recorder()
    spans = AutoSpans(rec)
    try:
        yield rec, spans
    finally:
        spans.close()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    loss_fn = torch.nn.MSELoss()  # a module without parameters: never taken for the model
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn(model(torch.randn(4, 8)), torch.randn(4, 2)).backward()
        optimizer.step()


def test_a_script_without_the_api_gets_steps_and_compute_spans(auto: tuple[Recorder, AutoSpans]) -> None:
    rec, _ = auto
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, optimizer, 3)
    assert not torch.nn.modules.module._global_forward_hooks  # discovery ended at the first step
    rows = sorted(span_rows(rec), key=lambda r: r["start"])
    assert [(r["name"], r["step"]) for r in rows] == [(n, s) for s in (1, 2, 3) for n in ("forward", "backward", "optimizer")]
    assert {r["kind"] for r in rows if r["name"] != "optimizer"} == {pb.SPAN_KIND_COMPUTE}
    assert rec.state.step == 4  # the fourth iteration has begun


def test_forward_and_backward_inside_the_optimizers_closure_are_spans_of_their_own(auto: tuple[Recorder, AutoSpans]) -> None:
    """Lightning runs them inside ``optimizer.step(closure)``: the model is found there, and the
    optimizer span's pieces leave the closure out."""
    rec, _ = auto
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 2))
            loss.backward()
            return loss

        optimizer.step(closure=closure)
    rows = sorted(span_rows(rec), key=lambda r: r["start"])
    assert [(r["name"], r["step"]) for r in rows] == [(n, s) for s in (1, 2, 3) for n in ("optimizer", "forward", "backward", "optimizer")]
    assert all(a["end"] <= b["start"] for a, b in zip(rows, rows[1:]))  # nothing counted twice
    assert rec.state.step == 4


def test_step_times_are_recorded_per_automatic_step(auto: tuple[Recorder, AutoSpans]) -> None:
    rec, _ = auto
    model = torch.nn.Linear(8, 2)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    scalars = [b for b in rec.drain() if isinstance(b, pb.StepMetricBatch)]
    (batch,) = scalars
    assert list(batch.strings) == ["step_time_s"] and np.frombuffer(batch.step, "<i4").tolist() == [1, 2]
    assert all(0 < v < 10 for v in np.frombuffer(batch.value, "<f8"))


def test_explicit_api_calls_switch_the_automatic_ones_off(auto: tuple[Recorder, AutoSpans]) -> None:
    rec, _ = auto
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, optimizer, 1)
    rec.explicit_steps = True
    rec.set_step(10)
    with rec.span("my-forward", "compute", None, None, {}):
        model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    later = [(r["name"], r["step"]) for r in span_rows(rec) if r["step"] == 10]
    assert later == [("my-forward", 10), ("optimizer", 10)] and rec.state.step == 10


# --- the public API -------------------------------------------------------------------------------


def test_the_api_does_nothing_while_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "_may_start", False)
    assert not agent.enabled()

    def fn() -> int:
        return 1

    assert agent.span("forward", step=1) is agent._NOOP_SPAN and agent.span("x")(fn) is fn
    agent.set_step(3)
    agent.record_scalars(3, loss=1.0)
    agent.name_groups({"tp[0]": None})
    agent.set_topology(2, 2, 2)
    assert not agent.enabled() and agent._recorder is None


def test_a_refused_activation_leaves_the_api_on_its_no_op_path(proc_runner: ProcRunner) -> None:
    """A forked child, and a process whose activation is refused (here: a bad setting), stop
    waiting for a late start: ``span`` hands out the no-op object, not one that looks again."""
    code = """
        import os
        from rankscope import agent
        from rankscope.agent.autoload import activate
        print("before", type(agent.span("x")).__name__, flush=True)
        pid = os.fork()
        if pid == 0:
            print("forked", agent.span("x") is agent._NOOP_SPAN, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("refused", activate(), agent.span("x") is agent._NOOP_SPAN, flush=True)
    """
    env = {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_STALL_S": "soon", "RANKSCOPE_ROLE": "", "RANKSCOPE_AGENT_PID": "", "RANK": ""}
    proc = proc_runner.start([sys.executable, "-c", textwrap.dedent(code)], env=env, name="refused")
    assert proc.wait(60) == 0, proc.output()
    assert proc.stdout.splitlines() == ["before _LateSpan", "forked True", "refused False True"]


def test_a_decorator_finds_the_agent_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "_may_start", True)

    @agent.span("load", kind="data", shard=1)
    def load(x: int) -> int:
        return x * 2

    assert load(1) == 2  # before the agent starts: untimed
    rec = recorder()
    agent._attach(rec)
    try:
        assert load(2) == 4
        agent.set_step(7)
        assert load(3) == 6
    finally:
        agent._attach(None)
    assert [(r["name"], r["kind"], r["step"], r["attrs"]) for r in span_rows(rec)] == [
        ("load", pb.SPAN_KIND_DATA, 0, {"shard": 1}),
        ("load", pb.SPAN_KIND_DATA, 7, {"shard": 1}),
    ]


def test_the_api_never_raises_into_training() -> None:
    rec = recorder()
    agent._attach(rec)
    try:
        with agent.span("odd", kind="no-such-kind", step=2**40):  # out of the int32 column
            pass
        with agent.span("fine", kind="optimizer", step=1):
            pass
        agent.record_scalars(1, loss=float("nan"), note="text", big=2**70)
        agent.set_step("not a step")  # type: ignore[arg-type]
    finally:
        agent._attach(None)
    assert [(r["name"], r["kind"]) for r in span_rows(rec)] == [("fine", pb.SPAN_KIND_OPTIMIZER)]


@pytest.mark.slow
def test_open_telemetry_spans_become_user_spans(proc_runner: ProcRunner) -> None:
    """In a child process: OpenTelemetry's global provider can be set once per process."""
    code = """
        import numpy as np
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from rankscope.agent import otel
        from rankscope.agent.recorder import Recorder
        from rankscope.agent.state import RankState
        from rankscope.agent.timing import CpuClock

        rec = Recorder(CpuClock(), RankState())
        rec.set_step(3)
        stop = otel.install(rec)  # no provider set yet: the agent's
        with trace.get_tracer("user").start_as_current_span("before", attributes={"k": 1}):
            pass
        theirs, exported = TracerProvider(), InMemorySpanExporter()
        theirs.add_span_processor(SimpleSpanProcessor(exported))
        trace.set_tracer_provider(theirs)  # the script's own, later: it takes over, we stay
        assert trace.get_tracer_provider() is theirs
        with trace.get_tracer("user").start_as_current_span("after"):
            pass
        stop()
        with trace.get_tracer("user").start_as_current_span("ignored"):
            pass
        batch = next(rec.drain())
        names, attrs = (np.frombuffer(c, "<i4") for c in (batch.name, batch.attributes))
        print([(batch.strings[n], batch.strings[a] if a >= 0 else None) for n, a in zip(names, attrs)],
              set(batch.kind), set(np.frombuffer(batch.step, "<i4").tolist()), [s.name for s in exported.get_finished_spans()])
    """
    proc = proc_runner.start([sys.executable, "-c", textwrap.dedent(code)], name="otel")
    assert proc.wait(60) == 0, proc.output()
    assert proc.stdout.strip() == """[('before', '{"k": 1}'), ('after', None)] {4} {3} ['after', 'ignored']"""


# --- the flight recorder, parsed defensively --------------------------------------------------


def test_flight_recorder_entries_and_a_changed_format(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = {
        "process_group": ("3", "dp[0]"), "collective_seq_id": 7, "profiling_name": "gloo:allreduce", "is_p2p": False,
        "input_sizes": [[4, 2]], "input_dtypes": ["BFloat16"], "time_created_ns": 5, "state": "scheduled",
    }  # fmt: skip
    trace = {"entries": [entry], "pg_status": {"3": {"last_completed_collective": 6}}}
    dumps = {"_dump_fr_trace": lambda **kw: pickle.dumps(trace)}
    fr = FlightRecorder()
    monkeypatch.setattr(fr, "_dumps", dumps)
    dump = fr.read()
    assert dump is not None
    (e,) = dump.entries
    assert (e.group, e.seq, e.op, e.nbytes, e.dtype, e.issue_ns, e.end_ns) == ("3", 7, "all_reduce", 16, "bfloat16", 5, 0)
    assert not dump.done(e)  # gloo says the group has completed up to #6 only
    monkeypatch.setattr(fr, "_dumps", {"_dump_fr_trace": lambda **kw: pickle.dumps({"entries": [{"seq": 1}]})})
    assert fr.read() is None and fr._dumps == {}  # a format it cannot read: that source is off
