"""The dashboard's pages in the states a recorded run never shows: no collector, an empty store, a
run without spans, unreadable evidence, a run restarted by a self-healing driver; and the heat map
of a 12,288-rank run, timed.

These rows are written straight into an embedded store in this process (the pages read it with
``--store`` semantics): the point is the page's behaviour at the edges and at scale, not the
content of a run, which tests/test_dashboard.py checks on a real recorded one.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest
import streamlit as st

from conftest import free_port
from dashboard_pages import APP, PAGES, array, open_page, page_text, read_from, said
from streamlit.testing.v1 import AppTest

from rankscope.common.incidents import from_rows
from rankscope.collector.store.base import arrow_schema
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.migrations import migrate
from rankscope.collector.store.schema import BY_NAME
from rankscope.dashboard import connection, data, ui
from rankscope.dashboard.connection import Source

NOW = time.time_ns()
# MegaScale's scale: 12,288 ranks, Megatron's order (rank = tp + dp*TP + pp*TP*DP), 8 ranks per host
TP, PP, DP = 8, 16, 96
BIG = TP * PP * DP
BIG_STEPS = 30


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStore]:
    """An empty store that the pages of this process read; closed (with their reader) at the end."""
    path = tmp_path_factory.mktemp("dashboard-store") / "store"
    opened = EmbeddedStore(path)
    migrate(opened, "rankscope", None)
    with pytest.MonkeyPatch.context() as mp:
        read_from(mp, Source(store=str(path)))
        yield opened
        connection.reset()  # chDB holds one store per process: let the next module open its own
    opened.close()


def _insert(store: EmbeddedStore, table: str, columns: dict[str, object]) -> None:
    """Rows of ``table`` from its columns; a column not given (``attempt``: 0, the first) holds its type's zero."""
    schema = arrow_schema(BY_NAME[table])
    rows = len(next(iter(columns.values())))
    columns = {f.name: columns[f.name] if f.name in columns else _zeros(f.type, rows) for f in schema}
    arrays = [pa.array(columns[f.name], pa.int64() if pa.types.is_timestamp(f.type) else f.type).cast(f.type) for f in schema]
    store.insert_arrow(table, pa.Table.from_arrays(arrays, schema=schema))


def _zeros(kind: pa.DataType, rows: int) -> list:
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_dictionary(kind):
        return [""] * rows
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return [[]] * rows
    return [0] * rows


def _run(store: EmbeddedStore, run_id: str, tp: int, pp: int, dp: int, status: str, start_ns: int, end_ns: int) -> None:
    world = tp * pp * dp
    _insert(store, "runs", {
        "run_id": [run_id], "name": [run_id], "start_time": [start_ns], "end_time": [end_ns], "world_size": [world], "tp": [tp],
        "pp": [pp], "dp": [dp], "config": ["{}"], "status": [status], "updated": [NOW],
    })  # fmt: skip
    rank = np.arange(world)
    _insert(store, "ranks", {
        "run_id": [run_id] * world, "rank": rank, "host": [f"node-{r // 8:04d}" for r in rank], "pid": rank + 1000,
        "local_rank": rank % 8, "device": ["cuda:0"] * world, "tp_rank": rank % tp, "pp_rank": rank // (tp * dp),
        "dp_rank": rank // tp % dp, "clock_offset_ns": np.zeros(world, "int64"), "agent_version": ["test"] * world,
        "registered": [start_ns] * world,
    })  # fmt: skip


def test_no_collector_is_a_message_on_every_page(monkeypatch):
    port = free_port()
    read_from(monkeypatch, Source(collector=f"127.0.0.1:{port}"))
    for name in PAGES:
        at = open_page(name)
        assert f"No data. cannot reach the collector at 127.0.0.1:{port}" in at.error[0].value.replace("*", ""), name


def test_an_empty_store_says_there_are_no_runs_yet(store):
    st.cache_data.clear()
    for name in PAGES:
        at = open_page(name)
        if name != "sql":  # the console works without runs
            assert "No runs yet" in said(at), name


def test_a_run_without_spans_and_with_unreadable_evidence(store):
    _run(store, "bare", 1, 1, 2, "running", time.time_ns() - 5 * 10**9, 0)  # live: started 5 s before this test, not the suite
    _insert(store, "incidents", {
        "run_id": ["bare"], "incident_id": ["odd"], "kind": ["straggler"], "severity": ["warning"], "status": ["open"],
        "ranks": [[1]], "hosts": [["node-0000"]], "first_seen": [NOW], "last_seen": [NOW], "summary": ["rank 1 (node-0000) is odd"],
        "evidence": ["{not json"], "sql": ["SELECT 1"], "version": [1],
    })  # fmt: skip
    st.cache_data.clear()
    assert "No spans recorded for this run yet" in said(open_page("heatmap", run="bare"))
    assert "there is no timeline to draw" in said(open_page("timeline", run="bare"))
    graph = open_page("graph", run="bare")
    assert "2 not started" in said(graph)
    overview = open_page("overview", run="bare")
    assert "rank 1 (node-0000) is odd" in said(overview) and "refreshing live" in said(overview)
    incident = open_page("incidents", run="bare")
    assert "unreadable evidence" in incident.json[0].value
    assert "No stack dump stored for rank 1" in said(incident)
    assert "No metrics from node-0000" in said(open_page("hosts", run="bare"))
    # a run never restarted, without a self-healing driver, shows nothing of them
    assert [h.value for h in overview.subheader] == ["1 open incident"] and not overview.table and "restart" not in said(overview)


S = 10**9
MS = 10**6


def _restarted_run(store: EmbeddedStore, start: int) -> None:
    """Run "healed": attempt 0 on 4 ranks (node-a: 0, 1; node-b: 2, 3; PP 2 x DP 2) runs steps 1-6, rank 2
    slow in steps 5-6; the driver checks both hosts, evicts node-b and restarts from the checkpoint of
    step 4: attempt 1, on 2 ranks of node-a (PP 2, so rank 1 is now stage 1), runs steps 5-8 again."""
    _insert(store, "runs", {
        "run_id": ["healed"], "name": ["healed"], "start_time": [start], "end_time": [start + 120 * S], "world_size": [2], "tp": [1],
        "pp": [2], "dp": [1], "config": ["{}"], "status": ["finished"], "updated": [NOW],
    })  # fmt: skip
    # (attempt, rank, host, pp, dp, registered)
    who = [(0, 0, "node-a", 0, 0, 0), (0, 1, "node-a", 0, 1, 0), (0, 2, "node-b", 1, 0, 0), (0, 3, "node-b", 1, 1, 0),
           (1, 0, "node-a", 0, 0, 99), (1, 1, "node-a", 1, 0, 99)]  # fmt: skip
    _insert(store, "ranks", {
        "run_id": ["healed"] * len(who), "rank": [w[1] for w in who], "host": [w[2] for w in who], "pid": [100 + i for i in range(len(who))],
        "local_rank": [w[1] % 2 for w in who], "device": ["cpu"] * len(who), "tp_rank": [0] * len(who), "pp_rank": [w[3] for w in who],
        "dp_rank": [w[4] for w in who], "clock_offset_ns": [0] * len(who), "agent_version": ["test"] * len(who),
        "registered": [start + w[5] * S for w in who], "attempt": [w[0] for w in who],
    })  # fmt: skip
    # (attempt, rank, step, begins, forward ms, step time s)
    cells = [(0, r, step, start + (step - 1) * S, 300 if (r == 2 and step >= 5) else 100, 3.0 if step >= 5 else 1.0)
             for step in range(1, 7) for r in range(4)]  # fmt: skip
    cells += [(1, r, step, start + (95 + step) * S, 150, 2.0) for step in range(5, 9) for r in range(2)]
    n = len(cells)
    column = lambda i: [c[i] for c in cells]  # noqa: E731
    _insert(store, "spans", {
        "run_id": ["healed"] * n, "rank": column(1), "step": column(2), "name": ["forward"] * n, "kind": ["compute"] * n,
        "start_time": column(3), "end_time": [c[3] + c[4] * MS for c in cells], "microbatch": [0] * n, "attributes": [""] * n,
        "cpu_ns": [-1] * n, "attempt": column(0),
    })  # fmt: skip
    _insert(store, "step_metrics", {
        "run_id": ["healed"] * n, "rank": column(1), "step": column(2), "name": ["step_time_s"] * n, "value": column(5),
        "time": [c[3] + S // 2 for c in cells], "attempt": column(0),
    })  # fmt: skip
    beats = [(0, r, 6, start + 6 * S) for r in range(4)] + [(1, r, 8, start + 110 * S) for r in range(2)]
    _insert(store, "heartbeats", {
        "run_id": ["healed"] * len(beats), "rank": [b[1] for b in beats], "host": ["node-a" if b[0] or b[1] < 2 else "node-b" for b in beats],
        "time": [b[3] for b in beats], "step": [b[2] for b in beats], "phase": ["forward"] * len(beats), "status": ["running"] * len(beats),
        "last_progress": [b[3] for b in beats], "inflight_group": [[]] * len(beats), "inflight_seq": [[]] * len(beats),
        "inflight_op": [[]] * len(beats), "inflight_peer": [[]] * len(beats), "inflight_issue": [[]] * len(beats),
        "inflight_waiting": [[]] * len(beats), "events_dropped": [0] * len(beats), "attempt": [b[0] for b in beats],
    })  # fmt: skip
    # attempt 0's processes were stopped by the restart; attempt 1's ended normally
    ends = [(0, r, "node-a" if r < 2 else "node-b", 72, "signal", 15) for r in range(4)] + [(1, r, "node-a", 115, "normal", 0) for r in range(2)]
    _insert(store, "exits", {
        "run_id": ["healed"] * len(ends), "rank": [e[1] for e in ends], "host": [e[2] for e in ends], "time": [start + e[3] * S for e in ends],
        "reason": [e[4] for e in ends], "exit_code": [0] * len(ends), "signal": [e[5] for e in ends], "message": [""] * len(ends),
        "attempt": [e[0] for e in ends],
    })  # fmt: skip
    _insert(store, "incidents", {
        "run_id": ["healed"], "incident_id": ["straggler-2"], "kind": ["straggler"], "severity": ["warning"], "status": ["closed"],
        "ranks": [[2]], "hosts": [["node-b"]], "first_seen": [start + 5 * S], "last_seen": [start + 6 * S],
        "summary": ["rank 2 (node-b): forward 3x its stage's median"], "evidence": ["{}"], "sql": ["SELECT 1"], "version": [1],
    })  # fmt: skip
    # GPU temperature from node-a, and from node-c, whose ranks' registrations were all replaced by later ones (merged)
    _insert(store, "metrics", {
        "run_id": ["healed"] * 2, "rank": [0, 4], "host": ["node-a", "node-c"], "device": ["cuda:0"] * 2, "time": [start + 3 * S] * 2,
        "name": ["hw.temperature"] * 2, "value": [60.0, 91.0],
    })  # fmt: skip
    # (seconds, attempt, action, hosts, incident, reason, evidence)
    acts = [
        (60, 0, "incident", ["node-b"], "straggler-2", "a straggler on node-b for 3 steps", {}),
        (61, 0, "selfcheck", ["node-a", "node-b"], "straggler-2", "self-check node-b against node-a", {}),
        (70, 0, "evict", ["node-b"], "straggler-2", "node-b failed its self-check (matmul)", {}),
        (71, 0, "restart", ["node-a"], "", "restart from the checkpoint of step 4 without node-b", {"checkpoint_step": 4}),
        (101, 1, "resumed", [], "", "first step after the restart", {"steps_lost": 2, "resumed_step": 5, "seconds": 31.0}),
        (116, 1, "finished", [], "", "the job ended normally", {}),
    ]
    _insert(store, "actions", {
        "run_id": ["healed"] * len(acts), "time": [start + a[0] * S for a in acts], "attempt": [a[1] for a in acts],
        "action": [a[2] for a in acts], "hosts": [a[3] for a in acts], "incident_id": [a[4] for a in acts],
        "reason": [a[5] for a in acts], "evidence": [json.dumps(a[6]) for a in acts],
    })  # fmt: skip
    # node-b drained by the driver (its newest state), node-a suspected then found healthy
    states = [("node-a", 60, "suspect", "a straggler on node-b for 3 steps"), ("node-a", 65, "healthy", "passed its self-check"),
              ("node-b", 60, "suspect", "a straggler on node-b for 3 steps"), ("node-b", 61, "checking", "self-check against 1 other host"),
              ("node-b", 70, "drained", "rankscope: straggler straggler-2: rank 2 (node-b): forward 3x its stage's median")]  # fmt: skip
    _insert(store, "node_states", {
        "run_id": ["healed"] * len(states), "host": [n[0] for n in states], "time": [start + n[1] * S for n in states],
        "state": [n[2] for n in states], "incident_id": ["straggler-2"] * len(states), "reason": [n[3] for n in states],
        "actor": ["rankscope launch"] * len(states),
    })  # fmt: skip
    # (host, check, value, unit, peers' median, passed, host passed)
    checks = [("node-a", "matmul", 40.0, "GFLOP/s", 5.0, 1, 1), ("node-a", "memory_bandwidth", 10.0, "GB/s", 9.5, 1, 1),
              ("node-b", "matmul", 5.0, "GFLOP/s", 40.0, 0, 0), ("node-b", "memory_bandwidth", 9.5, "GB/s", 10.0, 1, 0)]  # fmt: skip
    _insert(store, "selfchecks", {
        "run_id": ["healed"] * len(checks), "host": [c[0] for c in checks], "time": [start + 65 * S] * len(checks),
        "check": [c[1] for c in checks], "value": [c[2] for c in checks], "unit": [c[3] for c in checks],
        "reference": [c[4] for c in checks], "passed": [c[5] for c in checks], "host_passed": [c[6] for c in checks],
        "summary": ["matmul 0.12x its peers" if c[0] == "node-b" else "all figures within 2x of its peers" for c in checks],
        "detail": [""] * len(checks),
    })  # fmt: skip


def test_a_restarted_run_counts_each_step_once_as_its_latest_attempt_ran_it(store):
    start = NOW - 600 * S
    _restarted_run(store, start)
    st.cache_data.clear()
    run = next(r for r in data.runs() if r.id == "healed")
    assert run.attempt == 1
    cells = data.heat_cells(run, "forward", 1, 8, "rank")
    assert not cells.duplicated(["rank", "step"]).any()
    ms = cells.set_index(["step", "rank"])["ns"] / MS
    assert ms.loc[3].to_dict() == {0: 100, 1: 100, 2: 100, 3: 100}  # run once, by attempt 0's four ranks
    assert ms.loc[5].to_dict() == {0: 150, 1: 150}  # run twice: attempt 1's, not attempt 0's (nor their sum)
    assert sorted(cells["step"].unique()) == list(range(1, 9))
    # rank 1 was stage 0 in attempt 0 and is stage 1 now: each cell against its stage as it was then
    assert cells.set_index(["step", "rank"]).loc[(3, 1), "ratio"] == pytest.approx(1.0)
    steps = data.step_metrics(run).set_index("first_step")
    assert steps.loc[5, "mid"] == 2.0 and steps.loc[5, "ranks"] == 2 and steps.loc[3, "ranks"] == 4
    assert data.window(run, 5, 5)[0] == start + 100 * S  # attempt 1's step 5, not attempt 0's
    assert data.step_at(run, start + 100 * S + MS) == 5  # attempt 0 had gone further (step 6) earlier
    hosts = data.hosts(run)
    assert [(h, list(r)) for h, r in zip(hosts["host"], hosts["ranks"])] == [("node-a", [0, 1]), ("node-b", [2, 3]), ("node-c", [])]
    assert hosts["max_temp_c"].tolist()[::2] == [60.0, 91.0]


def test_a_restarted_run_shows_where_it_restarted_and_what_the_driver_did(store):
    overview = open_page("overview", run="healed")
    text = said(overview)
    assert "attempt 1 (restarted once)" in text
    assert "attempt 1: restarted without node-b, from step 5 (2 steps run again, resumed after 31 s)" in text
    assert [h.value for h in overview.subheader] == ["Self-healing"]
    actions = overview.table[0].value
    assert list(actions["action"]) == ["incident", "selfcheck", "evict", "restart", "resumed", "finished"]
    assert actions.set_index("action").loc["evict", "hosts"] == "node-b"
    assert "at step 5, 2 steps lost" in actions.set_index("action").loc["resumed", "details"]
    checks = overview.table[1].value
    assert checks.iloc[0][["host", "check", "passed"]].tolist() == ["node-b", "matmul", "❌"]  # failures first
    assert (checks["passed"] == "✅").sum() == 3
    assert "❌ **node-b** failed its self-check (matmul): matmul 0.12x its peers" in text
    spec = json.loads(overview.get("plotly_chart")[0].proto.spec)
    lines = [s for s in spec["layout"]["shapes"] if s.get("name") == "attempt 1"]
    assert [line["x0"] for line in lines] == [5]
    assert any(a["text"] == "attempt 1: restarted without node-b" for a in spec["layout"]["annotations"])

    heat = open_page("heatmap", run="healed")
    assert "The run was restarted" in said(heat)
    spec = json.loads(heat.get("plotly_chart")[0].proto.spec)
    assert [s["x0"] for s in spec["layout"]["shapes"] if s.get("name") == "attempt 1"] == [4.5]  # before step 5's column

    incidents = open_page("incidents", run="healed")
    assert "What the self-healing driver did about it" in said(incidents)
    assert "**evict** node-b: node-b failed its self-check (matmul)" in said(incidents)
    assert "Self-healing" in [h.value for h in incidents.subheader]

    listed = open_page("hosts", run="healed").table[0].value.set_index("host")
    assert listed.loc["node-c", "ranks"] == "none now (left the run at a restart)" and listed.loc["node-c", "hottest GPU (°C)"] == "91"
    assert listed.loc["node-b", "node state"].startswith("drained since ") and "forward 3x its stage's median" in listed.loc["node-b", "why"]
    assert listed.loc["node-a", "node state"].startswith("healthy since ") and listed.loc["node-c", "node state"] == "never suspected"
    graph = open_page("graph", run="healed")  # just before attempt 1 ended: its two ranks, not attempt 0's stopped four
    assert "2 computing" in said(graph) and "crashed" not in said(graph)


@pytest.mark.timeout(120)
def test_a_plain_ddp_job_is_data_parallel_without_stages(store):
    """A job that declared no 3D layout (plain DDP: registered 1 x 1 x 1, its ranks at tp, pp and dp -1)
    is data parallel over its world: the runs page says 1 x 1 x 4, the heat map's rows are ranks on
    hosts (no "stage -1"), the graph puts each rank in a replica of its own (issue 29)."""
    start = NOW - 300 * S
    _insert(store, "runs", {
        "run_id": ["ddp"], "name": ["ddp"], "start_time": [start], "end_time": [start + 60 * S], "world_size": [4], "tp": [1], "pp": [1],
        "dp": [1], "config": ["{}"], "status": ["finished"], "updated": [NOW],
    })  # fmt: skip
    _insert(store, "ranks", {
        "run_id": ["ddp"] * 4, "rank": list(range(4)), "host": ["node-a", "node-a", "node-b", "node-b"], "pid": [200, 201, 202, 203],
        "local_rank": [0, 1, 0, 1], "device": ["cpu"] * 4, "tp_rank": [-1] * 4, "pp_rank": [-1] * 4, "dp_rank": [-1] * 4,
        "clock_offset_ns": [0] * 4, "agent_version": ["test"] * 4, "registered": [start] * 4,
    })  # fmt: skip
    cells = [(r, step) for step in range(1, 7) for r in range(4)]
    _insert(store, "spans", {
        "run_id": ["ddp"] * len(cells), "rank": [c[0] for c in cells], "step": [c[1] for c in cells], "name": ["forward"] * len(cells),
        "kind": ["compute"] * len(cells), "start_time": [start + c[1] * S for c in cells],
        "end_time": [start + c[1] * S + (300 if c[0] == 1 else 100) * MS for c in cells], "microbatch": [0] * len(cells),
        "attributes": [""] * len(cells), "cpu_ns": [-1] * len(cells),
    })  # fmt: skip
    st.cache_data.clear()
    row = next(line for line in page_text(open_page("runs")).splitlines() if "(./?run=ddp)" in line)
    assert "| 4 | 1 × 1 × 4 |" in row, row
    heat = open_page("heatmap", run="ddp", segment="forward")
    assert "Slowest against its stage: rank 1 (node-a)**, forward 3.00×" in said(heat) and "stage -1" not in said(heat), said(heat)
    labels = json.loads(heat.get("plotly_chart")[0].proto.spec)["data"][0]["y"]
    assert labels == ["rank 0 · node-a", "rank 1 · node-a", "rank 2 · node-b", "rank 3 · node-b"]
    graph = json.loads(open_page("graph", run="ddp").get("plotly_chart")[0].proto.spec)
    assert graph["layout"]["xaxis"]["ticktext"] == ["no stages declared"]
    ranks = next(t for t in graph["data"] if t.get("mode") == "markers+text")
    assert len(set(array(ranks["y"]).tolist())) == 4  # a replica each, not four ranks drawn on one spot
    # a stopped rank's stack, taken by its host-mate, attached to the hang: its text, and who took it
    stack = {"2": {"method": "py-spy", "text": "Process 1002: python ddp_job.py", "taken_by": 3}}
    _insert(store, "incidents", {
        "run_id": ["ddp"], "incident_id": ["hang"], "kind": ["hang"], "severity": ["critical"], "status": ["closed"], "ranks": [[2]],
        "hosts": [["node-b"]], "first_seen": [start + 9 * S], "last_seen": [start + 20 * S], "summary": ["hang: rank 2 (node-b) in step 4"],
        "evidence": [json.dumps({"stacks_from_outside": stack})], "sql": ["SELECT 1"], "version": [1],
    })  # fmt: skip
    st.cache_data.clear()
    incident = open_page("incidents", run="ddp")
    assert "rank 2, taken from outside by rank 3 (py-spy)" in said(incident) and incident.code[0].value == "Process 1002: python ddp_job.py"
    # a straggler named by its late arrivals (a rank starved of CPU: its own segments look even): the heat map boxes
    # the rank the diagnosis named, not the slowest colour
    _insert(store, "incidents", {
        "run_id": ["ddp"], "incident_id": ["straggler:rank=3"], "kind": ["straggler"], "severity": ["warning"], "status": ["closed"],
        "ranks": [[3]], "hosts": [["node-b"]], "first_seen": [start + 3 * S], "last_seen": [start + 6 * S],
        "summary": ["straggler: rank 3 (node-b) arrives last at default_pg's collectives"], "evidence": ["{}"], "sql": ["SELECT 1"], "version": [1],
    })  # fmt: skip
    st.cache_data.clear()
    heat = open_page("heatmap", run="ddp", segment="forward")
    assert "Named by the diagnosis (boxed): rank 3 (node-b)**: its forward time is within its stage's here" in said(heat), said(heat)
    boxes = [shape["y0"] + 0.5 for shape in json.loads(heat.get("plotly_chart")[0].proto.spec)["layout"]["shapes"] if shape["type"] == "rect"]
    assert boxes == [3], boxes  # row 3 (rank 3), not row 1


def test_evidence_that_is_not_a_json_object_is_read_back_as_unreadable_text():
    """The pages and the collector's own ledger read incidents through from_rows: it must take any stored text."""
    row = {"run_id": "r", "incident_id": "odd", "kind": "straggler", "severity": "warning", "status": "open", "ranks": [1],
           "hosts": ["node-0"], "first_seen_ns": NOW, "last_seen_ns": NOW, "summary": "odd", "sql": "", "version": 1}  # fmt: skip
    read = {text: from_rows([{**row, "evidence": text}])[0].finding.evidence for text in ("{not json", "[1, 2]", "null", "", '{"a": 1}')}
    assert read == {
        "{not json": {"unreadable evidence": "{not json"}, "[1, 2]": {"unreadable evidence": "[1, 2]"},
        "null": {"unreadable evidence": "null"}, "": {}, '{"a": 1}': {"a": 1},
    }  # fmt: skip


def test_the_heatmap_of_a_12288_rank_run_is_one_image_that_names_the_straggler(store):
    """12,288 ranks drawn as one image (not a trace per rank), by host and by rank, the straggler named.
    How fast: 1-3 s here alone; the bound only catches a page gone pathological (a loaded suite's
    background lane took 3.8 s, CI of 11134ce)."""
    start = NOW - 3600 * 10**9
    _run(store, "big", TP, PP, DP, "finished", start, start + BIG_STEPS * 2 * 10**9)
    rng = np.random.default_rng(0)
    rank = np.tile(np.arange(BIG), BIG_STEPS)
    step = np.repeat(np.arange(1, BIG_STEPS + 1), BIG)
    duration = rng.normal(100e6, 2e6, len(rank)).astype("int64")
    duration[rank == 4321] = duration[rank == 4321] * 13 // 10  # a straggler on host node-0540
    begin = start + (step - 1).astype("int64") * 2 * 10**9
    _insert(store, "spans", {
        "run_id": ["big"] * len(rank), "rank": rank, "step": step, "name": ["forward"] * len(rank), "kind": ["compute"] * len(rank),
        "start_time": begin, "end_time": begin + duration, "microbatch": np.zeros(len(rank), "int32"),
        "attributes": [""] * len(rank), "cpu_ns": np.full(len(rank), -1, "int64"),
    })  # fmt: skip
    st.cache_data.clear()
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params["run"] = "big"
    at.run()
    started = time.perf_counter()
    at.switch_page("views/heatmap.py").run()
    by_host = time.perf_counter() - started
    assert not at.exception, [e.value for e in at.exception]
    assert "Slowest against its stage: host node-0540 (rank 4321), stage 5" in said(at)
    at.radio[0].set_value("rank")
    started = time.perf_counter()
    at.run()
    by_rank = time.perf_counter() - started
    assert "Slowest against its stage: rank 4321 (node-0540), stage 5" in said(at)
    assert '"type":"image"' in at.get("plotly_chart")[0].proto.spec.replace(" ", "")
    print(f"\nheat map of 12,288 ranks: host rows {by_host:.2f} s, rank rows {by_rank:.2f} s")
    assert by_host < 20 and by_rank < 20, f"host rows {by_host:.2f} s, rank rows {by_rank:.2f} s"


def test_the_graph_of_a_12288_rank_run_starts_by_host(store):
    at = open_page("graph", run="big")
    assert "12288 not started" in said(at)  # the synthetic run has no heartbeats
    assert at.radio[0].value == "hosts"
    hosts = _figure_points(at)
    assert hosts == BIG // 8
    at.radio[0].set_value("ranks").run()  # a slice of 32 data-parallel replicas: 8 x 16 x 32 ranks
    assert not at.exception and _figure_points(at) == TP * PP * 32


def _figure_points(at: AppTest) -> int:
    """How many ranks (or hosts) the graph draws in the "not started" state."""
    trace = next(t for t in json.loads(at.get("plotly_chart")[0].proto.spec)["data"] if t.get("name") == "not started")
    return len(array(trace["x"]))


def test_pages_open_on_the_newest_run_unless_the_url_names_one(store):
    assert "Run **bare**" in said(open_page("heatmap"))  # started last
    assert "Run **big**" in said(open_page("heatmap", run="big"))


def test_the_command_refuses_a_directory_that_holds_no_store(proc_runner, tmp_path):
    proc = proc_runner.start([sys.executable, "-m", "rankscope.cli.main", "dashboard", "--store", str(tmp_path / "nothing")])
    assert proc.wait(60) == 1
    assert "no store at" in proc.stderr


# --- step anatomy -------------------------------------------------------------------------------


def _anatomy_runs(store: EmbeddedStore) -> None:
    """Two runs of 4 ranks (PP 2 x DP 2), the rows tests/test_compare.py writes: "anat-base", and "anat-slow",
    whose rank 3 computes its backward 100 ms longer from step 3 on. Older than every other run here."""
    from test_compare import straggler, write_run

    if "anat-base" not in {r.id for r in data.runs()}:
        write_run(store, "anat-base", start=NOW - 7200 * S)
        write_run(store, "anat-slow", start=NOW - 3600 * S, compute=straggler(3))
    st.cache_data.clear()


def _anatomy_core() -> bool:
    return data._anatomy() is not None


def test_the_step_anatomy_page_breaks_the_steps_down_and_draws_a_critical_path(store):
    _anatomy_runs(store)
    if not _anatomy_core():
        pytest.skip("this build has no step-anatomy core (rankscope.collector.anatomy): the fallback test covers the page")
    at = open_page("anatomy", run="anat-slow")
    text = said(at)
    headings = [h.value for h in at.subheader]
    assert headings[0] == "Where the step time goes" and headings[1].startswith("Critical path of step ")
    step = int(headings[1].rsplit(" ", 1)[1])
    assert 3 <= step <= 8  # the median step of 1-8 by its slowest rank: one of the straggler's
    assert "Steps **1-8**, the mean rank's step" in text
    breakdown = json.loads(at.get("plotly_chart")[0].proto.spec)
    names = [t["name"] for t in breakdown["data"]]
    assert names[0] == "compute" and set(names) <= {"compute", "optimizer", "data", "pipeline bubble", "exposed communication", "unexplained"}
    assert all(t.get("stackgroup") == "steps" for t in breakdown["data"])
    assert [s["x0"] for s in breakdown["layout"]["shapes"]] == [step]
    assert "The costliest: **rank 3 (node-1) backward**, 100.0 ms more than its peers" in text
    path = json.loads(at.get("plotly_chart")[1].proto.spec)
    assert "critical path" in [t["name"] for t in path["data"]]
    assert at.table[0].value.iloc[0][["rank", "link"]].tolist() == ["rank 3 (node-1)", "backward"]
    at.number_input(key="anatomy_step").set_value(2).run()  # before the straggler: nobody costs 100 ms
    assert not at.exception and "Critical path of step 2" in [h.value for h in at.subheader]
    assert "100.0 ms more than its peers" not in said(at)


def test_without_the_anatomy_core_the_page_shows_the_span_kinds_and_says_the_path_is_missing(store, monkeypatch):
    _anatomy_runs(store)
    monkeypatch.setattr(data, "_anatomy", lambda: None)
    st.cache_data.clear()
    at = open_page("anatomy", run="anat-slow")
    text = said(at)
    assert "The critical path is not available in this build" in text
    breakdown = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert [t["name"] for t in breakdown["data"]] == ["compute", "optimizer", "communication (waits included)", "unexplained"]
    by_name = {t["name"]: array(t["y"]) for t in breakdown["data"]}
    # step 8 of "anat-slow": every rank computes 300 ms (rank 3: 400), waits in grad_sync, 10 ms of optimizer; 430 ms a step
    assert by_name["compute"][-1] == pytest.approx(325) and by_name["optimizer"][-1] == pytest.approx(10)
    assert by_name["compute"][-1] + by_name["optimizer"][-1] + by_name["communication (waits included)"][-1] + by_name["unexplained"][-1] == \
        pytest.approx(430)  # fmt: skip
    st.cache_data.clear()


def test_the_step_anatomy_page_compares_with_another_run_or_other_steps(store):
    _anatomy_runs(store)
    at = open_page("anatomy", run="anat-slow")
    assert "Pick a run to compare with" in said(at)
    at.selectbox(key="anatomy_baseline").set_value("anat-base").run()
    assert not at.exception, [e.value for e in at.exception]
    headline = "step time +100 ms (+30%): rank 3 backward +100 ms (100% of the difference)"
    assert f"**{ui.escape(headline)}**" in said(at)
    tables = {t.value.columns[0]: t.value for t in at.table}
    assert tables["contribution"].iloc[0].tolist() == ["rank 3 backward", "200.0", "300.0", "+100.0", "100%"]
    assert tables["wait"].iloc[0]["wait"] in ("dp[1] all_reduce arrival skew, last to arrive: rank 3", "time in grad_sync (waits included)")
    bars = json.loads(at.get("plotly_chart")[-1].proto.spec)["data"][0]
    assert bars["y"][-1] == "rank 3 backward" and array(bars["x"])[-1] == pytest.approx(100)  # the first at the top
    # two ranges of the run itself: steps 1-2 (before the straggler) against 4-8
    at.radio(key="anatomy_mode").set_value("other steps of this run").run()
    at.slider(key="anatomy_a").set_value((1, 2)).run()
    at.slider(key="anatomy_b").set_value((4, 8)).run()
    assert not at.exception and f"**{ui.escape(headline)}**" in said(at)
    assert "A: run anat-slow, steps 1-2" in said(at)
    # a link to the page can name the baseline run
    linked = open_page("anatomy", run="anat-slow", against="anat-base")
    assert f"**{ui.escape(headline)}**" in said(linked)


def test_the_step_anatomy_page_without_spans_or_without_data(store, monkeypatch):
    _run(store, "anat-bare", 1, 1, 2, "running", NOW - 9000 * S, 0)
    st.cache_data.clear()
    assert "there is no step to take apart" in said(open_page("anatomy", run="anat-bare"))
    port = free_port()
    read_from(monkeypatch, Source(collector=f"127.0.0.1:{port}"))
    at = open_page("anatomy")
    assert f"No data. cannot reach the collector at 127.0.0.1:{port}" in at.error[0].value.replace("*", "")
