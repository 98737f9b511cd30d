"""Batch -> Arrow tables (rankscope/collector/decode.py, with the run registry and liveness it feeds),
in-process; also the batch builders the collector's end-to-end tests send.

Batches are built here the way the protocol defines them: numpy columns packed with tobytes().
"""

from __future__ import annotations

import math
import os
import re
import time

import numpy as np
import pytest

from rankscope.collector.batch_columns import IngestError, TimeWindow
from rankscope.collector.batch_limits import UnregisteredRun
from rankscope.collector.decode import REGISTRATIONS, RUN_LEVEL, UnsupportedSchemaVersion, decode
from rankscope.collector.run_registry import RunRegistry
from rankscope.collector.store.base import arrow_schema
from rankscope.collector.store.schema import BY_NAME
from rankscope.protos.v1 import ingest_pb2, telemetry_pb2

# --- builders (imported by test_collector_server.py and test_sql_cli.py) ------------------------


def envelope(run_id: str, rank: int, *, offset_ns: int = 0, **payload: object) -> ingest_pb2.Batch:
    return ingest_pb2.Batch(
        schema_version=1, run_id=run_id, rank=rank, batch_id=os.urandom(16), clock_offset_ns=offset_ns,
        sent_ns=time.time_ns(), **payload,
    )


def register(
    run_id: str, rank: int, world_size: int, *, host: str = "node-0", start_ns: int | None = None, time_ns: int = 0, placed: bool = True,
    world: str = "",
) -> ingest_pb2.Batch:
    """A data-parallel rank's registration; ``placed=False``: one sent before the script set the
    topology (sizes 1, coordinates -1)."""
    groups = [telemetry_pb2.Group(name="world", description="all ranks", ranks=list(range(world_size)))]
    dp, coords = (world_size, (0, 0, rank)) if placed else (1, (-1, -1, -1))
    reg = telemetry_pb2.Register(
        world_size=world_size, host=host, pid=1000 + rank, local_rank=rank, device="cpu", tp=1, pp=1, dp=dp,
        tp_rank=coords[0], pp_rank=coords[1], dp_rank=coords[2], groups=groups, run_name=f"job {run_id}",
        config_json='{"lr": 0.1}', start_time_ns=start_ns or time.time_ns(), agent_version="test", time_ns=time_ns,
        world=world,
    )
    return envelope(run_id, rank, register=reg)


def spans(run_id: str, rank: int, n: int, *, step: int = 1, t0: int | None = None, offset_ns: int = 0) -> ingest_pb2.Batch:
    """n spans alternating forward/backward, 1 us apart, 500 ns long; every other one with attributes."""
    t0 = t0 or time.time_ns()
    i = np.arange(n, dtype=np.int64)
    batch = telemetry_pb2.SpanBatch(
        count=n,
        strings=["forward", "backward", '{"layer": 3}'],
        name=(i % 2).astype("<i4").tobytes(),
        kind=(i % 5).astype("u1").tobytes(),
        step=np.full(n, step, "<i4").tobytes(),
        microbatch=(i % 4 - 1).astype("<i4").tobytes(),
        start_ns=(t0 + i * 1000).astype("<i8").tobytes(),
        end_ns=(t0 + i * 1000 + 500).astype("<i8").tobytes(),
        attributes=np.where(i % 2 == 0, -1, 2).astype("<i4").tobytes(),
    )
    return envelope(run_id, rank, offset_ns=offset_ns, spans=batch)


def collectives(run_id: str, rank: int, t0: int | None = None) -> ingest_pb2.Batch:
    """Three operations: a completed all_reduce, a failed send, a pending recv (start/end unknown)."""
    t0 = t0 or time.time_ns()
    batch = telemetry_pb2.CollectiveBatch(
        count=3,
        strings=["world", "all_reduce", "send", "recv", "float32"],
        group=np.zeros(3, "<i4").tobytes(),
        seq=np.array([1, 2, 3], "<i8").tobytes(),
        op=np.array([1, 2, 3], "<i4").tobytes(),
        nbytes=np.array([4096, 64, 64], "<i8").tobytes(),
        dtype=np.full(3, 4, "<i4").tobytes(),
        peer=np.array([-1, 1, 1], "<i4").tobytes(),
        issue_ns=(t0 + np.arange(3) * 10).astype("<i8").tobytes(),
        start_ns=np.array([t0 + 1, t0 + 11, 0], "<i8").tobytes(),
        end_ns=np.array([t0 + 5, 0, 0], "<i8").tobytes(),
        state=np.array([0, 1, 2], "u1").tobytes(),
        step=np.ones(3, "<i4").tobytes(),
    )
    return envelope(run_id, rank, collectives=batch)


def heartbeats(run_id: str, rank: int, *, step: int = 1) -> ingest_pb2.Batch:
    now = time.time_ns()
    waiting = telemetry_pb2.InFlight(group="world", seq=7, op="all_reduce", peer=-1, issue_ns=now - 5_000, waiting=True)
    beat = telemetry_pb2.Heartbeat(
        time_ns=now, step=step, phase="forward", status="stalled", last_progress_ns=now - 10_000, in_flight=[waiting], events_dropped=3,
    )
    return envelope(run_id, rank, heartbeats=telemetry_pb2.HeartbeatBatch(heartbeats=[beat]))


def metrics(run_id: str, rank: int) -> ingest_pb2.Batch:
    now = time.time_ns()
    batch = telemetry_pb2.MetricBatch(
        count=2, strings=["gpu.utilization", "cuda:0", "host"],
        time_ns=np.array([now, now + 1], "<i8").tobytes(), name=np.zeros(2, "<i4").tobytes(),
        device=np.array([1, 2], "<i4").tobytes(), value=np.array([0.5, 0.75], "<f8").tobytes(),
    )
    return envelope(run_id, rank, metrics=batch)


def step_metrics(run_id: str, rank: int) -> ingest_pb2.Batch:
    now = time.time_ns()
    batch = telemetry_pb2.StepMetricBatch(
        count=2, strings=["loss"], step=np.array([1, 2], "<i4").tobytes(), name=np.zeros(2, "<i4").tobytes(),
        value=np.array([2.5, math.nan], "<f8").tobytes(), time_ns=np.array([now, now + 1], "<i8").tobytes(),
    )
    return envelope(run_id, rank, step_metrics=batch)


def stack(run_id: str, rank: int, text: str = "Thread 1 (idle)\n  train (train.py:10)") -> ingest_pb2.Batch:
    dump = telemetry_pb2.StackDump(time_ns=time.time_ns(), reason="requested", method="py-spy", text=text)
    return envelope(run_id, rank, stack=dump)


def end(run_id: str, rank: int, reason: int = 0, exit_code: int = 0) -> ingest_pb2.Batch:
    last = telemetry_pb2.EndOfRank(time_ns=time.time_ns(), reason=reason, exit_code=exit_code, message="" if reason == 0 else "boom")  # type: ignore[arg-type]
    return envelope(run_id, rank, end=last)


# --- decoding ----------------------------------------------------------------------------------


def _decode(batch: ingest_pb2.Batch, registry: RunRegistry | None = None, window: TimeWindow = TimeWindow()):
    """``batch`` decoded; without a ``registry``, in one where its run is registered (a world of 16)
    when its rows need that."""
    if registry is None:
        registry = RunRegistry()
        if batch.WhichOneof("payload") not in (*REGISTRATIONS, *RUN_LEVEL):
            decode(register(batch.run_id, 0, 16), registry, time.time_ns())
    return decode(batch, registry, time.time_ns(), window)


def test_every_payload_gives_exactly_the_insert_columns_of_its_tables() -> None:
    registry = RunRegistry()
    batches = [
        register("r", 0, 2), spans("r", 0, 10), collectives("r", 0), heartbeats("r", 0), metrics("r", 0),
        step_metrics("r", 0), stack("r", 0), end("r", 0), _registers("r", [0, 1], 2),
        envelope("r", 0, ends=telemetry_pb2.EndBatch(ends=[end("r", 1).end], ranks=[1])),
    ]
    touched = set()
    for batch in batches:
        for name, table in _decode(batch, registry).parts.items():
            assert table.schema.equals(arrow_schema(BY_NAME[name])), name
            touched.add(name)
    assert touched == {"runs", "ranks", "groups", "spans", "collectives", "heartbeats", "metrics", "step_metrics", "stacks", "exits"}


def test_spans_columns_come_from_the_bytes_with_the_clock_offset_added() -> None:
    t0 = time.time_ns()
    decoded = _decode(spans("r", 3, 4, step=7, t0=t0, offset_ns=-250))
    assert decoded.kind == "spans" and list(decoded.parts) == ["spans"]
    rows = decoded.parts["spans"].to_pydict()
    assert rows["rank"] == [3] * 4 and rows["step"] == [7] * 4
    assert rows["name"] == ["forward", "backward", "forward", "backward"]
    assert rows["kind"] == ["compute", "comm", "data", "optimizer"]
    assert rows["microbatch"] == [-1, 0, 1, 2]
    assert rows["attributes"] == ["", '{"layer": 3}', "", '{"layer": 3}']
    starts = decoded.parts["spans"]["start_time"].cast("int64").to_pylist()
    assert starts == [t0 - 250 + k * 1000 for k in range(4)]


def test_collectives_keep_unknown_times_at_zero_and_name_states() -> None:
    t0 = time.time_ns()
    batch = collectives("r", 0, t0)
    batch.clock_offset_ns = 100
    rows = _decode(batch).parts["collectives"]
    assert rows["state"].to_pylist() == ["completed", "failed", "pending"]
    assert rows["op"].to_pylist() == ["all_reduce", "send", "recv"]
    assert rows["start_time"].cast("int64").to_pylist() == [t0 + 101, t0 + 111, 0]
    assert rows["end_time"].cast("int64").to_pylist() == [t0 + 105, 0, 0]


def test_heartbeats_and_stacks_get_the_host_of_the_registration() -> None:
    registry = RunRegistry()
    _decode(register("r", 1, 2, host="node-7"), registry)
    beat = _decode(heartbeats("r", 1), registry).parts["heartbeats"].to_pylist()[0]
    assert beat["host"] == "node-7" and beat["inflight_group"] == ["world"] and beat["inflight_waiting"] == [1]
    assert _decode(stack("r", 1), registry).parts["stacks"]["host"].to_pylist() == ["node-7"]
    assert _decode(heartbeats("r", 0), registry).parts["heartbeats"]["host"].to_pylist() == [""]  # never registered


def test_the_last_rank_to_end_closes_the_run() -> None:
    registry = RunRegistry()
    for rank in range(2):
        _decode(register("r", rank, 2), registry)
    assert "runs" not in _decode(end("r", 0), registry).parts
    last = _decode(end("r", 1, reason=1, exit_code=3), registry).parts
    assert last["exits"].to_pylist()[0]["reason"] == "exit_code"
    run = last["runs"].to_pylist()[0]
    assert run["status"] == "failed" and run["world_size"] == 2 and run["name"] == "job r"
    assert registry.has_ended("r", 1)


def test_a_restarted_job_is_one_run_whose_rows_carry_their_attempt() -> None:
    """torchrun restarts every worker with fewer hosts: the same run id, a new world (store address
    and size) numbered by the collector, the same ranks on other hosts (whose clocks may be behind),
    and the old processes' rows and ends arriving late."""
    registry = RunRegistry()
    first = [register("r", rank, 3, host=f"node-{rank}", world="10.0.0.1:5000/3") for rank in range(3)]
    for batch in first:
        _decode(batch, registry)
    again = []
    for rank in range(2):  # the next round on two hosts, registered with a clock a minute behind
        batch = register("r", rank, 2, host=f"node-{rank + 1}", start_ns=time.time_ns() - 60 * 10**9, world="10.0.0.2:6000/2")
        again.append((batch, _decode(batch, registry).parts))
    assert [p["ranks"].to_pylist()[0]["attempt"] for _, p in again] == [1, 1]
    assert again[1][1]["runs"].to_pylist()[0]["world_size"] == 2 and registry.host("r", 1) == "node-2"
    late = end("r", 0, reason=3)  # the first round's rank 0, stopped by torchrun, from its own process
    late.batch_id = first[0].batch_id[:8] + bytes(8)
    parts = _decode(late, registry).parts
    assert parts["exits"].to_pylist()[0]["attempt"] == 0 and "runs" not in parts and not registry.has_ended("r", 0)
    beat = heartbeats("r", 1)
    beat.batch_id = again[1][0].batch_id[:8] + bytes(8)
    assert _decode(beat, registry).parts["heartbeats"].to_pylist()[0]["attempt"] == 1
    for batch, _ in again:
        done = end("r", batch.rank)
        done.batch_id = batch.batch_id[:8] + bytes(8)
        parts = _decode(done, registry).parts
    assert parts["runs"].to_pylist()[0]["status"] == "finished"
    restarted = RunRegistry()  # a collector that restarted knows the worlds from the store
    restarted.merge_loaded("r", registry.run("r"), 0.0)
    assert _decode(register("r", 0, 2, world="10.0.0.3:7000/2"), restarted).parts["ranks"].to_pylist()[0]["attempt"] == 2


def _relayed(kind: str, batches: list[ingest_pb2.Batch]) -> ingest_pb2.Batch:
    """A relay's batch of its ranks' ``batches`` of one kind, as ``node_relay`` sends it: their rows
    merged (each naming its rank), each batch a part with its own id."""
    from rankscope.agent.relay_merge import merge, rows

    payloads = [(b.rank, getattr(b, kind)) for b in batches]
    merged = envelope(batches[0].run_id, batches[0].rank, **{kind: merge(kind, payloads)})
    merged.parts.extend(ingest_pb2.BatchPart(rank=b.rank, batch_id=b.batch_id, count=rows(kind, p)) for b, (_, p) in zip(batches, payloads))
    return merged


def _from(process: ingest_pb2.Batch, batch: ingest_pb2.Batch) -> ingest_pb2.Batch:
    """``batch`` as the agent that sent ``process`` makes it: its ids begin with the agent's instance."""
    batch.batch_id = process.batch_id[:8] + os.urandom(8)
    return batch


def test_a_relays_late_rows_keep_the_attempt_of_the_process_that_recorded_them() -> None:
    """A relay spools its ranks' rows and delivers them after the job was requeued and its ranks
    registered again (Slurm's requeue, the relay's spool replayed): each row keeps its own process's
    attempt, in a batch that mixes both rounds too, and an end the earlier round left behind is
    stored but ends nothing. A sender of several ranks (the simulator's worker) is one process."""
    registry = RunRegistry()
    first = [register("r", rank, 2, host="node-0", world="10.0.0.1:5000/2") for rank in range(2)]
    for batch in first:
        _decode(batch, registry)
    old_spans = [_from(first[rank], spans("r", rank, 3)) for rank in range(2)]
    again = [register("r", rank, 2, host="node-1", world="10.0.0.2:6000/2") for rank in range(2)]
    stored = [_decode(batch, registry).parts for batch in again]
    # the same groups again, stored for the new attempt: a restart may change the layout (groups are per attempt)
    assert {(g["name"], g["attempt"]) for p in stored for g in p["groups"].to_pylist()} == {("world", 1)}
    late = _decode(_relayed("spans", old_spans), registry).parts["spans"].to_pylist()
    assert {(row["rank"], row["attempt"]) for row in late} == {(0, 0), (1, 0)} and len(late) == 6
    mixed = _relayed("heartbeats", [_from(first[0], heartbeats("r", 0)), _from(again[1], heartbeats("r", 1))])
    assert [(row["rank"], row["attempt"]) for row in _decode(mixed, registry).parts["heartbeats"].to_pylist()] == [(0, 0), (1, 1)]
    unknown = _relayed("heartbeats", [heartbeats("r", 0), heartbeats("r", 1)])  # processes a restarted collector never saw register
    restarted = RunRegistry()
    restarted.merge_loaded("r", registry.run("r"), 0.0)
    assert [row["attempt"] for row in _decode(unknown, restarted).parts["heartbeats"].to_pylist()] == [1, 1]
    # where this collector saw the ranks' newest registrations, an unregistered process's part is held
    # back as the rank's own batch would be (the server stores the batch's other parts meanwhile)
    with pytest.raises(UnregisteredRun, match="rank 0 of run 'r'") as refused:
        _decode(_relayed("heartbeats", [heartbeats("r", 0), _from(again[1], heartbeats("r", 1))]), registry)
    assert len(refused.value.parts) == 1

    worker = RunRegistry()
    old = _registers("s", [0, 1], 2, world="10.0.0.1:5000/2")
    _decode(old, worker)
    _decode(_registers("s", [0, 1], 2, world="10.0.0.2:6000/2"), worker)
    ends = envelope("s", 0, ends=telemetry_pb2.EndBatch(ends=[end("s", r).end for r in range(2)], ranks=[0, 1]))
    parts = _decode(_from(old, ends), worker).parts
    assert parts["exits"]["attempt"].to_pylist() == [0, 0] and "runs" not in parts and not worker.has_ended("s", 0)


def test_a_restarted_ranks_rows_that_overtake_its_registration_are_refused_until_it_registered() -> None:
    """torchrun restarts rank 1 on another host, and its new process's first heartbeat arrives before its
    registration (CI of c2895eb). Taken for the earlier attempt's, on the old host, it had a killed host
    heard again at the restart; refused as unregistered (the agent sends it again after the retry delay),
    it is stored as the new attempt's, on the new host, once the registration came. The earlier process's
    own rows keep its attempt, and a sender that names no world is taken at its word as before."""
    registry = RunRegistry()
    first = [register("r", rank, 2, host=f"node-{rank}", world="10.0.0.1:5000/2") for rank in range(2)]
    for batch in first:
        _decode(batch, registry)
    again = register("r", 1, 2, host="node-2", world="10.0.0.2:6000/2")
    beat = _from(again, heartbeats("r", 1))
    with pytest.raises(UnregisteredRun, match=r"rank 1 of run 'r': the process that sent this batch is not registered"):
        _decode(beat, registry)
    assert _decode(_from(first[1], heartbeats("r", 1)), registry).parts["heartbeats"].to_pylist()[0]["attempt"] == 0
    _decode(again, registry)
    assert [(row["attempt"], row["host"]) for row in _decode(beat, registry).parts["heartbeats"].to_pylist()] == [(1, "node-2")]

    worldless = RunRegistry()
    _decode(register("s", 0, 1), worldless)
    assert _decode(heartbeats("s", 0), worldless).parts["heartbeats"].num_rows == 1


def test_run_level_records_store_a_drivers_actions_and_a_hosts_self_check() -> None:
    from rankscope.healing.record import Figure, action_batch, selfcheck_batch

    act = _decode(action_batch("r", "evict", attempt=1, hosts=["node-2"], incident_id="straggler-1", reason="slow",
                               evidence={"steps_lost": 2})).parts["actions"].to_pylist()  # fmt: skip
    assert [(a["action"], a["hosts"], a["attempt"], a["evidence"]) for a in act] == [("evict", ["node-2"], 1, '{"steps_lost": 2}')]
    figures = [Figure("matmul", 12.5, "GFLOP/s", 40.0, False), Figure("memory_bandwidth", 9.0, "GB/s", 9.5)]
    rows = _decode(selfcheck_batch("r", "node-2", False, "matmul 0.31x its peers", figures)).parts["selfchecks"].to_pylist()
    assert [(r["check"], r["passed"], r["host_passed"], r["reference"]) for r in rows] == [("matmul", 0, 0, 40.0), ("memory_bandwidth", 1, 0, 9.5)]
    with pytest.raises(IngestError, match="selfcheck.host is empty"):
        _decode(selfcheck_batch("r", "", True, "", figures))


def test_a_registration_delivered_after_a_newer_one_or_the_ranks_end_changes_nothing() -> None:
    """A rank registers before the script sets its topology and again after; a retry or a spool
    replay can deliver the first one last. Rows are versioned by when the agent registered, and the
    run keeps what the newer registration (or the rank's end) left."""
    registry = RunRegistry()
    t = time.time_ns()
    started = t - 10 * 10**9  # the rank's process
    newer = _decode(register("r", 0, 2, start_ns=started, time_ns=t), registry).parts
    assert newer["ranks"]["registered"][0].value == t and registry.run("r").dp == 2
    assert _decode(register("r", 0, 2, start_ns=started, time_ns=t - 10**9, placed=False), registry).parts == {}
    assert registry.run("r").dp == 2
    # The rank's clock was 5 s ahead when it first registered, before the agent knew its offset; the
    # registration after the correction is still the newer one, and its rows get the higher version.
    skewed = RunRegistry()
    first = _decode(register("s", 0, 2, start_ns=started, time_ns=t - 10**9, placed=False), skewed).parts
    corrected = register("s", 0, 2, start_ns=started, time_ns=t)
    corrected.clock_offset_ns = -5 * 10**9
    second = _decode(corrected, skewed).parts
    assert second["ranks"]["registered"][0].value > first["ranks"]["registered"][0].value and skewed.run("s").dp == 2
    # A rank that does not know its place yet keeps the sizes another rank sent.
    unplaced = _decode(register("r", 1, 2, time_ns=t + 1, placed=False), registry).parts
    assert unplaced["runs"].to_pylist()[0]["dp"] == 2
    _decode(end("r", 0), registry)
    assert "runs" not in _decode(register("r", 0, 2, start_ns=started, time_ns=t), registry).parts  # sent again after the end
    assert registry.has_ended("r", 0)
    _decode(register("r", 0, 2, time_ns=time.time_ns()), registry)  # a new process registered after the end: restarted
    assert not registry.has_ended("r", 0)


def test_ends_delivered_before_their_ranks_registrations_still_finish_the_run() -> None:
    """A spool replayed beside the calls a frozen collector held can deliver ranks' ends before their
    own registrations: the run is finished once every rank of its world has ended. Ends of a run no
    rank has registered are refused (the agent registers again first after a reconnect)."""
    registry = RunRegistry()
    before = time.time_ns() - 10**9
    with pytest.raises(UnregisteredRun, match="run 'r' is not registered"):
        _decode(end("r", 0), registry)
    assert registry.known("r") is None  # a refused batch leaves no run behind
    _decode(register("r", 0, 2, time_ns=before), registry)
    for rank in (0, 1):
        _decode(end("r", rank), registry)
    assert registry.has_ended("r", 1)
    late = _decode(register("r", 1, 2, time_ns=before), registry).parts
    assert late["runs"].to_pylist()[0]["status"] == "finished" and registry.has_ended("r", 1)


def test_a_ranks_only_registration_replayed_after_its_end_is_stored_without_reopening_it() -> None:
    """A busy rank's registration can still be in its spool when its end goes out live; replayed
    later it is the only record of the rank's host and place, so it is stored, but the rank stays ended."""
    registry = RunRegistry()
    registered_at = time.time_ns()
    _decode(register("r", 0, 2), registry)
    _decode(end("r", 1), registry)
    late = _decode(register("r", 1, 2, time_ns=registered_at), registry).parts
    assert late["ranks"].to_pylist()[0]["host"] and "runs" not in late
    assert registry.has_ended("r", 1) and registry.host("r", 1)


def test_a_registration_made_before_the_ranks_end_but_delivered_after_it_is_stored_without_reopening_it() -> None:
    """The agent registers once more with the groups its last steps created, just before its end;
    both calls are in flight together and the end may be answered first."""
    registry = RunRegistry()
    t = time.time_ns()
    started = t - 10 * 10**9
    _decode(register("r", 0, 2, start_ns=started, time_ns=t - 2 * 10**9), registry)
    last = register("r", 0, 2, start_ns=started, time_ns=t - 10**9)
    last.register.groups.append(telemetry_pb2.Group(name="dp[1]", ranks=[0, 1]))
    _decode(end("r", 0), registry)
    parts = _decode(last, registry).parts
    assert sorted(parts["groups"]["name"].to_pylist()) == ["dp[1]", "world"] and "runs" not in parts
    assert registry.has_ended("r", 0)


def test_one_batch_speaks_for_several_ranks_when_its_rows_name_them() -> None:
    """A sender for many ranks (the simulator) names each row's rank: each row gets its rank, its rank's
    host and attempt; the collector hears every rank with a heartbeat in the batch; bad ranks are refused."""
    from rankscope.collector.liveness import LastHeard

    registry = RunRegistry()
    first = [register("r", rank, 4, host=f"node-{rank // 2}", world="10.0.0.1:5000/4") for rank in range(4)]
    for batch in first:
        _decode(batch, registry)
    _decode(register("r", 3, 4, host="node-9", world="10.0.0.2:6000/4"), registry)  # rank 3 restarted: attempt 1
    batch = spans("r", 0, 6)
    batch.spans.rank = np.array([1, 1, 3, 3, 2, 1], "<i4").tobytes()
    decoded = _decode(batch, registry)
    rows = decoded.parts["spans"].to_pydict()
    assert rows["rank"] == [1, 1, 3, 3, 2, 1] and rows["attempt"] == [0, 0, 1, 1, 0, 0]
    assert decoded.ranks == (1, 2, 3)
    assert _decode(_from(first[2], spans("r", 2, 2)), registry).ranks == (2,)  # no rank column: the envelope's rank
    now = time.time_ns()
    beats = [telemetry_pb2.Heartbeat(time_ns=now - k, step=1, phase="forward", status="running") for k in range(3)]
    decoded = _decode(envelope("r", 0, heartbeats=telemetry_pb2.HeartbeatBatch(heartbeats=beats, ranks=[2, 0, 3])), registry)
    table = decoded.parts["heartbeats"].to_pydict()
    assert table["rank"] == [2, 0, 3] and table["host"] == ["node-1", "node-0", "node-9"] and table["attempt"] == [0, 0, 1]
    heard = LastHeard(stale_ns=10**9, started_ns=0)  # a collector listening since before these heartbeats
    heard.note(decoded, now + 5)
    assert heard.of("r", 0) == {2: now + 5, 0: now + 5} and heard.of("r", 1) == {3: now + 5}
    outside = spans("r", 0, 2)
    outside.spans.rank = np.array([1, 4], "<i4").tobytes()
    with pytest.raises(IngestError, match=r"spans.rank: rank 4 outside 0 .. 3 \(the run's world\)"):
        _decode(outside, registry)
    short = envelope("r", 0, heartbeats=telemetry_pb2.HeartbeatBatch(heartbeats=beats, ranks=[1]))
    with pytest.raises(IngestError, match="heartbeats.ranks: 1 ranks for 3 heartbeats"):
        _decode(short, registry)
    negative = spans("r", 0, 1)
    negative.spans.rank = np.array([-1], "<i4").tobytes()
    with pytest.raises(IngestError, match=r"rank -1 outside 0 .. 15"):
        _decode(negative)


def _registers(run_id: str, ranks: list[int], world_size: int, **kw: object) -> ingest_pb2.Batch:
    """One sender's registrations of ``ranks`` (each built as ``register`` builds a rank's own)."""
    regs = [register(run_id, r, world_size, host=f"node-{r // 2}", **kw).register for r in ranks]  # type: ignore[arg-type]
    return envelope(run_id, ranks[0], registers=telemetry_pb2.RegisterBatch(registers=regs, ranks=ranks))


def test_one_call_registers_several_ranks_as_their_own_calls_would() -> None:
    """A sender for many ranks registers them in one batch: a ranks row each (its host, coordinates and
    version), the shared group stored once, the run running; the batch speaks for all of them, and they are
    heard from then on (by when they registered, for a registration that arrives late)."""
    from rankscope.collector.liveness import LastHeard

    registry = RunRegistry()
    decoded = _decode(_registers("r", [0, 1, 2, 3], 4, world="10.0.0.1:5000/4"), registry)
    assert decoded.kind == "registers" and decoded.ranks == (0, 1, 2, 3)
    heard, now = LastHeard(stale_ns=10**9, started_ns=0), time.time_ns()
    heard.note(decoded, now)  # registered ranks are heard before their first heartbeat
    assert heard.of("r", 0) == dict.fromkeys([0, 1, 2, 3], now)
    heard.note(decoded, now, answered_ns=now + 9 * 10**9)  # the writer kept the sender waiting 9 s for its answer
    assert heard.of("r", 0) == dict.fromkeys([0, 1, 2, 3], now + 9 * 10**9)
    late = LastHeard(stale_ns=10**9, started_ns=0)
    late.note(decoded, now + 60 * 10**9)  # a registration replayed a minute late: heard when it was sent
    assert max(late.of("r", 0).values()) < now
    ranks = decoded.parts["ranks"].to_pydict()
    assert ranks["rank"] == [0, 1, 2, 3] and ranks["host"] == ["node-0", "node-0", "node-1", "node-1"]
    assert ranks["dp_rank"] == [0, 1, 2, 3] and ranks["pid"] == [1000, 1001, 1002, 1003] and ranks["attempt"] == [0] * 4
    assert decoded.parts["groups"].to_pydict()["name"] == ["world"]
    assert decoded.parts["runs"].to_pylist()[0]["status"] == "running"
    run = registry.run("r")
    assert run.world_size == 4 and run.hosts == {0: "node-0", 1: "node-0", 2: "node-1", 3: "node-1"}
    # a rank's own later registration is newer than the batch's, and rows of other ranks find their hosts
    assert _decode(register("r", 2, 4, host="node-5", world="10.0.0.1:5000/4"), registry).parts["ranks"]["host"].to_pylist() == ["node-5"]
    beats = telemetry_pb2.HeartbeatBatch(heartbeats=[telemetry_pb2.Heartbeat(time_ns=time.time_ns(), step=1)] * 2, ranks=[3, 2])
    assert _decode(envelope("r", 0, heartbeats=beats), registry).parts["heartbeats"]["host"].to_pylist() == ["node-1", "node-5"]


@pytest.mark.parametrize(
    "mend, message",
    [
        (lambda b: b.registers.ranks.append(3), "registers: 4 ranks for 3 registrations"),
        (lambda b: b.registers.registers[2].groups[0].ranks.append(7), "registers.registers[2].groups['world']: ranks [7] outside 0 .. 3"),
        (lambda b: setattr(b.registers.registers[1], "world", "10.0.0.2:6000/4"), "registrations of 2 worlds"),
        (lambda b: b.registers.ranks.__setitem__(2, 4), "rank 4 is not below registers.registers[2].world_size 4"),
        (lambda b: b.registers.ranks.__setitem__(1, -2), "the rank of registers.registers[1] is -2"),
        (lambda b: setattr(b.registers.registers[2], "time_ns", 1), "registers.registers[2].time_ns: times"),
        (lambda b: (b.registers.ClearField("registers"), b.registers.ClearField("ranks")), "registers.registers is empty"),
    ],
    ids=["ranks short", "group outside", "two worlds", "rank outside", "negative rank", "time outside", "empty"],
)
def test_a_bad_registration_refuses_its_whole_batch_and_registers_nobody(mend, message: str) -> None:
    registry = RunRegistry()
    batch = _registers("r", [0, 1, 2], 4)
    mend(batch)
    with pytest.raises(IngestError, match=re.escape(message)):
        _decode(batch, registry)
    assert not registry.run("r").registered and not registry.run("r").hosts


def test_one_call_ends_several_ranks_each_in_its_own_attempt_and_the_last_closes_the_run() -> None:
    registry = RunRegistry()
    _decode(_registers("r", [0, 1, 2, 3], 4, world="10.0.0.1:5000/4"), registry)
    _decode(register("r", 3, 4, host="node-9", world="10.0.0.2:6000/4"), registry)  # rank 3 restarted: attempt 1
    now = time.time_ns()
    ends = [telemetry_pb2.EndOfRank(time_ns=now, reason=telemetry_pb2.EndOfRank.REASON_SIGNAL, signal=15, message="SIGTERM")] * 3
    decoded = _decode(envelope("r", 0, ends=telemetry_pb2.EndBatch(ends=ends, ranks=[0, 3, 1])), registry)
    assert decoded.kind == "ends" and decoded.ranks == (0, 1, 3)
    exits = decoded.parts["exits"].to_pydict()
    assert exits["rank"] == [0, 3, 1] and exits["attempt"] == [0, 1, 0] and exits["reason"] == ["signal"] * 3
    assert exits["host"] == ["node-0", "node-9", "node-0"] and exits["signal"] == [15] * 3
    assert "runs" not in decoded.parts and registry.has_ended("r", 3) and not registry.has_ended("r", 2)
    last = _decode(envelope("r", 2, ends=telemetry_pb2.EndBatch(ends=ends[:1], ranks=[2])), registry).parts
    assert last["runs"].to_pylist()[0]["status"] == "failed"  # ended by a signal
    bad = telemetry_pb2.EndBatch(ends=[*ends[:1], telemetry_pb2.EndOfRank(time_ns=now, reason=9)], ranks=[0, 1])  # type: ignore[arg-type]
    with pytest.raises(IngestError, match=r"ends.ends\[1\].reason: unknown value 9"):
        _decode(envelope("r", 0, ends=bad), registry)
    with pytest.raises(IngestError, match=r"ends.ranks: rank 4 outside 0 .. 3"):
        _decode(envelope("r", 0, ends=telemetry_pb2.EndBatch(ends=ends[:1], ranks=[4])), registry)


def test_a_group_is_stored_once_not_once_per_member_and_again_when_its_members_change() -> None:
    registry = RunRegistry()
    first = _decode(register("r", 0, 3), registry)
    assert first.parts["groups"]["name"].to_pylist() == ["world"]
    assert _decode(register("r", 1, 3), registry).parts["groups"].num_rows == 1  # the first is not stored yet
    registry.stored("r", first.parts)
    assert _decode(register("r", 2, 3), registry).parts["groups"].num_rows == 0
    grown = _decode(register("r", 0, 4, world="10.0.0.2:6000/4"), registry)  # a new world of four ranks
    assert grown.parts["groups"]["ranks"].to_pylist() == [[0, 1, 2, 3]]


def test_a_run_is_read_from_the_store_once_and_again_for_an_unknown_rank_unless_it_registers() -> None:
    from rankscope.collector.run_registry import RunInfo

    registry = RunRegistry()
    assert registry.needs_load("r", 0, 0.0, registering=True)  # never read: a restarted collector reads it first
    registry.merge_loaded("r", RunInfo(hosts={0: "node-0"}), 0.0)
    assert not registry.needs_load("r", 0, 100.0) and not registry.needs_load("r", 5, 5.0)
    assert registry.needs_load("r", 5, 100.0) and not registry.needs_load("r", 5, 100.0, registering=True)


def _corrupt(batch: ingest_pb2.Batch, field: str, value: object) -> ingest_pb2.Batch:
    setattr(getattr(batch, batch.WhichOneof("payload")), field, value)
    return batch


@pytest.mark.parametrize(
    "batch, message",
    [
        (_corrupt(spans("r", 0, 4), "end_ns", b"\0" * 31), "spans.end_ns: 31 bytes, but count=4 values of 8 bytes need 32"),
        (_corrupt(spans("r", 0, 4), "name", np.array([0, 1, 3, 0], "<i4").tobytes()), "spans.name: string index 3 outside"),
        (_corrupt(spans("r", 0, 4), "attributes", np.array([0, -2, 0, 0], "<i4").tobytes()), "string index -2"),
        (_corrupt(spans("r", 0, 4), "kind", np.array([0, 9, 0, 0], "u1").tobytes()), "spans.kind: unknown value 9"),
        (_corrupt(spans("r", 0, 4), "step", np.array([1, -1, 1, 1], "<i4").tobytes()), "spans.step: value -1 where only values >= 0"),
        (_corrupt(collectives("r", 0), "state", np.array([0, 3, 0], "u1").tobytes()), "collectives.state: unknown value 3"),
        (envelope("r", 0), "carries no payload"),
        (ingest_pb2.Batch(schema_version=1, run_id="r", rank=0, batch_id=b"short", stack=telemetry_pb2.StackDump()), "batch_id has 5 bytes"),
        (spans("r", 0, 4, t0=time.time_ns() - 2 * 86_400 * 10**9), "outside the accepted window"),
        (spans("r", 0, 4, t0=time.time_ns() + 2 * 3600 * 10**9), "outside the accepted window"),
        (register("r", 5, 4), "rank 5 is not below register.world_size 4"),
        (end("r", 0, reason=9), "end.reason: unknown value 9"),
    ],
)
def test_malformed_batches_are_refused_with_the_reason(batch: ingest_pb2.Batch, message: str) -> None:
    with pytest.raises(IngestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _decode(batch)


def test_the_clock_offset_brings_a_skewed_rank_into_the_window() -> None:
    skew = 3 * 3600 * 10**9  # the rank's clock is 3 h ahead
    batch = spans("r", 0, 2, t0=time.time_ns() + skew, offset_ns=-skew)
    assert _decode(batch).parts["spans"].num_rows == 2
    narrow = TimeWindow(past_s=1.0, future_s=1.0)
    with pytest.raises(IngestError, match="--time-window"):
        _decode(spans("r", 0, 2, t0=time.time_ns() - 5 * 10**9), window=narrow)


def test_a_payload_of_a_newer_contract_is_refused_not_dropped() -> None:
    newer = ingest_pb2.Batch.FromString(envelope("r", 0).SerializeToString() + b"\xc2\x02\x00")  # field 40, empty
    with pytest.raises(IngestError, match="a payload type this collector does not know"):
        _decode(newer)


def test_an_unknown_schema_version_is_a_precondition_not_a_malformed_batch() -> None:
    batch = spans("r", 0, 1)
    batch.schema_version = 2
    with pytest.raises(UnsupportedSchemaVersion, match="schema_version 2"):
        _decode(batch)


@pytest.mark.parametrize("members", [[0, 1, 2], [-1, 0]], ids=["above the world", "negative"])
def test_a_group_with_a_member_outside_the_world_is_refused_and_nothing_registered(members: list[int]) -> None:
    registry = RunRegistry()
    bad = register("r", 0, 2)
    bad.register.groups.append(telemetry_pb2.Group(name="dp[0]", ranks=members))
    outside = [r for r in members if not 0 <= r < 2]
    with pytest.raises(IngestError, match=re.escape(f"register.groups['dp[0]']: ranks {outside} outside 0 .. 1")):
        _decode(bad, registry)
    assert not registry.run("r").registered


# --- hostile batches: refused by field, before anything is allocated, leaving nothing behind -----


def _registered(world_size: int = 4) -> RunRegistry:
    registry = RunRegistry()
    _decode(register("r", 0, world_size), registry)
    return registry


def _claiming(batch: ingest_pb2.Batch, count: int) -> ingest_pb2.Batch:
    getattr(batch, batch.WhichOneof("payload")).count = count
    return batch


def _beat(**fields: object) -> ingest_pb2.Batch:
    now = time.time_ns()
    beat = telemetry_pb2.Heartbeat(**{"time_ns": now, "step": 1, "phase": "forward", "status": "running", **fields})  # type: ignore[arg-type]
    return envelope("r", 0, heartbeats=telemetry_pb2.HeartbeatBatch(heartbeats=[beat]))


def _registration(**fields: object) -> ingest_pb2.Batch:
    batch = register("r", 1, 4)
    for name, value in fields.items():
        setattr(batch.register, name, value)
    return batch


@pytest.mark.parametrize(
    "batch, reason, message",
    [
        (_claiming(spans("r", 0, 2), 1 << 26), "count", "spans: count=67108864 rows need at least"),
        (_claiming(metrics("r", 0), 1 << 26), "count", "metrics: count=67108864 rows need at least"),
        (_registration(world_size=2**31 - 1), "range", "register.world_size is 2147483647"),
        (_registration(dp=70000), "range", "register.dp is 70000"),
        (_registration(host="h" * 300), "length", "register.host: 300 characters"),
        (envelope("x" * (8 << 20), 0, stack=telemetry_pb2.StackDump(time_ns=time.time_ns())), "length", "run_id: 8388608 characters"),
        (_beat(in_flight=[telemetry_pb2.InFlight(group="world", seq=1, op="all_reduce", peer=-1, issue_ns=2**63 - 1)]), "time",
         "heartbeats.in_flight.issue_ns: times"),
        (_beat(last_progress_ns=2**63 - 1), "time", "heartbeats.last_progress_ns: times"),
        (_beat(last_progress_ns=-(32 * 365 * 86_400 * 10**9)), "time", "heartbeats.last_progress_ns: times"),
        (_corrupt(spans("r", 0, 2), "end_ns", (time.time_ns() - np.array([10, 10]) * 10**6).astype("<i8").tobytes()), "order",
         "spans.end_ns: row 0 ends"),
        (spans("r", 9, 2), "rank", "rank: rank 9 outside 0 .. 3"),
        (_corrupt(collectives("r", 0), "peer", np.array([-1, 7, 1], "<i4").tobytes()), "rank", "collectives.peer: rank 7 outside 0 .. 3"),
        (_corrupt(spans("r", 0, 2), "microbatch", np.array([-2, 0], "<i4").tobytes()), "range", "spans.microbatch: value -2"),
        (envelope("r", 0, attempt=70000, stack=telemetry_pb2.StackDump(time_ns=time.time_ns())), "range", "attempt is 70000"),
    ],
    ids=["spans claim 2^26 rows", "metrics claim 2^26 rows", "world 2^31-1", "dp 70000", "long host", "8 MB run id",
         "in flight at 2^63-1", "progress overflows", "progress in 1938", "span ends before it starts", "rank outside the world",
         "peer outside the world", "microbatch below -1", "attempt over UInt16"],
)
def test_a_hostile_batch_is_refused_naming_its_field_and_changes_no_run(batch: ingest_pb2.Batch, reason: str, message: str) -> None:
    registry = _registered()
    before = (dict(registry.run("r").registered), dict(registry.run("r").worlds), registry.run("r").dp, registry.run("r").world_size)
    with pytest.raises(IngestError, match=re.escape(message)) as refused:
        _decode(batch, registry)
    assert refused.value.reason == reason
    assert (dict(registry.run("r").registered), dict(registry.run("r").worlds), registry.run("r").dp, registry.run("r").world_size) == before
    assert registry.known(batch.run_id) is None or batch.run_id == "r"  # no run kept for a refused id
    assert _decode(end("r", 0), registry).parts["exits"].num_rows == 1  # the run's next valid batch is unharmed


def test_rows_of_a_run_never_registered_are_refused_but_healings_run_level_records_are_not() -> None:
    from rankscope.healing.record import action_batch

    registry = RunRegistry()
    for batch in (spans("new", 0, 2), heartbeats("new", 0), end("new", 0), stack("new", 0)):
        with pytest.raises(UnregisteredRun):
            _decode(batch, registry)
    assert registry.known("new") is None
    assert _decode(action_batch("new", "evict", attempt=0, hosts=["node-2"]), registry).parts["actions"].num_rows == 1
    bad = register("new", 0, 2, world="10.0.0.1:5000/2")
    bad.register.dp = 70000
    with pytest.raises(IngestError, match="register.dp is 70000"):
        _decode(bad, registry)
    assert registry.known("new") is None  # the refused registration numbered no world


def test_a_string_named_by_every_row_counts_against_the_batchs_size() -> None:
    """A few bytes of indices can name one long string a million times: the rows' copies are bounded
    by the payload's size (``STRING_EXPANSION``), whatever the count."""
    batch = spans("r", 0, 20_000)  # every other row has attributes
    batch.spans.strings[2] = "x" * 100_000
    with pytest.raises(IngestError, match="spans.attributes: its rows name 1000000000 bytes of strings") as refused:
        _decode(batch, _registered())
    assert refused.value.reason == "length"
    assert _decode(spans("r", 0, 20_000), _registered()).parts["spans"].num_rows == 20_000


def test_rows_dated_after_their_runs_end_are_refused_and_late_true_ones_are_stored() -> None:
    """Once every rank of a run has ended, rows that say they happened after its end (beyond the clock
    skew allowed) were not recorded by it: refused naming the field, the run unchanged. Rows of the
    run delivered late (a rank's last flush, a spool replayed after the run) keep their times and are
    stored, as is a new attempt's once it registers."""
    registry, t0 = RunRegistry(), time.time_ns()
    for rank in range(2):
        _decode(register("r", rank, 2, start_ns=t0 - 10**9), registry)
    late = [spans("r", 1, 4, t0=t0), heartbeats("r", 0), step_metrics("r", 1)]  # recorded while it ran
    for rank in range(2):
        _decode(end("r", rank), registry)
    ended = registry.run("r").end_ns
    assert ended >= t0
    for batch in late:
        assert sum(t.num_rows for t in _decode(batch, registry).parts.values()) > 0
    after = ended + 120 * 10**9  # inside the collector's future window, two minutes past the end
    before = (dict(registry.run("r").exits), registry.run("r").end_ns)
    for batch, field in ((spans("r", 0, 2, t0=after), "spans.start_ns"), (heartbeats("r", 1), "heartbeats.time_ns"),
                         (end("r", 0), "end.time_ns")):  # fmt: skip
        if field == "heartbeats.time_ns":
            batch.heartbeats.heartbeats[0].time_ns = after
        elif field == "end.time_ns":
            batch.end.time_ns = after
        with pytest.raises(IngestError, match=re.escape(f"{field}: times up to") + ".* after the end of run 'r'") as refused:
            _decode(batch, registry)
        assert refused.value.reason == "ended"
    assert (dict(registry.run("r").exits), registry.run("r").end_ns) == before
    assert _decode(spans("r", 0, 2, t0=ended + 10**9), registry).parts["spans"].num_rows == 2  # within the skew
    second = register("r", 0, 2, start_ns=after, world="second")
    _decode(second, registry)  # a new attempt: the run runs again
    assert registry.run("r").end_ns == 0 and _decode(_from(second, spans("r", 0, 2, t0=after)), registry).parts["spans"].num_rows == 2


@pytest.mark.timeout(30)
def test_heartbeats_in_columns_are_stored_as_the_same_heartbeats_in_rows_and_bad_columns_are_refused() -> None:
    """A relay's (and the simulator's) heartbeats travel in columns (agent.heartbeat_columns): they
    become exactly the rows the same heartbeats as messages become; a column that disagrees with
    another (operations in flight, flags, peers) refuses the batch, naming it."""
    from rankscope.agent.heartbeat_columns import to_columns

    registry = RunRegistry()
    for rank in range(4):
        _decode(register("r", rank, 4, host=f"node-{rank // 2}", world="10.0.0.1:5000/4"), registry)
    now = time.time_ns()
    flight = [telemetry_pb2.InFlight(group="tp[0]", seq=7, op="all_reduce", peer=-1, issue_ns=now - 9, waiting=True),
              telemetry_pb2.InFlight(group="pp[1]", seq=3, op="send", peer=2, issue_ns=now - 5)]  # fmt: skip
    beats = [telemetry_pb2.Heartbeat(time_ns=now - k, step=k + 1, phase=("forward", "idle", "backward")[k], status="running",
                                     last_progress_ns=(now - 100, 0, now - 7)[k], in_flight=flight[: 2 - k], events_dropped=k)
             for k in range(3)]  # fmt: skip
    ranks = [2, 0, 3]
    rows = _decode(envelope("r", 1, heartbeats=telemetry_pb2.HeartbeatBatch(heartbeats=beats, ranks=ranks)), registry)
    cols = _decode(envelope("r", 1, heartbeats=to_columns(beats, ranks)), registry)
    assert cols.parts["heartbeats"].to_pydict() == rows.parts["heartbeats"].to_pydict()
    assert cols.ranks == rows.ranks == (0, 2, 3)
    assert cols.parts["heartbeats"]["inflight_peer"].to_pylist() == [[-1, 2], [-1], []]

    def bad(mend: object, message: str) -> None:
        batch = envelope("r", 1, heartbeats=to_columns(beats, ranks))
        mend(batch.heartbeats.columns)  # type: ignore[operator]
        with pytest.raises(IngestError, match=re.escape(message)):
            _decode(batch, registry)

    bad(lambda c: setattr(c, "in_flight", np.array([2, 1, 1], "<i4").tobytes()), "name 4 operations in flight, ops holds 3")
    bad(lambda c: setattr(c.ops, "waiting", np.array([2, 0, 0], "u1").tobytes()), "heartbeats.ops.waiting: value 2")
    bad(lambda c: setattr(c.ops, "peer", np.array([-1, 9, -1], "<i4").tobytes()), "heartbeats.ops.peer: rank 9 outside 0 .. 3")
    bad(lambda c: setattr(c, "phase", np.array([0, 5, 0], "<i4").tobytes()), "heartbeats.phase: string index 5")
    bad(lambda c: c.MergeFrom(telemetry_pb2.HeartbeatColumns(count=1 << 26)), "heartbeats: count=67108864 rows need at least")
    both = envelope("r", 1, heartbeats=to_columns(beats, ranks))
    both.heartbeats.heartbeats.append(beats[0])
    with pytest.raises(IngestError, match="both rows and columns"):
        _decode(both, registry)
