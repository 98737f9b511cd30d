"""What a collector promises across its own death: SIGTERM flushes and acknowledges, a restart on
the same store finds every acknowledged row, recognises batches it already stored, and knows the
runs and ranks registered before it started; a kill -9 at any moment loses and duplicates nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from test_collector_ingest import end, heartbeats, register, spans
from conftest import start_collector

from rankscope.collector.client import Client
from rankscope.harness import collector_kills
from rankscope.protos.v1 import ingest_pb2_grpc

if TYPE_CHECKING:
    from conftest import ProcRunner

pytestmark = pytest.mark.slow


def test_acknowledged_batches_survive_sigterm_and_restart(proc_runner: ProcRunner, tmp_path: Path) -> None:
    store, run = tmp_path / "data", "restart"
    before_ns = time.time_ns()  # the registrations below carry no time of their own: they are versioned on arrival
    # A flush interval of a minute: the batches are still buffered when SIGTERM comes.
    first = start_collector(proc_runner, store, "--flush-interval", "60", name="first")
    batches = [register(run, rank, 2, host=f"node-{rank}") for rank in range(2)] + [spans(run, rank, 1000) for rank in range(2)]
    with grpc.insecure_channel(first.target) as channel:
        stub = ingest_pb2_grpc.IngestStub(channel)
        pending = [stub.Send.future(batch, timeout=60) for batch in batches]
        time.sleep(1.0)
        assert not any(f.done() for f in pending), "acknowledged before being written"
        first.proc.popen.terminate()
        acks = [f.result(timeout=30) for f in pending]
    assert [ack.batch_id for ack in acks] == [b.batch_id for b in batches] and not any(a.duplicate for a in acks)
    assert first.proc.wait(30) == 0, first.proc.output()

    second = start_collector(proc_runner, store, "--flush-interval", "0.2", name="second")
    with grpc.insecure_channel(second.target) as channel:
        stub = ingest_pb2_grpc.IngestStub(channel)
        assert stub.Send(batches[2], timeout=30).duplicate  # stored by the first collector
        stub.Send(heartbeats(run, 1), timeout=30)
        # An older registration of rank 0 arriving now (a spool replay) undoes nothing the first collector stored.
        stub.Send(register(run, 0, 2, time_ns=before_ns, placed=False), timeout=30)
        for rank in range(2):
            stub.Send(end(run, rank), timeout=30)
    with Client(second.target) as client:
        assert client.query("SELECT count() AS n FROM spans WHERE run_id = {run:String}", {"run": run}).to_pylist() == [{"n": 2000}]
        # The host of a rank registered with the first collector, and the run's size, are known.
        assert client.query("SELECT host FROM heartbeats WHERE run_id = {run:String}", {"run": run}).to_pylist() == [{"host": "node-1"}]
        status = client.query("SELECT status, world_size, dp FROM runs FINAL WHERE run_id = {run:String}", {"run": run}).to_pylist()
        assert status == [{"status": "finished", "world_size": 2, "dp": 2}]
        places = "SELECT rank, argMax(dp_rank, registered) AS dp_rank FROM ranks WHERE run_id = {run:String} GROUP BY rank ORDER BY rank"
        assert client.query(places, {"run": run}).to_pylist() == [{"rank": 0, "dp_rank": 0}, {"rank": 1, "dp_rank": 1}]


@pytest.mark.foreground  # a healthy run that must raise no false alarm
@pytest.mark.timeout(300)
def test_a_collector_killed_three_times_mid_run_stores_every_row_once_and_names_nobody(tmp_path: Path) -> None:
    """kill -9 at three seeded random moments of an 8-rank run, restarted each time on the same store:
    every row the ranks sent is stored exactly once (a killed flush cycle is rolled back, the spools
    replay it), and the healthy run has no incident (the collector's downtime is nobody's silence)."""
    outcome = collector_kills.run_with_kills(tmp_path, kills=3, seed=30, steps=100)  # room for slow restarts on a busy machine
    assert outcome.rc == 0 and len(outcome.kills_s) == 3
    report = collector_kills.table([outcome])
    assert all(c.sent > 0 for c in outcome.counted), report
    assert [(c.table, c.duplicated, c.lost) for c in outcome.counted] == [(c.table, 0, 0) for c in outcome.counted], report
    assert outcome.incidents == []
