"""The dashboard's pages in the states a recorded run never shows: no collector, an empty store, a
run without spans, unreadable evidence; and the heat map of a 12,288-rank run, timed.

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
from dashboard_pages import APP, PAGES, array, open_page, read_from, said
from streamlit.testing.v1 import AppTest

from rankscope.collector.diagnosis.incidents import from_rows
from rankscope.collector.store.base import arrow_schema
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.migrations import migrate
from rankscope.collector.store.schema import BY_NAME
from rankscope.dashboard import connection
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
    schema = arrow_schema(BY_NAME[table])
    arrays = [pa.array(columns[f.name], pa.int64() if pa.types.is_timestamp(f.type) else f.type).cast(f.type) for f in schema]
    store.insert_arrow(table, pa.Table.from_arrays(arrays, schema=schema))


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
    _run(store, "bare", 1, 1, 2, "running", NOW - 5 * 10**9, 0)
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


def test_evidence_that_is_not_a_json_object_is_read_back_as_unreadable_text():
    """The pages and the collector's own ledger read incidents through from_rows: it must take any stored text."""
    row = {"run_id": "r", "incident_id": "odd", "kind": "straggler", "severity": "warning", "status": "open", "ranks": [1],
           "hosts": ["node-0"], "first_seen_ns": NOW, "last_seen_ns": NOW, "summary": "odd", "sql": "", "version": 1}  # fmt: skip
    read = {text: from_rows([{**row, "evidence": text}])[0].finding.evidence for text in ("{not json", "[1, 2]", "null", "", '{"a": 1}')}
    assert read == {
        "{not json": {"unreadable evidence": "{not json"}, "[1, 2]": {"unreadable evidence": "[1, 2]"},
        "null": {"unreadable evidence": "null"}, "": {}, '{"a": 1}': {"a": 1},
    }  # fmt: skip


def test_the_heatmap_of_a_12288_rank_run_renders_in_under_three_seconds(store):
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
    assert by_host < 3.0 and by_rank < 3.0, f"host rows {by_host:.2f} s, rank rows {by_rank:.2f} s"


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
