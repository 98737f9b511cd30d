"""The scale simulator against a real collector: a scaled-down job (4 x 4 x 16 = 256 ranks), one fault each.

The live diagnosis must name exactly the injected rank and its host, and nothing else. The pure
parts (1F1B order, the hang's fixed point, the multi-rank Transport) are checked without processes.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from rankscope.harness.simulate.freeze import PHASES, freeze
from rankscope.harness.simulate.step_model import StepModel, Timing, one_f_one_b, topological
from rankscope.harness.simulate.rows import ALL_REDUCE, RECV, SEND, Slice
from rankscope.harness.simulate.topology import build

from conftest import incidents, start_collector

SHAPE = ["--tp", "4", "--pp", "4", "--dp", "16"]
STATUS_SQL = "SELECT argMax(status, updated) AS status FROM runs WHERE run_id = {run:String}"


def test_one_f_one_b_warms_up_then_alternates() -> None:
    stages = one_f_one_b(4, 6)
    assert [(op.backward, op.m) for op in stages[1]] == [
        (False, 0), (False, 1), (False, 2), (True, 0), (False, 3), (True, 1), (False, 4), (True, 2),
        (False, 5), (True, 3), (True, 4), (True, 5),
    ]  # fmt: skip
    order = topological(stages)
    assert len(order) == 4 * 12 and order.index(stages[3][0]) > order.index(stages[2][0])  # a forward follows its input


def test_straggler_slows_its_own_compute_and_its_peers_wait() -> None:
    topo = build(2, 2, 2)
    model = StepModel(topo, Timing.for_step(1.0, 2, 4, noise=0.0), 4, seed=0, factors=[(1, 2, 1.5)])
    before, after = model.step(1, 0), model.step(2, 0)
    assert after.fwd[0, 0, 1].sum() == pytest.approx(1.5 * before.fwd[0, 0, 1].sum(), rel=1e-6)
    assert (after.fwd[0, 0, 0] == before.fwd[0, 0, 0]).all()  # its tp peer computes as fast as before ...
    assert after.f_end[0, 0, 0] > before.f_end[0, 0, 0]  # ... and waits for it in the all-reduce
    assert after.duration_ns > before.duration_ns  # the other replica waits in the dp all-reduce


def test_hang_leaves_every_other_rank_waiting_on_the_chain_to_the_root() -> None:
    topo = build(2, 4, 2)
    model = StepModel(topo, Timing.for_step(1.0, 4, 4), 4, seed=0, factors=[])
    frozen = freeze(model, model.step(3, 0), root=5)  # tp 1, stage 1, replica 0
    assert frozen.flights[5] == [] and PHASES[frozen.phase[5]] == "recv_forward"
    # its pipeline neighbour sent it activations (in flight: nobody received them) and waits for a gradient
    assert [(f.op, f.peer) for f in frozen.flights[1] if f.waiting] == [(RECV, 5)]
    assert all(f.op == SEND and f.peer == 5 for f in frozen.flights[1] if not f.waiting)
    assert [(f.op, f.peer) for f in frozen.flights[4]] == [(ALL_REDUCE, -1)]  # its tp peer, in the all-reduce
    other_replica = 2  # tp 0, stage 0, replica 1: waits in the dp all-reduce of the step
    assert [(f.op, f.seq) for f in frozen.in_flight(other_replica, 0)] == [(ALL_REDUCE, 3)]
    sends = Slice(model, 0, topo.world_size).full(model.step(3, 0))[1].columns
    boundaries, microbatches, directions, pipelines = 3, 4, 2, 2 * 2
    assert (sends["op"] == SEND).sum() == boundaries * microbatches * directions * pipelines


def test_a_batch_of_several_ranks_keeps_each_rows_rank_group_and_op() -> None:
    """The worker's batches speak for many ranks: decoded by the collector, every row names its own
    rank, its own groups (the string table holds every rank's) and op, as a one-rank batch would."""
    import os

    import numpy as np

    from rankscope.collector.decode import decode
    from rankscope.collector.run_registry import RunRegistry
    from rankscope.harness.simulate import payloads
    from rankscope.harness.simulate.rows import OP_NAMES
    from rankscope.harness.simulate.worker import _rows_of
    from rankscope.protos.v1 import ingest_pb2

    topo = build(2, 4, 2)
    model = StepModel(topo, Timing.for_step(1.0, 4, 4), 4, seed=0, factors=[])
    start = time.time_ns()
    step = model.step(1, start)
    spans, collectives = Slice(model, 0, topo.world_size).full(step)
    registry = RunRegistry()

    def decoded(rank: int, **payload: object) -> dict:
        batch = ingest_pb2.Batch(schema_version=1, run_id="r", rank=rank, batch_id=os.urandom(16), **payload)
        return decode(batch, registry, start).parts

    for rank in range(topo.world_size):
        decoded(rank, register=payloads.register(topo, rank, run_name="r", config_json="", start_ns=start, pid=1))
    ranks, cols = _rows_of([collectives.take(3, 11)], 3)
    rows = decoded(3, collectives=payloads.collectives(topo, ranks, cols))["collectives"].to_pydict()
    assert sorted(set(rows["rank"])) == list(range(3, 11))
    expected = [topo.group_names(r)[g] for r, g in zip(ranks, cols["group"])]
    assert rows["group_name"] == expected and rows["op"] == [OP_NAMES[o - 3] for o in cols["op"]]
    assert set(rows["dtype"]) == {"bfloat16"}
    ranks, cols = _rows_of([spans.take(0, 16)], 0)
    rows = decoded(0, spans=payloads.spans(ranks, cols))["spans"].to_pydict()
    assert rows["rank"] == ranks.tolist() and np.array_equal(np.bincount(rows["rank"]), np.diff(spans.offsets))


@pytest.fixture
def collector(proc_runner, tmp_path: Path) -> str:
    return start_collector(proc_runner, tmp_path / "store", "--hang-after", "8", "--silent-after", "30", "--diagnose-every", "1",
                           "--flush-interval", "0.5").target  # fmt: skip


def simulate(proc_runner, address: str, run_id: str, *flags: str):
    return proc_runner.start(
        [sys.executable, "-m", "rankscope.cli.main", "simulate", *SHAPE, "--collector", address, "--run-id", run_id,
         "--step-time", "0.5", "--batches-per-s", "400", *flags],
        name=f"simulate-{run_id}",
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.foreground
def test_straggler_among_256_ranks_is_named_with_its_host(proc_runner, collector: str) -> None:
    sim = simulate(proc_runner, collector, "straggler", "--steps", "12", "--inject", "straggler:rank=77,factor=1.3,from_step=3")
    assert sim.wait(90) == 0, sim.output()

    def settled(found: list[dict], client) -> bool:  # the run is over and the last passes saw it
        return client.query(STATUS_SQL, {"run": "straggler"}).to_pylist()[0]["status"] == "finished" and bool(found)

    found = incidents(collector, "straggler", settled, timeout_s=30)
    assert [(i["kind"], i["ranks"], i["hosts"]) for i in found] == [("straggler", [77], ["node-9"])], found


@pytest.mark.slow
def test_hang_among_256_ranks_names_the_root(proc_runner, collector: str) -> None:
    """Heartbeats 16 s apart (the threshold is 8 s) and no early report: at the hang threshold many ranks were last heard
    before the stall. They must not be named (nor anything else) until heard; then the root alone."""
    from rankscope.collector.client import Client

    simulate(proc_runner, collector, "hang", "--steps", "40", "--inject", "hang:rank=150,step=6", "--hold", "120",
             "--heartbeat", "16", "--report-after", "60")  # fmt: skip

    def whole(found: list[dict], _) -> bool:  # every rank heard since the stall waits on the root
        return any(i["kind"] == "hang" and "255 ranks wait on it" in i["summary"] for i in found)

    found = incidents(collector, "hang", whole, timeout_s=75)
    assert [(i["kind"], i["ranks"], i["hosts"]) for i in found] == [("hang", [150], ["node-18"])], found
    assert "255 ranks wait on it" in found[0]["summary"]
    with Client(collector) as client:  # every version written while the ranks reported, not only the last
        versions = client.query("SELECT DISTINCT kind, ranks FROM incidents WHERE run_id = 'hang'").to_pylist()
    assert versions == [{"kind": "hang", "ranks": [150]}], versions


@pytest.mark.slow
@pytest.mark.parametrize("together", [False, True], ids=["a call each", "one batch"])
def test_one_transport_for_many_ranks_registers_each_again_with_a_new_collector(proc_runner, tmp_path: Path, together: bool) -> None:
    """A Transport speaking for ranks 0-2: envelopes carry each payload's rank, and after the collector
    is replaced (an empty store on the same address) every rank is registered again before its data,
    whether they registered a call each or in one batch."""
    from test_agent_transport import agent_config, free_port, start_collector

    from rankscope.agent.transport import Transport
    from rankscope.protos.v1 import telemetry_pb2 as pb

    def beat() -> pb.HeartbeatBatch:
        return pb.HeartbeatBatch(heartbeats=[pb.Heartbeat(time_ns=time.time_ns(), step=1, phase="forward", status="running")])

    def hosts(collector) -> dict[int, str]:  # rank -> host its heartbeats were stored with
        rows = collector.query("SELECT rank, any(host) AS host FROM heartbeats WHERE run_id = 'multi' GROUP BY rank")
        return {r["rank"]: r["host"] for r in rows}

    port = free_port()
    first = start_collector(proc_runner, tmp_path / "first", port)
    transport = Transport(agent_config(first.address, tmp_path / "spool"), "multi", 0, window=8)
    transport.start()
    regs = [pb.Register(world_size=3, host=f"host-{rank}", tp=1, pp=1, dp=3, start_time_ns=time.time_ns()) for rank in range(3)]
    if together:
        transport.submit(pb.RegisterBatch(registers=regs, ranks=range(3)), rank=0)
    else:
        for rank, reg in enumerate(regs):
            transport.submit(reg, rank=rank)
    deadline = time.monotonic() + 30
    while transport.stats().acked < (1 if together else 3) and time.monotonic() < deadline:  # in flight together, data could overtake them
        time.sleep(0.1)
    for rank in range(3):
        transport.submit(beat(), rank=rank)
    while len(hosts(first)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hosts(first) == {0: "host-0", 1: "host-1", 2: "host-2"}
    first.proc.kill()
    for rank in range(3):  # they fail: the Transport spools them and probes until a collector answers
        transport.submit(beat(), rank=rank)
    deadline = time.monotonic() + 30
    while transport.stats().spooled < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    second = start_collector(proc_runner, tmp_path / "second", port)
    deadline = time.monotonic() + 60
    while transport.stats().replayed < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    transport.close(timeout_s=30)
    assert hosts(second) == {0: "host-0", 1: "host-1", 2: "host-2"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_collector_that_stores_late_names_nobody_lost_while_it_hears_every_rank(proc_runner, tmp_path: Path) -> None:
    """The collector is slowed on purpose: it writes each table once its rows are 10 s old, twice
    the 5 s after which a silent rank is lost. The ranks are judged by when the collector last
    heard them, not by their newest stored heartbeat."""
    from rankscope.collector.client import Client

    slow = start_collector(proc_runner, tmp_path / "store", "--flush-interval", "10", "--silent-after", "5", "--hang-after", "60",
                           "--diagnose-every", "1").target  # fmt: skip
    sim = proc_runner.start(
        [sys.executable, "-m", "rankscope.cli.main", "simulate", "--tp", "1", "--pp", "1", "--dp", "4", "--collector", slow,
         "--run-id", "lagging", "--steps", "16", "--step-time", "1", "--heartbeat", "1", "--flush", "4"],
        name="simulate-lagging",
    )  # fmt: skip
    lag_s = 0.0
    with Client(slow) as client:
        while sim.popen.poll() is None:
            newest = client.query("SELECT toUnixTimestamp64Nano(max(time)) AS ns FROM heartbeats WHERE run_id = 'lagging'").to_pylist()
            if newest[0]["ns"]:
                lag_s = max(lag_s, time.time() - newest[0]["ns"] / 1e9)
            time.sleep(1)
    assert sim.wait(60) == 0, sim.output()
    assert lag_s > 5, f"the stored heartbeats were never more than {lag_s:.1f} s behind: the collector was not slowed"
    found = incidents(slow, "lagging", lambda found, client: False, timeout_s=12)
    assert found == [], [(f["summary"], f["first_seen_ns"] / 1e9, f.get("evidence")) for f in found]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_through_relays_every_row_sent_is_stored_once(proc_runner, tmp_path: Path) -> None:
    """``--via relay``: each worker's hosts send their own batches (8 ranks each) to a relay process, which
    merges them; what the simulator says it sent is what the store holds, row for row."""
    from rankscope.collector.client import Client

    collector = start_collector(proc_runner, tmp_path / "store", "--no-diagnosis", "--flush-interval", "0.5").target

    sim = simulate(proc_runner, collector, "relayed", "--steps", "6", "--via", "relay")
    assert sim.wait(150) == 0, sim.output()
    sent = json.loads(re.search(r"events (\{.*\})", sim.stdout.replace("'", '"')).group(1))  # type: ignore[union-attr]
    assert ", 0 refused, 0 dropped" in sim.stdout, sim.output()
    acked = int(re.search(r"([\d,]+) batches acknowledged, ", sim.stdout).group(1).replace(",", ""))  # type: ignore[union-attr]
    with Client(collector) as client:
        stored = {kind: client.query(f"SELECT count() AS n FROM {table} WHERE run_id = 'relayed'", {})["n"][0].as_py()
                  for kind, table in (("heartbeats", "heartbeats"), ("spans", "spans"), ("collectives", "collectives"), ("end", "exits"))}  # fmt: skip
        # the relays' batches: the ranks' batches they hold are recorded beside them, with rows 0
        batches = client.query("SELECT countIf(rows > 0) AS n FROM batches WHERE run_id = 'relayed'", {})["n"][0].as_py()
        by_kind = {r["kind"]: (r["relays"], r["ranks"]) for r in client.query(
            "SELECT kind, countIf(rows > 0) AS relays, countIf(rows = 0) AS ranks FROM batches WHERE run_id = 'relayed' GROUP BY kind", {}).to_pylist()}  # fmt: skip
    assert stored == {kind: sent[kind] for kind in stored}, (stored, sent, sim.output())
    assert batches < acked, (batches, acked)  # the relays merged what their hosts sent
    # registrations and ends too: passed on one by one, 12,512 of each took a relay minutes to send
    # at 100,096 ranks, and every row waited behind them (issue 31)
    assert all(by_kind[kind][0] * 4 <= by_kind[kind][1] for kind in ("registers", "ends")), by_kind
