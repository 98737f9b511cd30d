"""The live diagnosis reads a bounded state, not a run's history: the rollups kept as rows arrive give
what the history gives, a pass remembers the newest steps it saw, and a store of an older version
gets the state filled from the rows it holds.

One small simulated run (8 ranks, 30 steps, heartbeats, losses and GPU gauges) with faults written
into it: a rank in flight in a collective, GPU throttling, an uncorrected ECC error and an Xid event,
a loss spike, and non-finite values from step 28.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rankscope.harness.simulate import anatomy_rows
from rankscope.collector.diagnosis import crash, engine, gpu, hang, nan, segment_window, straggler
from rankscope.collector.anatomy.path import INCIDENT_STEPS, STEP_PIECES_SQL
from rankscope.collector.diagnosis.context import RunContext
from rankscope.common.settings import Settings
from rankscope.harness.simulate import topology
from rankscope.collector.store.base import Store, arrow_schema
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.migrations import DIAGNOSIS_ROLLUPS, MIGRATIONS, migrate
from rankscope.collector.store.schema import BY_NAME

pytestmark = pytest.mark.timeout(300)

RUN = "state-1"
STEPS = 30
SPIKE_STEP, NAN_STEP, NAN_RANK = 25, 28, 2

# What the detectors read before the rollups: every row of the run's history.
HISTORY = {
    "state": (
        "SELECT rank, toUnixTimestamp64Nano(max(time)) AS time_ns, toUnixTimestamp64Nano(argMax(last_progress, time)) AS progress_ns, "
        "argMax(step, time) AS step, argMax(phase, time) AS phase, argMax(inflight_group, time) AS groups, "
        "argMax(inflight_seq, time) AS seqs, argMax(inflight_op, time) AS ops, argMax(inflight_peer, time) AS peers, "
        "argMax(inflight_waiting, time) AS waiting FROM heartbeats WHERE run_id = {run:String} AND attempt = 0 GROUP BY rank ORDER BY rank"
    ),
    "entered": (
        "SELECT rank, group_name, peer, peer >= 0 AND position(splitByChar(':', op)[-1], 'send') > 0 AS sends, max(seq) AS seq "
        "FROM collectives WHERE run_id = {run:String} AND attempt = 0 GROUP BY rank, group_name, peer, sends ORDER BY rank, group_name, peer, sends"
    ),
    "signals": (
        "SELECT rank, any(host) AS host, any(device) AS device, name, countIf(value > 0) AS samples_on, max(value) - min(value) AS increase, "
        "max(value) AS peak, toUnixTimestamp64Nano(minIf(time, value > 0)) AS first_ns, toUnixTimestamp64Nano(max(time)) AS last_ns FROM metrics "
        "WHERE run_id = {run:String} AND attempt = 0 AND (name IN {throttle:Array(String)} OR name = 'hw.errors.ecc_uncorrected' "
        "OR startsWith(name, 'hw.gpu.xid.')) GROUP BY rank, name ORDER BY rank, name"
    ),
    "losses": (
        "SELECT step, median(value) AS loss, arraySort(groupArray(rank)) AS ranks, toUnixTimestamp64Nano(min(time)) AS time_ns "
        "FROM step_metrics WHERE run_id = {run:String} AND attempt = 0 AND name = 'loss' GROUP BY step ORDER BY step"
    ),
}
# What the detectors read now (in the history's order).
STATE = {
    "state": hang.STATE_SQL + " ORDER BY rank",
    "entered": hang.ENTERED_SQL + " ORDER BY rank, group_name, peer, sends",
    "signals": gpu.SIGNALS_SQL + " ORDER BY rank, name",
    "losses": nan.LOSS_SQL.replace("groupArrayIfMerge(ranks)", "arraySort(groupArrayIfMerge(ranks))"),
}


def rows(table: str, n: int, **columns: Any) -> pa.Table:
    """``n`` rows of ``table``: the given columns (a value for all, or one per row), every other one empty."""
    schema = arrow_schema(BY_NAME[table])
    data = {}
    for field in schema:
        value = columns.get(field.name)
        if value is None:
            value = [[]] * n if pa.types.is_list(field.type) else ["" if pa.types.is_string(field.type) else 0] * n
        elif not isinstance(value, (list, np.ndarray)):
            value = [value] * n
        data[field.name] = pa.array(value, pa.int64() if pa.types.is_timestamp(field.type) else None).cast(field.type)
    return pa.table(data, schema=schema)


def write_faults(store: Store, end_ns: int) -> None:
    """The faults, as agents would send them in the run's last seconds (from the ranks' own host and
    device: the history's ``any`` and the rollup's ``anyLast`` pick from what a rank sent)."""
    t = [end_ns + 1_000_000 * i for i in range(4)]
    # rank 3 in flight in a tp all-reduce (and waiting in it), said twice; rank 4 said an older state later
    store.insert_arrow("heartbeats", rows(
        "heartbeats", 3, run_id=RUN, rank=[3, 3, 4], host="node-0", time=[t[0], t[1], t[0]], step=STEPS, phase="forward",
        status="running", last_progress=[t[0], t[0], t[0]], inflight_group=[["tp[0]"], ["tp[0]", "dp[1]"], []],
        inflight_seq=[[7], [7, 3], []], inflight_op=[["all_reduce"], ["all_reduce", "recv"], []], inflight_peer=[[-1], [-1, 5], []],
        inflight_issue=[[t[0]], [t[0], t[1]], []], inflight_waiting=[[1], [1, 0], []]))  # fmt: skip
    throttle, ecc, xid = "hw.gpu.throttle.hw_thermal", "hw.errors.ecc_uncorrected", "hw.gpu.xid.79"
    store.insert_arrow("metrics", rows(
        "metrics", 5, run_id=RUN, rank=[5, 5, 6, 6, 1], host="node-0", device=anatomy_rows.DEVICE, time=[t[0], t[1], t[0], t[2], t[3]],
        name=[throttle, throttle, ecc, ecc, xid], value=[1.0, 1.0, 0.0, 2.0, 1.0]))  # fmt: skip
    # the last stage reports a second loss, 1000, at one step (the step's median jumps); at NAN_STEP a
    # rank's outputs are not finite, and it reports a NaN loss
    spike = rows("step_metrics", 4, run_id=RUN, rank=[4, 5, 6, 7], step=SPIKE_STEP, name="loss", value=1000.0, time=t[0])
    bad = rows("step_metrics", 2, run_id=RUN, rank=NAN_RANK, step=NAN_STEP, name=["nonfinite_outputs", "loss"],
               value=[3.0, float("nan")], time=t[1])  # fmt: skip
    store.insert_arrow("step_metrics", pa.concat_tables([spike, bad]))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedStore, int]]:
    """The store, and the end of the run's last step (ns)."""
    store = EmbeddedStore(tmp_path_factory.mktemp("state") / "store")
    migrate(store, store.database, None)
    topo = topology.build(2, 2, 2)
    model = anatomy_rows.model(topo, microbatches=2, step_time_s=0.5, stragglers=[(6, 10, 1.5)])
    steps = anatomy_rows.write_run(store, topo, model, range(1, STEPS + 1), run_id=RUN, steps_per_insert=4, signals=True)
    write_faults(store, steps[-1].end_ns)
    yield store, steps[-1].end_ns
    store.close()


def read(store: Store, sql: str) -> list[dict]:
    """``sql``'s rows, its parameters the run's: every group, GPU throttle reasons that mean trouble."""
    groups = store.query_arrow("SELECT DISTINCT group_name FROM collectives WHERE run_id = {run:String}", {"run": RUN})["group_name"]
    params = {"run": RUN, "attempt": 0, "from": 0, "groups": groups.to_pylist(), "throttle": [f"hw.gpu.throttle.{r}" for r in gpu.BAD_THROTTLE]}
    return store.query_arrow(sql, params).to_pylist()


@pytest.mark.parametrize("what", list(HISTORY))
def test_each_rollup_reads_what_the_history_holds(run: tuple[EmbeddedStore, int], what: str) -> None:
    store, _ = run
    history, state = read(store, HISTORY[what]), read(store, STATE[what])
    if what == "losses":  # the rollup's losses: the steps with a finite median, as the history's
        assert [(r["step"], r["ranks"], r["time_ns"]) for r in state] == [(r["step"], r["ranks"], r["time_ns"]) for r in history]
        assert np.allclose([r["loss"] for r in state], [r["loss"] for r in history], equal_nan=True)
    else:
        assert state == history and len(state) > 0


def test_the_detectors_name_the_faults_from_the_state(run: tuple[EmbeddedStore, int]) -> None:
    store, end_ns = run
    ctx = RunContext.load(RUN, store.query_arrow, Settings())
    found = {f.key: f for f in gpu.detect(ctx)}
    assert set(found) == {"gpu_throttle:rank=5", "gpu_ecc:rank=6", "gpu_xid:rank=1"}
    assert "2 uncorrected ECC error(s)" in found["gpu_ecc:rank=6"].summary
    found = {f.key: f for f in nan.detect(ctx)}
    assert set(found) == {"nan", f"loss_spike:step={SPIKE_STEP}"}
    assert found["nan"].ranks == (NAN_RANK,) and found["nan"].evidence["step"] == NAN_STEP
    stragglers = straggler.detect(ctx)
    assert [f.ranks for f in stragglers] == [(6,)]
    assert crash.detect(ctx, now_ns=end_ns) == []  # every rank heard from at the end


def test_a_slower_rank_that_nobody_waits_for_is_no_straggler(run: tuple[EmbeddedStore, int]) -> None:
    """Ranks 6 and 7 are tensor-parallel peers, 1.5x and 2x slow from step 10: rank 6 waits for rank 7
    at every all-reduce, so its slowness costs the step nothing (the critical path runs through rank 7).
    Only rank 7 is named; without the cost floor rank 6 was too, "costs 0% of step time" (issue 29)."""
    store = EmbeddedStore(run[0].path, database="hidden")  # one chDB per process: another database of it
    try:
        migrate(store, store.database, None)
        topo = topology.build(2, 2, 2)
        model = anatomy_rows.model(topo, microbatches=2, step_time_s=0.5, stragglers=[(6, 10, 1.5), (7, 10, 2.0)])
        anatomy_rows.write_run(store, topo, model, range(1, 21), run_id="hidden", steps_per_insert=4)
        found = straggler.detect(RunContext.load("hidden", store.query_arrow, Settings()))
        assert [f.ranks for f in found] == [(7,)], [f.summary for f in found]
        assert found[0].evidence["critical_path_cost"]["share"] > 0.1
    finally:
        store.close()


def test_a_pass_reads_from_the_newest_step_it_saw(run: tuple[EmbeddedStore, int]) -> None:
    store, _ = run
    seen: dict[tuple[str, int], dict[str, int]] = {}
    asked: list[dict] = []

    def query(sql: str, params: dict) -> pa.Table:
        asked.append(dict(params))
        return store.query_arrow(sql, params)

    first = RunContext.load(RUN, query, Settings(), seen)
    before = straggler.detect(first)
    assert seen[(RUN, 0)][straggler.NEWEST_SQL] == STEPS
    asked.clear()
    again = RunContext.load(RUN, query, Settings(), seen)  # a later pass, its topology read again
    assert straggler.detect(again) == before
    assert [p["since"] for p in asked if "since" in p] == [STEPS]
    assert not [p for p in asked if "steps" in p]  # nothing new was stored: no point is read again
    assert before[0].evidence["critical_path_cost"]["share"] > 0
    assert not [p for p in asked if "step" in p]  # nor the frame of a step whose cost it kept
    window = [p["step"] for p in before[0].evidence["recent_steps"]]
    assert [p["path_steps"] for p in asked if "path_steps" in p] == [window]  # only counts the window's pieces
    assert before[0].evidence["critical_path_cost"]["steps"] == window[-INCIDENT_STEPS:]  # every rank sent them


def test_a_stragglers_cost_is_walked_on_the_newest_steps_every_rank_has_sent(run: tuple[EmbeddedStore, int]) -> None:
    """A step whose rows still arrive is left out of the straggler's cost (its path can miss the straggler:
    the demo's first incident said "costs 0% of step time"); while no step is whole, the incident has no cost."""
    store, _ = run
    arriving: set[int] = set()  # steps a rank's rows of which are not in yet

    def query(sql: str, params: dict) -> pa.Table:
        table = store.query_arrow(sql, params)
        if sql != STEP_PIECES_SQL:
            return table
        return pa.Table.from_pylist([r | {"ranks": r["ranks"] - 1} if r["step"] in arriving else r for r in table.to_pylist()],
                                    schema=table.schema)  # fmt: skip

    found = straggler.detect(RunContext.load(RUN, query, Settings()))
    window = [p["step"] for p in found[0].evidence["recent_steps"]]
    assert found[0].evidence["critical_path_cost"]["steps"] == window[-INCIDENT_STEPS:]
    arriving.add(window[-1])
    found = straggler.detect(RunContext.load(RUN, query, Settings()))
    assert found[0].evidence["critical_path_cost"]["steps"] == window[-INCIDENT_STEPS - 1 : -1]
    arriving.update(window)
    found = straggler.detect(RunContext.load(RUN, query, Settings()))
    assert found and "critical_path_cost" not in found[0].evidence and "of step time" not in found[0].summary, found[0].summary


def test_rows_that_come_late_are_read_with_their_step(run: tuple[EmbeddedStore, int]) -> None:
    """A rank's rows for steps far behind the newest (a spool replayed after an outage) are read when
    they arrive: the kept window then holds what a window read afresh holds."""
    store, end_ns = run
    seen: dict[tuple[str, int], dict] = {}
    ctx = RunContext.load(RUN, store.query_arrow, Settings(), seen)
    window = segment_window.SegmentWindow.of(ctx)
    first, last = 5, STEPS - 1
    window.refresh(ctx, first, last)
    held = {key: cell.wall.copy() for key, cell in window.cells.items()}
    late = list(range(8, 14))  # 16 to 21 steps behind the newest
    store.insert_arrow("spans", rows("spans", len(late), run_id=RUN, rank=1, step=late, name="backward", kind="compute",
                                     start_time=end_ns, end_time=end_ns + 50_000_000, cpu_ns=-1))  # fmt: skip
    window.refresh(ctx, first, last)
    for key, cell in window.cells.items():
        grew = key[0] == "backward" and key[1] in late
        assert np.allclose(cell.wall - held[key], np.where(np.arange(len(cell.wall)) == 1, 50e6 if grew else 0, 0))
    fresh = segment_window.SegmentWindow()
    fresh.refresh(RunContext.load(RUN, store.query_arrow, Settings()), first, last)
    assert fresh.cells.keys() == window.cells.keys()
    assert all(np.array_equal(fresh.cells[k].wall, window.cells[k].wall, equal_nan=True) for k in fresh.cells)


def test_spikes_are_judged_in_the_newest_steps_only(run: tuple[EmbeddedStore, int], monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = run
    ctx = RunContext.load(RUN, store.query_arrow, Settings())
    monkeypatch.setattr(nan, "SPIKE_STEPS", STEPS - SPIKE_STEP)  # the spike is one step too old
    assert [f.kind for f in nan.detect(ctx)] == ["nan"]


def test_active_runs_are_those_heard_from_lately(run: tuple[EmbeddedStore, int]) -> None:
    store, _ = run  # the run's rows are of 2026-01-01 and it says "finished": not active, unless heard from now
    assert RUN not in {r["run_id"] for r in store.query_arrow(engine.ACTIVE_RUNS_SQL, {"recent_s": 60}).to_pylist()}
    store.insert_arrow("heartbeats", rows("heartbeats", 1, run_id=RUN, rank=0, host="node-0", time=time.time_ns(), step=STEPS))
    assert RUN in {r["run_id"] for r in store.query_arrow(engine.ACTIVE_RUNS_SQL, {"recent_s": 60}).to_pylist()}


def test_version_3_fills_the_state_from_the_rows_a_store_holds_once(run: tuple[EmbeddedStore, int]) -> None:
    store = EmbeddedStore(run[0].path, database="older")  # one chDB per process: another database of it
    try:
        migrate(store, store.database, None, steps=MIGRATIONS[:2])
        for name in DIAGNOSIS_ROLLUPS:  # as a version-2 store: rows, no rollups of them yet
            store.command(f"DROP TABLE IF EXISTS {store.database}.{name}_mv")
            store.command(f"DROP TABLE IF EXISTS {store.database}.{name}")
        topo = topology.build(2, 1, 2)
        anatomy_rows.write_run(store, topo, anatomy_rows.model(topo, step_time_s=0.2), range(1, 6), run_id=RUN, signals=True)
        history = [read(store, HISTORY[what]) for what in ("state", "entered")]
        assert migrate(store, store.database, None) == MIGRATIONS[-1].version
        assert [read(store, STATE[what]) for what in ("state", "entered")] == history
        for sql in MIGRATIONS[2].statements(store.database, None, None):  # a step run again counts nothing twice
            store.command(sql)
        assert [read(store, STATE[what]) for what in ("state", "entered")] == history
        losses = read(store, "SELECT sum(nonfinite) AS n, count() AS steps FROM (SELECT step, sum(nonfinite) AS nonfinite FROM step_losses GROUP BY step)")
        assert losses == [{"n": 0, "steps": 5}]
        indexes = store.query_arrow(f"SELECT table FROM system.data_skipping_indices WHERE database = '{store.database}' ORDER BY table")
        assert indexes["table"].to_pylist() == ["collectives", "heartbeats", "spans", "step_metrics"]
    finally:
        store.close()
