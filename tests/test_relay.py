"""A host's relay (rankscope/agent/node_relay.py, relay_merge.py, the Transport's fallback).

The merge in process: several ranks' batches of a kind become one whose rows the collector stores
exactly as it stores the ranks' own. The relay end to end: a real 4-rank training run (``rankscope
train``, which starts the relay on $RANKSCOPE_RELAY) sends through a relay that is killed with
SIGKILL mid-run; the ranks go on to the collector directly, adopt what the relay left in its spool,
and the run is whole in the store, no row twice. The relay killed between its spool's write and its
reply (its test hook): the ranks' Transports send those batches again themselves, and the
collector stores every row once, whichever of the two copies comes first; they come back to the
relay started next, and a real agent behind it gets the stack dump the collector asks of it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CLI, ProcRunner, start_collector

from rankscope.agent.config import load_config
from rankscope.common.listening import answers
from rankscope.agent.node_relay import DIE_AFTER_SPOOL
from rankscope.agent.relay_merge import merge, select
from rankscope.agent.relay_merge import rows as counted
from rankscope.agent.transport import Transport
from rankscope.collector.decode import decode
from rankscope.collector.relay_parts import held_parts
from rankscope.collector.run_registry import RunRegistry
from rankscope.healing.elastic import agent_command, relay_socket
from rankscope.protos.v1 import ingest_pb2
from rankscope.protos.v1 import telemetry_pb2 as pb
from test_collector_ingest import envelope, metrics, register, spans


@pytest.mark.timeout(30)
def test_merged_batches_are_stored_as_the_ranks_own_and_a_bad_one_is_refused_alone() -> None:
    registry = RunRegistry()
    for rank in range(3):
        decode(register("r", rank, 3, host=f"node-{rank}"), registry, time.time_ns())
    own = [(rank, spans("r", rank, 3 + rank).spans) for rank in range(3)]
    own[1][1].strings[:] = ["other", *own[1][1].strings]  # a different string table: indices move
    own[1][1].name = (np.frombuffer(own[1][1].name, "<i4") + 1).astype("<i4").tobytes()
    own[1][1].attributes = np.where(np.frombuffer(own[1][1].attributes, "<i4") < 0, -1, np.frombuffer(own[1][1].attributes, "<i4") + 1).astype("<i4").tobytes()
    now = time.time_ns()
    separately = [decode(envelope("r", rank, spans=payload), registry, now).parts["spans"].to_pylist() for rank, payload in own]
    merged = decode(envelope("r", 0, spans=merge("spans", own)), registry, now)
    assert merged.parts["spans"].to_pylist() == [row for rows in separately for row in rows]
    assert merged.ranks == (0, 1, 2)
    beats = [(rank, pb.HeartbeatBatch(heartbeats=[pb.Heartbeat(time_ns=now, step=2, phase="forward", status="running")])) for rank in range(3)]
    assert decode(envelope("r", 0, heartbeats=merge("heartbeats", beats)), registry, now).parts["heartbeats"]["rank"].to_pylist() == [0, 1, 2]
    # the parts a relay names with it count a rank's heartbeats, sent as a list (agent.heartbeat), as the merged columns' rows
    held = ingest_pb2.Batch(run_id="r", batch_id=b"r" * 16, heartbeats=merge("heartbeats", beats),
                            parts=[ingest_pb2.BatchPart(rank=r, batch_id=bytes([r]) * 16, count=counted("heartbeats", p)) for r, p in beats])  # fmt: skip
    assert [k.rank for k in held_parts(held, "heartbeats")] == [0, 1, 2]
    # the way back, for the collector: the rows of the parts not stored before, as if merged alone
    def rows(kind: str, payload: pb.SpanBatch | pb.HeartbeatBatch) -> dict[str, list[dict]]:
        return {table: t.to_pylist() for table, t in decode(envelope("r", 0, **{kind: payload}), registry, now).parts.items()}

    assert rows("spans", select("spans", merge("spans", own), [3, 4, 5], [True, False, True])) == rows("spans", merge("spans", [own[0], own[2]]))
    waiting = [pb.InFlight(group="world", seq=s, op="all_reduce", peer=-1, issue_ns=now) for s in range(3)]
    beats[1][1].heartbeats[0].in_flight.extend(waiting[:2])
    beats[2][1].heartbeats[0].in_flight.extend(waiting[2:])
    kept = rows("heartbeats", select("heartbeats", merge("heartbeats", beats), [1, 1, 1], [False, True, False]))
    assert kept == rows("heartbeats", merge("heartbeats", [beats[1]])) and kept["heartbeats"][0]["inflight_seq"] == [0, 1], kept
    bad = spans("r", 2, 2).spans
    bad.name = bad.name[:-1]
    with pytest.raises(ValueError, match="name: 7 bytes"):
        merge("spans", [own[0], (2, bad)])
    # the ends (and registrations) of senders that speak for several ranks: one batch, each part's entries kept or left out whole
    end = pb.EndOfRank(time_ns=now, reason=pb.EndOfRank.REASON_NORMAL)
    ends = [(0, pb.EndBatch(ends=[end], ranks=[0])), (1, pb.EndBatch(ends=[end, end], ranks=[1, 2]))]
    exits = rows("ends", merge("ends", ends))["exits"]
    assert [e["rank"] for e in exits] == [0, 1, 2] and exits == [*rows("ends", ends[0][1])["exits"], *rows("ends", ends[1][1])["exits"]]
    assert select("ends", merge("ends", ends), [1, 2], [False, True]) == ends[1][1]


#: a real agent: steps of 50 ms until killed
AGENT = """
import time, rankscope.agent as agent
assert agent.init()
for step in range(1, 10**6):
    agent.set_step(step)
    with agent.span("forward", kind="compute"):
        time.sleep(0.05)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_relay_killed_between_its_spool_and_its_reply_stores_nothing_twice_and_its_ranks_come_back_to_the_next(
    proc_runner: ProcRunner, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "rankscope.agent")
    collector = start_collector(proc_runner, tmp_path / "store", "--flush-interval", "0.3", "--no-diagnosis")
    spool, socket = tmp_path / "spool", f"unix:{tmp_path / 'relay.sock'}"
    relay = proc_runner.start([*CLI, "relay", "--listen", socket, "--collector", collector.target, "--spool-dir", str(spool), "--flush", "0.5"],
                              env={DIE_AFTER_SPOOL: "spans"}, name="relay")  # fmt: skip
    relay.wait_for("ready on", 60)
    config = load_config({"RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": collector.target, "RANKSCOPE_RELAY": socket, "RANKSCOPE_SPOOL_DIR": str(spool)})
    assert config is not None
    ranks = [Transport(config, "parts", rank) for rank in range(2)]
    for rank, transport in enumerate(ranks):
        transport.start()
        transport.submit(register("parts", rank, 2, host="node-0").register)
        transport.submit(spans("parts", rank, 5 + rank).spans)  # merged into one batch, spooled, and then the relay dies
    assert relay.wait(60) == -signal.SIGKILL, relay.output()
    for rank, transport in enumerate(ranks):
        transport.submit(spans("parts", rank, 7).spans)  # to the collector directly: the relay is gone
    deadline = time.monotonic() + 60
    while sum(t.stats().duplicates for t in ranks) < 1:  # the second copy of the merged batch's parts
        assert time.monotonic() < deadline, [t.stats() for t in ranks]
        time.sleep(0.2)
    relay = proc_runner.start([*CLI, "relay", "--listen", socket, "--collector", collector.target, "--spool-dir", str(spool)], name="relay-again")
    relay.wait_for("ready on", 60)
    deadline = time.monotonic() + 60
    while sum("answers again" in r.getMessage() for r in caplog.records) < len(ranks):  # each rank looks every 5 s
        assert time.monotonic() < deadline, relay.output()
        time.sleep(0.2)
    for rank, transport in enumerate(ranks):
        transport.submit(spans("parts", rank, 9).spans)
        transport.submit(metrics("parts", rank).metrics)  # 2 gauges: a kind passed on one by one
        transport.close(60)
    # a real agent behind the relay: a stack the collector asks of it reaches it through the relay
    agent = proc_runner.start([sys.executable, "-c", AGENT], name="agent", env={
        "RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": collector.target, "RANKSCOPE_RELAY": socket, "RANKSCOPE_SPOOL_DIR": str(spool),
        "RANKSCOPE_RUN_ID": "stacked", "RANK": "0", "WORLD_SIZE": "1", "RANKSCOPE_HEARTBEAT_S": "0.5"})  # fmt: skip
    from rankscope.collector.client import Client

    with Client(collector.target) as client:
        assert client.request_stack("stacked", 0, "test")
        deadline = time.monotonic() + 60
        while not (stacks := client.query("SELECT rank, reason FROM stacks WHERE run_id = 'stacked'", {}).to_pylist()):
            assert agent.returncode is None and time.monotonic() < deadline, f"{agent.output()}\n{relay.output()}"
            time.sleep(0.3)
        assert stacks == [{"rank": 0, "reason": "requested"}], stacks
    agent.kill()
    assert "does not answer" not in agent.stderr, agent.output()  # the agent sent through the relay only
    relay.popen.send_signal(signal.SIGTERM)
    assert relay.wait(60) == 0 and "by run: parts 4, stacked" in relay.stderr, relay.output()  # the ranks' later batches, through it
    assert not list(spool.glob("*.seg")), "what the relays spooled was adopted or sent, and acknowledged"
    with Client(collector.target) as client:
        deadline = time.monotonic() + 60
        while (stored := client.query(
            "SELECT rank, count() AS rows, uniqExact(start_time) AS distinct_rows FROM spans WHERE run_id = 'parts' GROUP BY rank ORDER BY rank",
            {}).to_pylist()) != [{"rank": 0, "rows": 21, "distinct_rows": 21}, {"rank": 1, "rows": 22, "distinct_rows": 22}]:  # fmt: skip
            assert time.monotonic() < deadline, stored
            time.sleep(0.3)
        assert client.query("SELECT count() AS n FROM metrics WHERE run_id = 'parts'", {})["n"][0].as_py() == 4


STEPS = 40
TRAIN = [*CLI, "train", "--tp", "1", "--pp", "2", "--dp", "2", "--layers", "2", "--hidden", "128", "--heads", "4", "--seq", "64",
         "--vocab", "256", "--micro-batch", "2", "--global-batch", "8", "--steps", str(STEPS)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_relay_killed_mid_run_loses_nothing_and_stores_nothing_twice(proc_runner: ProcRunner, tmp_path: Path) -> None:
    collector = start_collector(proc_runner, tmp_path / "store", "--flush-interval", "0.3", "--no-diagnosis")
    spool, socket = tmp_path / "spool", f"unix:{tmp_path / 'relay.sock'}"
    env = {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": collector.target, "RANKSCOPE_RELAY": socket, "RANKSCOPE_RUN_ID": "relayed",
           "RANKSCOPE_SPOOL_DIR": str(spool), "RANKSCOPE_HEARTBEAT_S": "0.5", "RANKSCOPE_FLUSH_S": "0.5", "OMP_NUM_THREADS": "1"}  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    train = proc_runner.start([*TRAIN, "--metrics-json", str(metrics)], env=env, name="train")
    deadline = time.monotonic() + 180
    while _last_step(metrics) < STEPS // 3:
        assert train.returncode is None and time.monotonic() < deadline, train.output()
        time.sleep(0.2)
    assert list(spool.glob("relay-relayed-*.lock")), "the relay spools what it acknowledges"
    (relay,) = [pid for pid in _children(train.pid) if b"\0relay" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # rankscope train's
    killed_ns = time.time_ns()
    os.kill(relay, signal.SIGKILL)
    assert train.wait(240) == 0, train.output()
    assert "does not answer" in train.stderr, train.output()  # the ranks went to the collector themselves
    from rankscope.collector.client import Client

    with Client(collector.target) as client:
        deadline = time.monotonic() + 120
        while client.query("SELECT count() AS n FROM exits WHERE run_id = 'relayed'", {})["n"][0].as_py() < 4:
            assert time.monotonic() < deadline, f"every rank's end arrives\n{train.output()}\n{collector.proc.output()}"
            time.sleep(0.3)
        spans_per_rank = client.query(
            "SELECT rank, uniqExact(step) AS steps, count() AS rows, uniqExact(step, name, microbatch, attributes, start_time) AS distinct_rows "
            "FROM spans WHERE run_id = 'relayed' AND step > 0 GROUP BY rank ORDER BY rank", {}).to_pylist()  # fmt: skip
        collectives = client.query(
            "SELECT rank, count() AS rows, uniqExact(group_name, seq, op, peer) AS distinct_rows, max(step) AS last "
            "FROM collectives WHERE run_id = 'relayed' GROUP BY rank ORDER BY rank", {}).to_pylist()  # fmt: skip
        beats = client.query("SELECT count() AS rows, uniqExact(rank, time) AS distinct_rows FROM heartbeats WHERE run_id = 'relayed'", {}).to_pylist()[0]
        relayed_beats = client.query("SELECT rank, count() AS n FROM heartbeats WHERE run_id = 'relayed' AND toUnixTimestamp64Nano(time) < "
                                     "{killed:Int64} GROUP BY rank ORDER BY rank", {"killed": killed_ns}).to_pylist()  # fmt: skip
    assert [r["rank"] for r in spans_per_rank] == [0, 1, 2, 3]
    for r in spans_per_rank:
        assert r["steps"] == STEPS and r["rows"] == r["distinct_rows"], r  # every step, before and after the kill; none twice
    for r in collectives:
        assert r["last"] == STEPS and r["rows"] == r["distinct_rows"], r
    assert beats["rows"] == beats["distinct_rows"] > 0, beats
    assert [r["rank"] for r in relayed_beats] == [0, 1, 2, 3], relayed_beats  # every rank's heartbeats, through the relay too
    assert not list(spool.glob("*.seg")), "what the relay left was adopted and acknowledged"


def _children(pid: int) -> list[int]:
    return [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat") if _parent(p) == pid]


def _parent(stat: Path) -> int:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return -1


def _last_step(metrics: Path) -> int:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


#: a host's command under `rankscope launch`: whether its relay answers at the address its ranks are given
SEES_RELAY = "import os, sys; from rankscope.common.listening import answers; r = os.environ['RANKSCOPE_RELAY']; print(r, answers(r)); sys.exit(3)"


@pytest.mark.timeout(60)
def test_a_launched_host_runs_beside_a_relay_of_its_own(tmp_path: Path) -> None:
    env = {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_RELAY": f"unix:{tmp_path / 'relay.sock'}", "RANKSCOPE_COLLECTOR": "127.0.0.1:1"}
    listen = relay_socket(env, "h1")  # the hosts may share the file system (a test bed's, a cluster's home directories)
    assert listen == f"unix:{tmp_path / 'relay-h1.sock'}" and relay_socket({**env, "RANKSCOPE_ENABLE": "0"}, "h1") is None
    command = agent_command(["-c", "pass"], run_id="r", nnodes="1", ranks_per_host=1, endpoint="x:1", max_restarts=0, rdzv_conf={}, relay=listen)
    assert command[:7] == [sys.executable, "-m", "rankscope.agent.host_relay", "--listen", listen, "--", sys.executable]
    done = subprocess.run([*command[:6], sys.executable, "-c", SEES_RELAY], env={**os.environ, **env, "RANKSCOPE_SPOOL_DIR": str(tmp_path / "spool")},
                          capture_output=True, text=True, timeout=50)  # fmt: skip
    assert (done.returncode, done.stdout) == (3, f"{listen} True\n"), done  # the command's own status, its relay up
    assert "rankscope relay: stopped" in done.stderr and not answers(listen), done.stderr  # and stopped after it
