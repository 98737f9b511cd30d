"""How far a run got, as a real collector heard it (rankscope/collector/progress.py): what
``rankscope testbed fault --at-step`` and the scenarios wait on before they apply a fault."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from conftest import start_collector
from test_collector_ingest import heartbeats, register

from rankscope.collector.client import Client
from rankscope.collector.progress import wait_for_step
from rankscope.protos.v1 import ingest_pb2_grpc

if TYPE_CHECKING:
    from conftest import ProcRunner

pytestmark = pytest.mark.slow


def test_a_fault_at_a_step_waits_for_the_run_heard_since_the_wait_began(proc_runner: ProcRunner, tmp_path: Path) -> None:
    collector = start_collector(proc_runner, tmp_path / "data", "--flush-interval", "0.2")
    with grpc.insecure_channel(collector.target) as channel, Client(collector.target) as client:
        stub = ingest_pb2_grpc.IngestStub(channel)
        for batch in (register("earlier", 0, 1), heartbeats("earlier", 0, step=9)):
            stub.Send(batch, timeout=30)
        assert wait_for_step(client, 9, run_id="earlier", timeout_s=30) == "earlier"
        since = time.time_ns()
        found: list[str | None] = []
        waiter = threading.Thread(target=lambda: found.append(wait_for_step(client, 3, since_ns=since, timeout_s=60)))
        waiter.start()
        for batch in (register("now", 0, 1), heartbeats("now", 0, step=1)):
            stub.Send(batch, timeout=30)
        time.sleep(1.0)  # two flushes: the new run at step 1 is in the store, and the earlier run at 9 is older than the wait
        assert waiter.is_alive() and not found
        stub.Send(heartbeats("now", 0, step=3), timeout=30)
        waiter.join(30)
        assert found == ["now"]
        assert wait_for_step(client, 4, run_id="now", stop=lambda: True) is None  # the job ended first: nothing to wait for
        with pytest.raises(TimeoutError, match="did not reach step 4"):
            wait_for_step(client, 4, run_id="now", timeout_s=0.5)


def test_a_collector_not_up_yet_is_asked_again(tmp_path: Path) -> None:
    """The page starts the collector and the fault side by side: a refused connection is not yet."""
    with Client(f"unix:{tmp_path / 'nobody.sock'}") as client, pytest.raises(TimeoutError):
        wait_for_step(client, 1, timeout_s=1.0, poll_s=0.1)
