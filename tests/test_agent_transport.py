"""The agent's Transport against the real collector: delivery, spool, replay, refusals, speed.

A collector (``rankscope collector`` on a chDB store) runs for the whole module; tests that need
it down, or started mid-run, or overloaded, start their own. Every test names its own run, so
the shared collector's tables never mix tests. The only in-test gRPC servers stand for faults the
collector cannot produce: a proxy in front of it that loses an acknowledgement, and a collector
that stalls (refuses a call, then holds the next ones without answering).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from rankscope.agent.clock import ClockEstimator
from rankscope.agent.config import AgentConfig, load_config
from rankscope.agent.spool import Spool, leftovers
from rankscope.agent.transport import MAX_ATTEMPTS, Transport
from rankscope.cli import launch
from rankscope.collector.client import Client
from rankscope.protos.v1 import ingest_pb2, ingest_pb2_grpc, telemetry_pb2

import conftest
from conftest import Proc, ProcRunner, free_port

TOKEN = "s3cret-token"
EVENTS = 4096


# --- a real collector --------------------------------------------------------------------------


@dataclass
class Collector:
    proc: Proc
    address: str

    def query(self, sql: str, **params: str) -> list[dict]:
        with Client(self.address, token=TOKEN) as client:
            return client.query(sql, params).to_pylist()

    def count(self, table: str, run_id: str) -> int:
        return self.query(f"SELECT count() AS n FROM {table} WHERE run_id = {{run:String}}", run=run_id)[0]["n"]


def start_collector(runner: ProcRunner, store: Path, port: int = 0, *extra: str) -> Collector:
    """``rankscope collector`` on ``store`` with the token; returns once it listens (port 0: a free one)."""
    running = conftest.start_collector(runner, store, "--token", TOKEN, "--flush-interval", "0.1", *extra,
                                       listen=f"127.0.0.1:{port}", name=f"collector-{store.name}", timeout=120)  # fmt: skip
    return Collector(running.proc, running.target)


@pytest.fixture(scope="module")
def collector(module_runner: ProcRunner, tmp_path_factory: pytest.TempPathFactory) -> Collector:
    return start_collector(module_runner, tmp_path_factory.mktemp("store") / "store")


# --- payloads and agents -------------------------------------------------------------------------


def agent_config(address: str, spool: Path, **more: str) -> AgentConfig:
    config = load_config({
        "RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": address, "RANKSCOPE_TOKEN": TOKEN,
        "RANKSCOPE_SPOOL_DIR": str(spool), **more,
    })  # fmt: skip
    assert config is not None
    return config


def register() -> telemetry_pb2.Register:
    return telemetry_pb2.Register(
        world_size=1, host="test-host", pid=os.getpid(), local_rank=0, device="cpu", tp=1, pp=1, dp=1,
        tp_rank=0, pp_rank=0, dp_rank=0, start_time_ns=time.time_ns(), agent_version="test",
    )  # fmt: skip


def span_batch(step: int, n: int = EVENTS) -> telemetry_pb2.SpanBatch:
    """``n`` forward spans of 1 us each at step ``step``, ending now."""
    start = time.time_ns() - np.arange(n, 0, -1, dtype="<i8") * 2_000
    return telemetry_pb2.SpanBatch(
        count=n, strings=["forward"], name=np.zeros(n, "<i4").tobytes(), kind=np.zeros(n, "u1").tobytes(),
        step=np.full(n, step, "<i4").tobytes(), microbatch=np.full(n, -1, "<i4").tobytes(),
        start_ns=start.tobytes(), end_ns=(start + 1_000).tobytes(), attributes=np.full(n, -1, "<i4").tobytes(),
    )  # fmt: skip


def run_name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def registered(collector: Collector, tmp_path: Path) -> str:
    """A new run whose rank 0 registered with ``collector`` straight away (before an outage, or around
    a proxy): the collector takes the rows of registered runs only."""
    run_id = run_name()
    t = Transport(agent_config(collector.address, tmp_path / "registrar-spool"), run_id, 0, name="registrar")
    t.start()
    t.submit(register())
    t.close(timeout_s=30)
    assert t.stats().acked == 1, t.stats()
    return run_id


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen in {timeout} s")
        time.sleep(0.05)


def spool_producer(runner: ProcRunner, spool: Path, run_id: str, batches: int) -> Proc:
    """A process that spools ``batches`` span batches for an unreachable collector, then ends."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_agent_transport import agent_config, register, span_batch
        from rankscope.agent.transport import MAX_ATTEMPTS, Transport
        t = Transport(agent_config("127.0.0.1:{free_port()}", __import__("pathlib").Path({str(spool)!r})), {run_id!r}, 0)
        t.start()
        t.submit(register())
        for step in range(1, {batches} + 1):
            t.submit(span_batch(step))
        t.close(timeout_s=1.0)
        print("spooled", t.stats().spooled)
    """)
    proc = runner.start([sys.executable, "-c", script], name=f"producer-{run_id}")
    assert proc.wait(60) == 0, proc.output()
    return proc


# --- delivery ------------------------------------------------------------------------------------


def test_round_trip_and_clock_offset(collector: Collector, tmp_path: Path) -> None:
    run_id = run_name()
    t = Transport(agent_config(collector.address, tmp_path / "spool"), run_id, 0)
    t.start()
    assert t.submit(register())
    for step in range(1, 6):
        assert t.submit(span_batch(step))
    t.close(timeout_s=30)
    stats = t.stats()
    assert (stats.acked, stats.duplicates, stats.spooled, stats.dropped, stats.errors) == (6, 0, 0, 0, {})
    assert collector.count("spans", run_id) == 5 * EVENTS
    assert collector.query("SELECT host FROM ranks WHERE run_id = {run:String}", run=run_id) == [{"host": "test-host"}]
    # Same machine, same clock: every exchange allows an offset of 0, so 0 it is (each exchange's
    # midpoint alone is off by the asymmetry of its delays).
    assert t.clock_offset_ns == 0
    assert list((tmp_path / "spool").glob("*")) == []  # nothing was ever spooled


MS = 1_000_000


def _exchange(clock: ClockEstimator, offset: int, there: int, serving: int, back: int, t0: int = 10**18) -> None:
    """One acknowledged call: ``offset`` = collector clock minus rank clock, delays in ns."""
    t1 = t0 + there + offset
    clock.add(t0, t1, t1 + serving, t0 + there + serving + back)


def test_the_clock_offset_is_the_least_correction_the_exchanges_allow() -> None:
    skewed = ClockEstimator()
    _exchange(skewed, 10 * MS, there=MS // 5, serving=MS, back=MS // 5)
    assert 10 * MS - MS // 5 <= skewed.offset_ns <= 10 * MS  # a real skew is corrected, to within the round trip
    starved = ClockEstimator()
    for _ in range(5):  # same clock, but the collector ran the handler 40 ms after the request came in
        _exchange(starved, 0, there=40 * MS, serving=MS, back=MS // 10)
    assert starved.offset_ns == 0  # the midpoint says 20 ms; nothing demands a correction
    for _ in range(5):
        _exchange(starved, 0, there=MS // 10, serving=MS, back=MS // 10)
    _exchange(starved, 50 * MS, there=MS // 10, serving=MS, back=MS // 10)  # the collector's clock stepped
    assert 50 * MS - MS // 10 <= starved.offset_ns <= 50 * MS  # taken up at once, not held back by older bounds


def test_one_transport_fed_as_fast_as_it_takes_delivers_every_batch_once(collector: Collector, tmp_path: Path) -> None:
    """300 SpanBatches of 4096 events through one Transport, fed as fast as its bounded queue takes them:
    every one acknowledged and stored once. The rate is printed; benchmarks/ingest.py measures it."""
    run_id = run_name()
    t = Transport(agent_config(collector.address, tmp_path / "spool"), run_id, 0)
    t.start()
    t.submit(register())
    batches = 300
    payloads = [span_batch(step) for step in range(1, batches + 1)]
    started = time.perf_counter()
    for payload in payloads:
        while not t.submit(payload):  # the queue is bounded: wait for room like a producer would
            time.sleep(0.001)
    t.close(timeout_s=120)
    elapsed = time.perf_counter() - started
    rate = batches * EVENTS / elapsed
    print(f"\none Transport -> collector: {rate:,.0f} events/s ({batches} SpanBatches of {EVENTS} in {elapsed:.2f} s)")
    assert t.stats().acked == batches + 1
    assert collector.count("spans", run_id) == batches * EVENTS


def test_payloads_submitted_before_start_and_after_close(collector: Collector, tmp_path: Path) -> None:
    run_id = run_name()
    t = Transport(agent_config(collector.address, tmp_path / "spool"), run_id, 0)
    assert t.submit(register())  # kept until the sender starts
    t.start()
    t.close(timeout_s=30)
    assert not t.submit(span_batch(1))  # closed: refused and counted
    assert (t.stats().acked, t.stats().rejected, t.stats().rejected_events, t.stats().dropped) == (1, 1, EVENTS, 0)


def test_full_queue_refuses_newest_and_counts(tmp_path: Path) -> None:
    # Not started: submit charges each 4096-event batch its estimate (about 262 kB).
    t = Transport(agent_config(f"127.0.0.1:{free_port()}", tmp_path / "spool"), run_name(), 0, max_queue_bytes=300_000)
    accepted = [t.submit(span_batch(step)) for step in range(1, 6)]
    assert accepted == [True, False, False, False, False]
    assert (t.stats().rejected, t.stats().rejected_events, t.stats().dropped) == (4, 4 * EVENTS, 0)
    t.close(timeout_s=0)


# --- the collector is away -----------------------------------------------------------------------


def test_unreachable_collector_one_warning_fast_submit(proc_runner: ProcRunner, tmp_path: Path) -> None:
    """A dead port and an unresolvable name: one warning line each, no traceback, submit O(1)."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_agent_transport import agent_config
        from rankscope.agent.transport import MAX_ATTEMPTS, Transport
        from rankscope.protos.v1 import telemetry_pb2
        for address in (sys.argv[1], "no-such-host.invalid:7777"):
            t = Transport(agent_config(address, Path({str(tmp_path)!r}) / address), "run", 0)
            t.start()
            beat = telemetry_pb2.HeartbeatBatch(heartbeats=[telemetry_pb2.Heartbeat(time_ns=time.time_ns(), step=1)])
            while not t.stats().errors:  # until the sender knows the collector is away
                t.submit(beat)
                time.sleep(0.01)
            n = 20000
            started = time.perf_counter()
            for _ in range(n):
                t.submit(beat)
            per_call = (time.perf_counter() - started) / n
            print(f"submit while the collector is away: {{per_call * 1e6:.2f}} us", flush=True)
            t.close(timeout_s=1.0)
            assert t.stats().dropped == 0, t.stats()
    """)
    proc = proc_runner.start([sys.executable, "-c", script, f"127.0.0.1:{free_port()}"], name="unreachable")
    assert proc.wait(120) == 0, proc.output()
    warnings = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert len(warnings) == 2, proc.stderr  # one per collector address
    assert all(w.startswith("rankscope agent: cannot reach the collector") for w in warnings), proc.stderr
    costs = [float(line.split(": ")[1].split()[0]) for line in proc.stdout.splitlines()]
    print("\n" + proc.stdout)
    # never waits for the network (a connect or a name lookup takes milliseconds to seconds); how fast it
    # is, 1-25 us a call, is benchmarks/agent.py's to measure: a loaded machine's scheduler sets the rest
    assert all(cost < 1000 for cost in costs), proc.stdout


def test_unwritable_spool_drops_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    t = Transport(agent_config(f"127.0.0.1:{free_port()}", blocker / "spool"), run_name(), 0)
    t.start()
    for step in range(1, 4):
        assert t.submit(span_batch(step))
    t.close(timeout_s=1.0)
    stats = t.stats()
    assert stats.spooled == 0 and (stats.dropped, stats.dropped_events) == (3, 3 * EVENTS), stats
    (said,) = [r.getMessage() for r in caplog.records if "cannot write the spool" in r.getMessage()]
    assert str(blocker / "spool") in said


@pytest.mark.timeout(60)
def test_a_process_forked_while_the_spool_writes_lets_go_of_it(tmp_path: Path) -> None:
    """A data-loader worker forked while the sender is inside a spool write must not wait on the parent's file.

    The segment is a FIFO nobody reads (a disk that stalls): the sender thread stays inside its write.
    """
    spool = Spool(tmp_path, "owner", max_bytes=1 << 30)
    os.mkfifo(tmp_path / "owner.000000.seg")
    drain = os.open(tmp_path / "owner.000000.seg", os.O_RDONLY | os.O_NONBLOCK)  # lets the writer open it
    writing = threading.Thread(target=spool.append, args=(b"x" * (1 << 20), 1), daemon=True)
    writing.start()
    time.sleep(0.5)  # the pipe (64 KiB) is full: the write blocks
    child = os.fork()
    if child == 0:
        spool.forget_after_fork()
        os._exit(0)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, 9)
        os.waitpid(child, 0)
    while writing.is_alive():  # let the parent's write finish
        try:
            os.read(drain, 1 << 16)
        except BlockingIOError:
            time.sleep(0.01)
    os.close(drain)
    assert done[0] == child, "the forked child is stuck letting go of the spool's file"
    assert os.waitstatus_to_exitcode(done[1]) == 0


@pytest.mark.slow
def test_spooled_while_down_replayed_once_when_the_collector_starts(proc_runner: ProcRunner, tmp_path: Path) -> None:
    port = free_port()
    run_id = run_name()
    spool = tmp_path / "spool"
    t = Transport(agent_config(f"127.0.0.1:{port}", spool), run_id, 0)
    t.start()
    t.submit(register())
    for step in range(1, 11):
        t.submit(span_batch(step))
    wait_until(lambda: t.stats().spooled >= 11, 30, "spooling")
    assert list(spool.glob("*.seg")), "the spool is on disk"
    collector = start_collector(proc_runner, tmp_path / "store", port)
    for step in range(11, 16):  # new data after the collector is back comes after the replay
        t.submit(span_batch(step))
    wait_until(lambda: t.stats().replayed >= 11, 60, "the replay")
    t.close(timeout_s=30)
    stats = t.stats()
    assert stats.dropped == 0 and stats.duplicates == 0, stats
    assert collector.count("spans", run_id) == 15 * EVENTS  # every batch, once
    rows = collector.query(
        "SELECT step, min(start_time) AS first FROM spans WHERE run_id = {run:String} GROUP BY step ORDER BY step", run=run_id
    )
    assert [r["step"] for r in rows] == list(range(1, 16))
    assert list(spool.glob("*.seg")) == [] and list(spool.glob("*.lock")) == []  # all acknowledged: gone


def test_leftover_spool_replayed_by_the_next_agent(collector: Collector, proc_runner: ProcRunner, tmp_path: Path) -> None:
    run_id = run_name()
    spool = tmp_path / "spool"
    spool_producer(proc_runner, spool, run_id, batches=4)
    assert leftovers(spool), "the ended process left its spool"
    nxt = Transport(agent_config(collector.address, spool), run_name(), 0)  # another run on the host
    nxt.start()
    nxt.submit(register())
    wait_until(lambda: nxt.stats().replayed >= 5, 60, "the leftover replay")
    nxt.close(timeout_s=30)
    assert collector.count("spans", run_id) == 4 * EVENTS
    assert collector.query("SELECT rank FROM ranks WHERE run_id = {run:String}", run=run_id) == [{"rank": 0}]
    assert leftovers(spool) == [] and list(spool.glob("*")) == []


def test_spool_replay_command_and_duplicates(collector: Collector, proc_runner: ProcRunner, tmp_path: Path) -> None:
    """``rankscope spool replay`` sends a leftover spool; a second copy is acknowledged, not rewritten."""
    run_id = run_name()
    spool = tmp_path / "spool"
    spool_producer(proc_runner, spool, run_id, batches=3)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in spool.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    command = [sys.executable, "-m", "rankscope.cli.main", "spool", "replay", "--collector", collector.address, "--token", TOKEN]
    first = proc_runner.start([*command, str(spool)], name="replay-1")
    assert first.wait(120) == 0, first.output()
    assert "replayed 4 batches (0 already stored" in first.stdout, first.output()
    assert collector.count("spans", run_id) == 3 * EVENTS
    second = proc_runner.start([*command, str(copy)], name="replay-2")
    assert second.wait(120) == 0, second.output()
    assert "replayed 4 batches (4 already stored" in second.stdout, second.output()
    assert collector.count("spans", run_id) == 3 * EVENTS  # written once
    assert leftovers(spool) == [] and leftovers(copy) == []



def test_rankscope_launch_sends_what_its_ranks_left_in_its_workdirs_spool(
    collector: Collector, proc_runner: ProcRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The spool ``rankscope launch`` gives its hosts' ranks (``--workdir``/spool) is sent once the job
    ended, as ``rankscope train`` sends its ranks': a postmortem right after reads the whole run."""
    run_id = run_name()
    spool_producer(proc_runner, tmp_path / "spool", run_id, batches=3)
    monkeypatch.setenv("RANKSCOPE_TOKEN", TOKEN)
    launch._replay_leftovers(argparse.Namespace(collector=collector.address, workdir=tmp_path))
    out = capsys.readouterr().out
    assert "rankscope launch: the ranks left 1 spool segment file(s)" in out and "replayed 4 batches (0 already stored" in out, out
    assert collector.count("spans", run_id) == 3 * EVENTS
    assert leftovers(tmp_path / "spool") == []


def test_diagnose_says_when_telemetry_waits_in_this_hosts_spool(collector: Collector, proc_runner: ProcRunner, tmp_path: Path) -> None:
    """A run whose every batch is still in the spool is unknown to the store: diagnose says why it may be."""
    run_id = run_name()
    spool = tmp_path / "spool"
    spool_producer(proc_runner, spool, run_id, batches=2)
    command = [sys.executable, "-m", "rankscope.cli.main", "diagnose", "--run", run_id, "--collector", collector.address, "--token", TOKEN]
    done = proc_runner.start(command, env={"RANKSCOPE_SPOOL_DIR": str(spool)}, name="diagnose")
    assert done.wait(120) == 2, done.output()
    assert f"spool segment file(s) in {spool} hold telemetry not sent yet" in done.stderr, done.output()
    assert f"`rankscope spool replay {spool}` sends it" in done.stderr and f"no run {run_id!r}" in done.stderr, done.output()

def test_spool_drops_oldest_first_when_full(collector: Collector, tmp_path: Path) -> None:
    run_id = registered(collector, tmp_path)  # before the outage: the spool's own copy is the oldest, dropped first
    spool = tmp_path / "spool"
    t = Transport(agent_config(f"127.0.0.1:{free_port()}", spool, RANKSCOPE_SPOOL_MAX_MB="1"), run_id, 0)
    t.start()
    t.submit(register())
    for step in range(1, 21):  # ~2.8 MB for a 1 MiB spool
        t.submit(span_batch(step))
    t.close(timeout_s=1.0)
    stats = t.stats()
    assert stats.dropped > 0, stats
    assert sum(p.stat().st_size for p in spool.glob("*.seg")) <= 1 << 20
    replay = Transport(agent_config(collector.address, spool), run_name(), 0, name="replayer")
    replay.start()
    replay.close(timeout_s=30)
    steps = [r["step"] for r in collector.query("SELECT DISTINCT step FROM spans WHERE run_id = {run:String} ORDER BY step", run=run_id)]
    assert steps and steps[-1] == 20  # the newest survived
    assert steps == list(range(steps[0], 21))  # a contiguous tail: the oldest went first
    # What went is counted: the registration and the span batches before the tail.
    assert (stats.dropped, stats.dropped_events) == (1 + 20 - len(steps), 1 + (20 - len(steps)) * EVENTS)


# --- the collector answers with an error ---------------------------------------------------------


def test_malformed_batch_dropped_counted_and_said_once(collector: Collector, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_id = run_name()
    t = Transport(agent_config(collector.address, tmp_path / "spool"), run_id, 0)
    t.start()
    t.submit(register())
    bad = span_batch(1)
    bad.count = EVENTS + 1  # columns hold EVENTS values: INVALID_ARGUMENT
    t.submit(bad)
    t.submit(bad)
    t.submit(span_batch(2))
    t.close(timeout_s=30)
    stats = t.stats()
    assert stats.errors == {"INVALID_ARGUMENT": 2} and stats.dropped == 2 and stats.acked == 2, stats
    assert collector.count("spans", run_id) == EVENTS
    refusals = [r for r in caplog.records if "INVALID_ARGUMENT" in r.getMessage()]
    assert len(refusals) <= 1  # said once per process (an earlier test may have said it already)


def test_wrong_token_warns_and_keeps_spooling(collector: Collector, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    t = Transport(agent_config(collector.address, spool, RANKSCOPE_TOKEN="wrong"), run_name(), 0)
    t.start()
    t.submit(register())
    t.submit(span_batch(1))
    wait_until(lambda: t.stats().errors.get("UNAUTHENTICATED", 0) >= 1 and t.stats().spooled >= 1, 30, "the refusal")
    t.close(timeout_s=1.0)
    stats = t.stats()
    assert stats.acked == 0 and stats.dropped == 0 and stats.spooled >= 2, stats
    assert leftovers(spool)  # kept for a replay with the right token


@pytest.mark.slow
def test_back_pressure_waits_and_retries(proc_runner: ProcRunner, tmp_path: Path) -> None:
    """RESOURCE_EXHAUSTED with retry-after-ms from a collector that may buffer few rows."""
    collector = start_collector(proc_runner, tmp_path / "store", 0, "--max-buffered-rows", "5000", "--flush-interval", "0.5")
    run_id = run_name()
    t = Transport(agent_config(collector.address, tmp_path / "spool"), run_id, 0)
    t.start()
    t.submit(register())
    for step in range(1, 13):
        t.submit(span_batch(step))
    t.close(timeout_s=200)  # close spools what is left at its deadline: a loaded machine's collector flushes slowly (CI: 2 of 20 after 60 s)
    stats = t.stats()
    assert stats.errors.get("RESOURCE_EXHAUSTED", 0) > 0, stats
    assert stats.dropped == 0 and stats.spooled == 0, stats
    assert collector.count("spans", run_id) == 12 * EVENTS


class _LosingProxy(ingest_pb2_grpc.IngestServicer):
    """Forwards every batch to the real collector; answers the first ``failures`` with ``code`` anyway."""

    def __init__(self, target: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, failures: int = 1) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = ingest_pb2_grpc.IngestStub(self.channel)
        self.code, self.failures = code, failures
        self.seen: list[bytes] = []
        self.acks: list[ingest_pb2.Ack] = []

    def Send(self, request: ingest_pb2.Batch, context: grpc.ServicerContext) -> ingest_pb2.Ack:
        ack = self.stub.Send(request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)
        self.seen.append(request.batch_id)
        self.acks.append(ack)
        if len(self.seen) <= self.failures:
            context.abort(self.code, "acknowledgement lost on the way")
        return ack


@pytest.fixture
def losing_proxy(collector: Collector, request: pytest.FixtureRequest) -> Iterator[tuple[_LosingProxy, str]]:
    """A proxy to the collector; ``request.param``: (code, failures), UNAVAILABLE once when not given."""
    proxy = _LosingProxy(collector.address, *getattr(request, "param", ()))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ingest_pb2_grpc.add_IngestServicer_to_server(proxy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield proxy, f"127.0.0.1:{port}"
    server.stop(0)
    proxy.channel.close()


def _send_one(collector: Collector, address: str, tmp_path: Path) -> tuple[Transport, str]:
    """One batch of a new run (registered with ``collector``) sent through ``address`` until acknowledged;
    the transport closed."""
    run_id = registered(collector, tmp_path)
    t = Transport(agent_config(address, tmp_path / "spool"), run_id, 0)
    t.start()
    t.submit(span_batch(1))
    wait_until(lambda: t.stats().acked >= 1, 30, "the batch's ack")
    t.close(timeout_s=30)
    return t, run_id


@pytest.mark.parametrize("losing_proxy", [(grpc.StatusCode.CANCELLED, MAX_ATTEMPTS + 2)], indirect=True)
def test_a_call_the_overloaded_collector_cancelled_is_sent_again_however_often(
    collector: Collector, losing_proxy: tuple[_LosingProxy, str], tmp_path: Path
) -> None:
    """A gRPC server short of CPU cancels calls it cannot serve: never the batch's fault, so never dropped
    (other failures are given up after MAX_ATTEMPTS)."""
    t, run_id = _send_one(collector, losing_proxy[1], tmp_path)
    assert t.stats().dropped == 0 and t.stats().errors == {"CANCELLED": MAX_ATTEMPTS + 2}
    assert collector.count("spans", run_id) == EVENTS


def test_lost_acknowledgement_resent_and_written_once(collector: Collector, losing_proxy: tuple[_LosingProxy, str], tmp_path: Path) -> None:
    proxy, address = losing_proxy
    t, run_id = _send_one(collector, address, tmp_path)
    # The batch went twice under one id; the collector wrote it once and said so the second time.
    assert proxy.seen[0] == proxy.seen[1] and len(proxy.seen) == 2
    assert [a.duplicate for a in proxy.acks] == [False, True]
    assert t.stats().duplicates == 1 and t.stats().errors == {"UNAVAILABLE": 1}
    assert collector.count("spans", run_id) == EVENTS


class _Stalling(ingest_pb2_grpc.IngestServicer):
    """A collector that says UNAVAILABLE once, then holds every call until ``release`` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def Send(self, request: ingest_pb2.Batch, context: grpc.ServicerContext) -> ingest_pb2.Ack:
        self.calls += 1
        if self.calls == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "going down")
        self.release.wait(60)
        context.abort(grpc.StatusCode.UNAVAILABLE, "still down")


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` (of this process) has used, from /proc."""
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_probe_held_by_a_stalled_collector_costs_no_cpu(tmp_path: Path) -> None:
    """While the probe that asks whether the collector is back hangs, the sender waits for its
    outcome instead of spinning (it once used a core per rank, which slowed training 5x)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    stalling = _Stalling()
    ingest_pb2_grpc.add_IngestServicer_to_server(stalling, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    t = Transport(agent_config(f"127.0.0.1:{port}", tmp_path / "spool"), run_name(), 0)
    try:
        t.start()
        t.submit(span_batch(1))
        wait_until(lambda: stalling.calls >= 2, 30, "the probe after the refusal")
        sender = next(th for th in threading.enumerate() if th.name == f"rankscope-transport-{t.name}")
        before = thread_cpu_s(sender)
        time.sleep(2.0)
        assert thread_cpu_s(sender) - before < 0.2  # a spinning sender uses about 2 s here
    finally:
        stalling.release.set()
        t.close(timeout_s=1.0)
        server.stop(0)
    assert t.stats().spooled >= 1  # nothing lost: the batch waits on disk for the collector


class _Gate(ingest_pb2_grpc.IngestServicer):
    """A collector that holds every call until ``open`` is set, noting the payload kinds in arrival order."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.open = threading.Event()

    def Send(self, request: ingest_pb2.Batch, context: grpc.ServicerContext) -> ingest_pb2.Ack:
        self.kinds.append(request.WhichOneof("payload"))
        self.open.wait(60)
        return ingest_pb2.Ack(batch_id=request.batch_id, received_ns=time.time_ns(), replied_ns=time.time_ns())


@contextlib.contextmanager
def _gate_server() -> Iterator[tuple[_Gate, str]]:
    """A ``_Gate`` collector and its address; the gate opened and the server stopped at the end."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    gate = _Gate()
    ingest_pb2_grpc.add_IngestServicer_to_server(gate, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield gate, f"127.0.0.1:{port}"
    finally:
        gate.open.set()
        server.stop(0)


@contextlib.contextmanager
def _gated(tmp_path: Path) -> Iterator[tuple[_Gate, Transport]]:
    """A transport of one call's window to a ``_Gate`` collector; the gate opened and both stopped at the end."""
    with _gate_server() as (gate, address):
        t = Transport(agent_config(address, tmp_path / "spool"), run_name(), 0, window=1)
        try:
            yield gate, t
        finally:
            gate.open.set()
            t.close(timeout_s=5)


def test_a_heartbeat_and_the_end_go_ahead_of_the_timelines_queued_before_them(tmp_path: Path) -> None:
    """A lagging collector holds the window full of timelines: the rank's heartbeat (where it is
    blocked: what a hang is named from) and its end (without it, a rank that ended is called lost)
    are sent at once, beside the window, not after the timelines."""
    with _gated(tmp_path) as (gate, t):
        t.start()
        t.submit(span_batch(1))
        wait_until(lambda: len(gate.kinds) == 1, 30, "the first batch in flight")
        for step in range(2, 5):
            t.submit(span_batch(step))
        t.submit(telemetry_pb2.HeartbeatBatch(heartbeats=[telemetry_pb2.Heartbeat(step=4, phase="forward")]))
        t.submit(telemetry_pb2.EndOfRank(time_ns=time.time_ns(), reason=telemetry_pb2.EndOfRank.REASON_NORMAL))
        # the window (one call) is still held by the first batch: these two pass beside it
        wait_until(lambda: len(gate.kinds) == 3, 30, "the heartbeat and the end sent while the window is full")
        gate.open.set()
        wait_until(lambda: t.stats().acked == 6, 30, "every batch acknowledged")
    # the two urgent calls are in flight together: the server may take either first
    assert gate.kinds[0] == "spans" and sorted(gate.kinds[1:3]) == ["end", "heartbeats"], gate.kinds
    assert gate.kinds[3:] == ["spans"] * 3, gate.kinds


#: a rank that raises at once, its agent on (its collector and spool from the environment)
RAISES = """
import rankscope.agent as agent
assert agent.init()
raise RuntimeError("boom")
"""


@pytest.mark.timeout(90)
def test_a_rank_ended_by_sigterm_while_its_last_word_waits_on_the_collector_leaves_it_on_disk(proc_runner: ProcRunner, tmp_path: Path) -> None:
    """A rank raised; its end is in flight to a collector that does not answer yet (starved of CPU) when
    torchrun's SIGTERM comes and ends the process. The end, lost with the process before, is on disk, for
    the next agent or ``rankscope spool replay`` to deliver (campaign seed 1841970453: three ranks' ends lost,
    named dead without a last word offline)."""
    with _gate_server() as (gate, address):
        env = {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": address, "RANKSCOPE_TOKEN": TOKEN,
               "RANKSCOPE_SPOOL_DIR": str(tmp_path / "spool"), "RANKSCOPE_RUN_ID": run_name()}  # fmt: skip
        proc = proc_runner.start([sys.executable, "-c", RAISES], env=env, name="raises")
        wait_until(lambda: "end" in gate.kinds, 60, "the rank's end in flight")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) in (1, -signal.SIGTERM), proc.output()  # the exception's code, or the signal that came first
    spool = Spool(tmp_path / "spool", "reader", 1 << 30)
    assert spool.adopt_leftovers() >= 1, proc.output()
    ends = []
    while (record := spool.pop()) is not None:
        batch = ingest_pb2.Batch.FromString(record.data)
        if batch.WhichOneof("payload") == "end":
            ends.append((batch.end.reason, batch.end.message))
    assert ends == [(telemetry_pb2.EndOfRank.REASON_EXCEPTION, "RuntimeError: boom")], proc.output()


def test_a_registration_goes_ahead_of_the_timelines_submitted_before_it(tmp_path: Path) -> None:
    """The collector takes a run's rows only once one of its ranks registered: a registration is
    urgent, sent before the timelines queued ahead of it (with the heartbeat submitted after it)."""
    with _gated(tmp_path) as (gate, t):
        t.submit(span_batch(1))
        t.submit(register())
        t.submit(telemetry_pb2.HeartbeatBatch(heartbeats=[telemetry_pb2.Heartbeat(step=1, phase="forward")]))
        t.start()
        wait_until(lambda: len(gate.kinds) == 2, 30, "the registration and the heartbeat in flight")
        gate.open.set()
        wait_until(lambda: t.stats().acked == 3, 30, "every batch acknowledged")
    assert sorted(gate.kinds[:2]) == ["heartbeats", "register"] and gate.kinds[2:] == ["spans"], gate.kinds


# --- forked children ----------------------------------------------------------------------------


def test_forked_child_sends_nothing(collector: Collector, proc_runner: ProcRunner, tmp_path: Path) -> None:
    run_id = run_name()
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_agent_transport import agent_config, register, span_batch
        from rankscope.agent.transport import MAX_ATTEMPTS, Transport
        t = Transport(agent_config({collector.address!r}, Path({str(tmp_path / "spool")!r})), {run_id!r}, 0)
        t.start()
        t.submit(register())
        pid = os.fork()
        if pid == 0:  # a data-loader worker, say: quiet, and it ends normally
            accepted = t.submit(span_batch(99))
            t.close()
            print("child accepted", accepted, flush=True)
            sys.exit(0)
        os.waitpid(pid, 0)
        t.submit(span_batch(1))
        t.close(timeout_s=30)
        s = t.stats()
        print("parent acked", s.acked, "dropped", s.dropped, flush=True)
    """)
    proc = proc_runner.start([sys.executable, "-c", script], name="fork")
    assert proc.wait(60) == 0, proc.output()
    # Acknowledged: the registration and the parent's batch (a registration whose first call timed
    # out under load is acknowledged twice: re-sent as the probe and replayed from the spool).
    parent = re.search(r"parent acked (\d+) dropped (\d+)", proc.stdout)
    assert "child accepted False" in proc.stdout and parent is not None, proc.output()
    assert int(parent[1]) >= 2 and parent[2] == "0", proc.output()
    assert collector.query("SELECT DISTINCT step FROM spans WHERE run_id = {run:String}", run=run_id) == [{"step": 1}]
