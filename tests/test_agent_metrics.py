"""The agent's periodic reports: host/GPU metrics, heartbeats, stall detection and stack dumps.

Everything goes through a real Transport to the real collector and is read back with SQL.
Without a GPU NVML finds none, and the GPU instruments are checked to stay away quietly (those
tests skip where NVML finds one); host metrics come from the real /proc.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from rankscope.agent import config, hardware
from rankscope.agent.hardware import host_memory, network_counters, open_gpu
from rankscope.agent.heartbeat import Heartbeat
from rankscope.agent.metrics import MetricsReporter, to_metric_batch
from rankscope.agent.state import RankState
from rankscope.agent.transport import Transport
from rankscope.protos.v1 import ingest_pb2, query_pb2, query_pb2_grpc

from conftest import ProcRunner
from test_agent_transport import TOKEN, Collector, agent_config, collector, free_port, register, run_name, wait_until  # noqa: F401 - fixture

# --- metrics ---------------------------------------------------------------------------------------

#: heartbeats, reports and stalls in windows of a second or less: the background lane could starve them
pytestmark = pytest.mark.foreground


def _gpu_here() -> bool:
    """Whether the agent's own NVML look-up finds a GPU on this machine."""
    gpu = open_gpu(0)
    if gpu is not None:
        gpu.close()
    return gpu is not None


#: for the tests of the GPU-less path, which a machine with a GPU (as NVML sees it) cannot take
without_gpu = pytest.mark.skipif(_gpu_here(), reason="NVML finds a GPU here")


@without_gpu
def test_host_metrics_reach_the_collector(collector: Collector, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_id = run_name()
    t = Transport(agent_config(collector.address, tmp_path / "spool"), run_id, 0)
    t.start()
    t.submit(register())
    reporter = MetricsReporter(t, local_rank=0, interval_s=0.3)
    reporter.start()
    time.sleep(1.2)
    reporter.stop()
    t.close(timeout_s=30)
    rows = collector.query(
        "SELECT name, device, argMax(value, time) AS value, count() AS n FROM metrics WHERE run_id = {run:String}"
        " GROUP BY name, device ORDER BY name, device",
        run=run_id,
    )
    by_name = {(r["name"], r["device"]): r for r in rows}
    assert {"system.cpu.utilization", "system.memory.usage", "system.memory.limit", "system.memory.utilization"} <= {
        name for name, device in by_name if device == "host"
    }
    assert by_name["system.memory.limit", "host"]["value"] == host_memory()[1]
    assert 0 < by_name["system.memory.usage", "host"]["value"] < by_name["system.memory.limit", "host"]["value"]
    assert 0 <= by_name["system.cpu.utilization", "host"]["value"] <= 1
    assert by_name["system.cpu.utilization", "host"]["n"] >= 2  # exported every interval
    for interface, counters in network_counters().items():
        received = by_name[("system.network.io.receive", interface)]["value"]
        assert 0 <= received <= network_counters()[interface].rx_bytes
        assert ("system.network.packet.dropped.transmit", interface) in by_name
    assert not any(name.startswith("hw.") for name, _ in by_name)  # no GPU here
    assert [r.getMessage() for r in caplog.records if r.name == "rankscope.agent"] == []


@without_gpu
def test_no_gpu_and_not_first_on_host_reports_nothing(collector: Collector, tmp_path: Path) -> None:
    assert open_gpu(0) is None  # nvidia-ml-py without a driver: quietly no GPU
    run_id = run_name()
    t = Transport(agent_config(collector.address, tmp_path / "spool"), run_id, 1)
    t.start()
    reporter = MetricsReporter(t, local_rank=1, interval_s=0.2)
    reporter.start()
    threads = {th.name for th in threading.enumerate()}
    time.sleep(0.5)
    reporter.stop()
    t.close(timeout_s=30)
    assert reporter.gpu is None and not any("OtelPeriodicExportingMetricReader" in n for n in threads)
    assert t.stats().sent == 0


def test_without_the_gpu_extra_a_gpu_host_is_told_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """nvidia-ml-py missing: no GPU, and where an NVIDIA driver is loaded one line saying which extra
    brings the GPU metrics; on a machine without a driver, nothing."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not importable
    monkeypatch.setattr(config, "_warned", set())
    monkeypatch.setattr(hardware, "PROC", tmp_path)
    with caplog.at_level(logging.WARNING, logger="rankscope.agent"):
        assert open_gpu(0) is None
        assert caplog.records == []
        (tmp_path / "driver" / "nvidia").mkdir(parents=True)
        assert open_gpu(0) is None and open_gpu(1) is None
    assert [r.getMessage() for r in caplog.records] == [
        "rankscope agent: nvidia-ml-py is not installed: no GPU metrics (pip install 'rankscope[gpu]')"
    ]


def test_attributes_become_device_and_name_suffix() -> None:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader], shutdown_on_exit=False).get_meter("test")
    meter.create_observable_counter(
        "system.network.io",
        callbacks=[lambda _: [Observation(7, {"network.interface.name": "ib0", "network.io.direction": "transmit"})]],
    )
    meter.create_observable_gauge("hw.temperature", callbacks=[lambda _: [Observation(61.5, {"hw.id": "cuda:3"})]])
    meter.create_observable_gauge("system.cpu.utilization", callbacks=[lambda _: [Observation(0.25)]])
    batch = to_metric_batch(reader.get_metrics_data())
    assert batch is not None and batch.count == 3
    names = [batch.strings[i] for i in np.frombuffer(batch.name, "<i4")]
    devices = [batch.strings[i] for i in np.frombuffer(batch.device, "<i4")]
    values = np.frombuffer(batch.value, "<f8").tolist()
    assert sorted(zip(names, devices, values)) == [
        ("hw.temperature", "cuda:3", 61.5), ("system.cpu.utilization", "host", 0.25), ("system.network.io.transmit", "ib0", 7.0),
    ]  # fmt: skip
    assert np.all(np.frombuffer(batch.time_ns, "<i8") > 1_600_000_000 * 10**9)


# --- heartbeats and stacks -------------------------------------------------------------------------


def test_heartbeats_and_requested_stack_dump(collector: Collector, tmp_path: Path) -> None:
    """Heartbeats go on while the main thread sleeps; the collector's stack request is served."""
    run_id = run_name()
    t = Transport(agent_config(collector.address, tmp_path / "spool"), run_id, 0)
    state = RankState(step=3, phase="forward")
    beat = Heartbeat(state, t, interval_s=0.2, stall_s=60)
    t.on_command = beat.on_command
    t.start()
    t.submit(register())
    beat.start()
    wait_until(lambda: t.stats().acked >= 2, 30, "the first heartbeat's ack")
    with grpc.insecure_channel(collector.address) as channel:
        reply = query_pb2_grpc.QueryStub(channel).RequestStack(
            query_pb2.StackRequest(run_id=run_id, rank=0, reason="hang root"), metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
    assert reply.queued
    time.sleep(1.5)  # the main thread is "stuck": beats continue
    beat.stop()
    t.close(timeout_s=30)
    beats = collector.query("SELECT step, phase, status FROM heartbeats WHERE run_id = {run:String} ORDER BY time", run=run_id)
    assert len(beats) >= 6 and {(b["step"], b["phase"], b["status"]) for b in beats} == {(3, "forward", "running")}
    (stack,) = collector.query("SELECT reason, method, text FROM stacks WHERE run_id = {run:String}", run=run_id)
    assert (stack["reason"], stack["method"]) == ("requested", "py-spy")
    assert f"Process {os.getpid()}" in stack["text"] and "test_heartbeats_and_requested_stack_dump" in stack["text"]


@pytest.mark.slow
def test_stall_in_a_collective_is_seen_and_dumped_once(collector: Collector, torchrun, tmp_path: Path) -> None:
    """Rank 0 waits in an all_reduce that rank 1 joins 6 s late: beats go on, one stalled dump."""
    run_id = run_name()
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        import torch
        import torch.distributed as dist
        from test_agent_transport import agent_config, register
        from rankscope.agent.heartbeat import Heartbeat
        from rankscope.agent.state import InFlightOp, RankState
        from rankscope.agent.transport import Transport

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if rank == 1:
            time.sleep(6)
            dist.all_reduce(torch.ones(4))
        else:
            t = Transport(agent_config({collector.address!r}, Path({str(tmp_path / "spool")!r})), {run_id!r}, 0)
            t.start()
            t.submit(register())
            state = RankState(step=7, phase="backward")
            beat = Heartbeat(state, t, interval_s=0.3, stall_s=1.0)
            beat.start()
            state.enter(InFlightOp("dp[0]", 41, "all_reduce", -1, time.time_ns(), True))
            dist.all_reduce(torch.ones(4))
            state.leave("dp[0]", 41, "all_reduce", -1, time.time_ns())
            time.sleep(1.0)
            beat.stop()
            t.close(timeout_s=30)
        dist.destroy_process_group()
    """))
    proc = torchrun([str(script)], nproc=2)
    assert proc.wait(120) == 0, proc.output()
    beats = collector.query(
        "SELECT status, inflight_op, inflight_seq FROM heartbeats WHERE run_id = {run:String} ORDER BY time", run=run_id
    )
    statuses = [b["status"] for b in beats]
    assert "stalled" in statuses and statuses[-1] == "running", statuses
    stalled = [b for b in beats if b["status"] == "stalled"]
    assert len(stalled) >= 5 and all(b["inflight_op"] == ["all_reduce"] and b["inflight_seq"] == [41] for b in stalled)
    (stack,) = collector.query("SELECT reason, method, text FROM stacks WHERE run_id = {run:String}", run=run_id)
    assert (stack["reason"], stack["method"]) == ("stalled", "py-spy")
    assert "all_reduce" in stack["text"] and '"MainThread"' in stack["text"], stack["text"]


def test_python_frames_when_py_spy_is_missing(proc_runner: ProcRunner) -> None:
    """An interpreter without py-spy beside it or on PATH: Python's own frames, every thread."""
    venv_site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    script = textwrap.dedent(f"""
        import site, threading, time
        site.addsitedir({venv_site!r})
        from rankscope.agent.stacks import dump_stack

        def parked_here(event):
            event.wait()

        event = threading.Event()
        threading.Thread(target=parked_here, args=(event,), name="parked").start()
        time.sleep(0.2)
        dump = dump_stack("stalled")
        event.set()
        print(dump.method)
        print(dump.text)
    """)
    base_python = str(Path(sys.base_prefix) / "bin" / "python3")
    proc = proc_runner.start([base_python, "-c", script], env={"PATH": "/usr/bin:/bin"}, name="no-py-spy")
    assert proc.wait(60) == 0, proc.output()
    method, text = proc.stdout.split("\n", 1)
    assert method == "python-frames"
    assert 'Thread' in text and '"parked"' in text and "parked_here" in text and '"MainThread"' in text
    assert proc.stderr.strip() == "rankscope agent: py-spy is not installed: stack dumps use Python's own frames (pip install 'rankscope[stacks]')"


def test_heartbeat_counts_the_agents_drops(tmp_path: Path) -> None:
    t = Transport(agent_config(f"127.0.0.1:{free_port()}", tmp_path / "spool"), run_name(), 0, max_queue_bytes=1)
    state = RankState()
    state.dropped = 5  # what the recorder and the runtime lost (refused submits included)
    beat = Heartbeat(state, t, interval_s=60, stall_s=60)
    heartbeat = beat.beat()  # the 1-byte queue refuses the heartbeat itself: counted as well
    assert heartbeat.events_dropped == 5 and heartbeat.status == "running"
    assert state.dropped == 6 and t.stats().rejected == 1
    t.close(timeout_s=0)


def test_beats_go_on_while_a_stack_dump_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dump that takes seconds (py-spy on a loaded host: up to its 10 s timeout) runs beside the beats:
    a host-mate taking a stopped rank's stack was judged silent with it while its beats waited (CI of 11134ce)."""
    from rankscope.agent import heartbeat as heartbeat_module
    from rankscope.protos.v1 import telemetry_pb2

    taking, release = threading.Event(), threading.Event()

    def slow_dump(reason: str) -> telemetry_pb2.StackDump:
        taking.set()
        release.wait(30)
        return telemetry_pb2.StackDump(time_ns=time.time_ns(), reason=reason, method="py-spy", text="slow")

    monkeypatch.setattr(heartbeat_module, "dump_stack", slow_dump)
    submitted: list[object] = []
    monkeypatch.setattr(heartbeat_module.Heartbeat, "_submit", lambda self, payload: submitted.append(payload))
    t = Transport(agent_config(f"127.0.0.1:{free_port()}", tmp_path / "spool"), run_name(), 0)
    beat = Heartbeat(RankState(step=2), t, interval_s=0.05, stall_s=60)
    beat.start()
    try:
        beat.on_command(ingest_pb2.Command(stack_dump=ingest_pb2.StackDumpRequest()))
        assert taking.wait(30)
        beats = lambda: sum(isinstance(p, telemetry_pb2.HeartbeatBatch) for p in submitted)  # noqa: E731
        before = beats()
        wait_until(lambda: beats() >= before + 5, 30, "five beats while the dump is taken")
        assert not any(isinstance(p, telemetry_pb2.StackDump) for p in submitted)  # still being taken
        release.set()
        wait_until(lambda: any(isinstance(p, telemetry_pb2.StackDump) for p in submitted), 30, "the dump, once taken")
    finally:
        release.set()
        beat.stop()
        t.close(timeout_s=0)
