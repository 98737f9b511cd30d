"""The dashboard's pure parts on small hand-made frames: figures, rank states, the Perfetto export,
the SQL cookbook's placeholders, the data source hand-over. No store, no Streamlit runtime.

The pages on a real recorded run: tests/test_dashboard.py.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pandas as pd
import pytest

from rankscope.common.incidents import Finding, Incident
from rankscope.dashboard import cookbook, export, figures, healing, states
from rankscope.dashboard.connection import SOURCE_VARIABLE, Source

T0 = 1_800_000_000_000_000_000


def _cells(ranks: int, steps: int, slow_rank: int | None = None, pp: int = 2) -> pd.DataFrame:
    """Heat map cells of ``ranks`` ranks (two per host) over ``steps`` steps, one rank 30% slow."""
    rank = np.repeat(np.arange(ranks), steps)
    step = np.tile(np.arange(1, steps + 1), ranks)
    ratio = np.ones(len(rank))
    if slow_rank is not None:
        ratio[rank == slow_rank] = 1.3
    return pd.DataFrame({
        "step": step, "row": rank.astype(str), "rank": rank, "host": [f"node-{r // 2}" for r in rank],
        "pp": rank * pp // ranks, "ns": (ratio * 1e8).astype("int64"), "ratio": ratio, "cpu_time": True,
    })  # fmt: skip


# --- overview ---------------------------------------------------------------------------------


def test_overview_has_a_panel_per_scalar_present_and_skips_the_absent_ones():
    metrics = pd.DataFrame({
        "first_step": [1, 2, 1, 2], "name": ["step_time_s", "step_time_s", "loss", "loss"],
        "mid": [2.0, 1.5, 7.6, 7.4], "low": [1.9, 1.4, 7.6, 7.4], "high": [2.2, 1.6, 7.6, 7.4],
    })  # fmt: skip
    fig = figures.overview_figure(metrics)
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["step time (s)", "loss"]  # no MFU panel: it was not reported
    medians = [t for t in fig.data if t.mode == "lines+markers"]
    assert [list(t.y) for t in medians] == [[2.0, 1.5], [7.6, 7.4]]


# --- heat map ---------------------------------------------------------------------------------


def test_slowest_names_the_slow_rank_and_ignores_step_one():
    cells = _cells(8, 10, slow_rank=5)
    cells.loc[(cells["step"] == 1) & (cells["rank"] == 2), "ratio"] = 3.0  # start-up cost, not a straggler
    top = figures.slowest(cells)
    assert int(top.iloc[0]["rank"]) == 5
    assert top.iloc[0]["ratio"] == pytest.approx(1.3)
    assert top.iloc[0]["steps"] == 9
    assert 2 not in set(top[top["ratio"] > 1.05]["rank"])


def test_heatmap_orders_rows_by_stage_then_host_and_outlines_the_highlighted_row():
    cells = _cells(8, 6, slow_rank=5).sample(frac=1, random_state=0)  # the query's order is arbitrary
    fig = figures.heatmap_figure(cells, "backward", highlight=["5"])
    heat = fig.data[0]
    assert heat.type == "heatmap"
    assert list(heat.y)[:2] == ["rank 0 · node-0 · stage 0", "rank 1 · node-0 · stage 0"]
    z = np.array(heat.z)
    assert z.shape == (8, 6)
    assert np.allclose(z[list(heat.y).index("rank 5 · node-2 · stage 1")], 1.3)
    boxes = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(boxes) == 1 and boxes[0].y0 == 4.5  # row 5 is the sixth row
    assert any(s.type == "line" for s in fig.layout.shapes)  # the stage boundary


def test_a_heatmap_of_12288_ranks_is_one_image_built_in_well_under_three_seconds():
    cells = _cells(12_288, 40, slow_rank=4_000, pp=16)
    started = time.perf_counter()
    fig = figures.heatmap_figure(cells, "forward", highlight=["4000"])
    spec = fig.to_json()
    elapsed = time.perf_counter() - started
    assert fig.data[0].type == "image" and fig.data[0].source.startswith("data:image/png;base64,")
    assert len(spec) < 2_000_000, "the browser gets a compact image, not a million cells"
    assert elapsed < 1.5, f"figure took {elapsed:.2f} s"


# --- restarts and self-healing ----------------------------------------------------------------

S = 10**9


def _actions(*rows: tuple) -> pd.DataFrame:
    """(seconds, attempt, action, hosts, reason, evidence) -> rows as ``data.actions`` returns them."""
    return pd.DataFrame([{"time_ns": T0 + t * S, "attempt": a, "action": act, "hosts": hosts, "incident_id": "inc-1" if act == "evict" else "",
                          "reason": why, "evidence": json.dumps(ev)} for t, a, act, hosts, why, ev in rows],
                        columns=["time_ns", "attempt", "action", "hosts", "incident_id", "reason", "evidence"])  # fmt: skip


HEALED = _actions(
    (10, 0, "incident", ["node-2"], "a straggler on node-2", {}),
    (20, 0, "evict", ["node-2"], "node-2 failed its self-check", {}),
    (21, 0, "restart", ["node-1"], "restart from step 6's checkpoint", {}),
    (60, 1, "resumed", [], "", {"steps_lost": 2, "resumed_step": 7, "seconds": 39.5}),
    (90, 1, "evict", ["node-3"], "node-3 lost", {}),
    (91, 1, "restart", [], "", {}),
)


def test_restarts_take_the_first_step_from_the_resumed_action_else_from_the_attempt_and_name_the_evicted_hosts():
    attempts = pd.DataFrame({"attempt": [1, 2], "first_step": [8, 11], "last_step": [10, 12], "start_ns": [T0 + 50 * S, T0 + 95 * S]})
    found = healing.restarts(attempts, HEALED)
    assert found["attempt"].tolist() == [1, 2]
    assert found["step"].tolist() == [7, 11]  # attempt 1 resumed at step 7 (its first span may have been lost); attempt 2 from its data
    assert found["label"].tolist() == ["attempt 1: restarted without node-2", "attempt 2: restarted without node-3"]
    assert found["reason"].tolist() == ["restart from step 6's checkpoint", "node-3 lost"]  # no reason given for the second restart
    first = found.iloc[0].to_dict()
    assert (first["steps_lost"], first["seconds"]) == (2.0, 39.5) and np.isnan(found.iloc[1]["seconds"])
    assert healing.restart_sentence(first) == ("attempt 1: restarted without node-2, from step 7 (2 steps run again, resumed after 40 s): "
                                               "restart from step 6's checkpoint")  # fmt: skip
    # the driver may record the restart under the new attempt once it sees it, even after the first step
    noticed = _actions((20, 0, "evict", ["node-2"], "node-2 failed", {}), (60, 1, "resumed", ["node-1"], "", {"resumed_step": 7}),
                       (65, 1, "restart", ["node-1"], "attempt 1: 2 ranks on node-1", {}))  # fmt: skip
    late = healing.restarts(attempts.head(1), noticed).iloc[0]
    assert (late["step"], late["label"], late["reason"]) == (7, "attempt 1: restarted without node-2", "attempt 1: 2 ranks on node-1")
    # a plain torchrun restart (no driver, no actions), and a run never restarted
    plain = healing.restarts(attempts.head(1), _actions())
    assert plain[["step", "label"]].values.tolist() == [[8, "attempt 1: restarted"]]
    assert healing.restarts(pd.DataFrame(), pd.DataFrame()).empty


def test_the_overview_and_the_heat_map_mark_where_each_attempt_began():
    restarts = healing.restarts(pd.DataFrame(columns=["attempt", "first_step", "last_step", "start_ns"]), HEALED)
    metrics = pd.DataFrame({"first_step": [5, 6, 7, 8], "name": ["step_time_s"] * 4, "mid": [1.0] * 4, "low": [1.0] * 4, "high": [1.0] * 4})
    fig = figures.overview_figure(metrics, restarts)
    assert [(s.x0, s.x1, s.yref) for s in fig.layout.shapes] == [(7, 7, "paper")]  # over every panel
    assert [a.text for a in fig.layout.annotations] == ["step time (s)", "attempt 1: restarted without node-2"]
    assert not figures.overview_figure(metrics).layout.shapes
    cells = _cells(4, 10)
    lines = lambda f: [s.x0 for s in f.layout.shapes if s.name == "attempt 1"]  # noqa: E731
    assert lines(figures.heatmap_figure(cells, "forward", restarts=restarts)) == [6.5]  # between the columns of steps 6 and 7
    assert lines(figures.heatmap_figure(cells[cells["step"] >= 8], "forward", restarts=restarts)) == []  # not among the steps shown
    big = _cells(12_288, 10, pp=16)
    assert lines(figures.heatmap_figure(big, "forward", restarts=restarts)) == [5.5]  # an image: x is the column (step 7 is the 7th)


def test_the_actions_and_self_check_tables_put_failures_first():
    table = healing.actions_table(HEALED)
    assert table["action"].tolist() == ["incident", "evict", "restart", "resumed", "evict", "restart"]
    assert table.loc[1, "hosts"] == "node-2" and table.loc[1, "details"] == "incident inc-1"
    assert table.loc[3, "details"] == "at step 7, 2 steps lost, 40 s"
    assert table.loc[3, "hosts"] == "-" and table.loc[5, "reason"] == "-"
    checks = pd.DataFrame({
        "host": ["node-1", "node-1", "node-2", "node-2"], "time_ns": [T0] * 4, "check": ["matmul", "link_rtt:node-2"] * 2,
        "value": [41.5, 0.2, 3.25, float("nan")], "unit": ["GFLOP/s", "ms"] * 2, "reference": [3.25, float("nan"), 41.5, 0.2],
        "passed": [1, 1, 0, 0], "host_passed": [1, 1, 0, 0], "summary": ["ok", "ok", "2 of 2 checks failed", "2 of 2 checks failed"],
        "detail": ["", "", "", "no answer in 30 s"],
    })  # fmt: skip
    shown = healing.selfcheck_table(checks)
    assert shown[["host", "check", "passed"]].values.tolist()[:2] == [["node-2", "link_rtt:node-2", "❌"], ["node-2", "matmul", "❌"]]
    assert shown.loc[1, ["value", "peers' median"]].tolist() == ["3.25", "41.5"]
    assert shown.loc[0, "value"] == "-" and shown.loc[2, "peers' median"] == "-"  # not measured; no peer
    verdicts = healing.host_verdicts(checks)
    assert verdicts[["host", "passed", "failed"]].values.tolist() == [["node-2", False, ["link_rtt:node-2", "matmul"]], ["node-1", True, []]]
    assert healing.actions_table(_actions()).empty and healing.selfcheck_table(checks.head(0)).empty
    assert healing.evidence("{broken") == {} and healing.evidence("[1]") == {} and healing.evidence('{"a": 1}') == {"a": 1}


# --- timeline ---------------------------------------------------------------------------------


def _window() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    ms = 1_000_000
    spans = pd.DataFrame({
        "rank": [0, 0, 1, 1], "step": [3] * 4, "name": ["forward", "grad_sync", "forward", "grad_sync"],
        "kind": ["compute", "comm", "compute", "comm"], "microbatch": [0, -1, 0, -1],
        "start_ns": [T0, T0 + 10 * ms, T0, T0 + 30 * ms], "end_ns": [T0 + 10 * ms, T0 + 40 * ms, T0 + 30 * ms, T0 + 40 * ms],
    })  # fmt: skip
    ops = pd.DataFrame({
        "rank": [0, 1, 0, 1], "group_name": ["dp[0]", "dp[0]", "pp[0]", "pp[0]"], "seq": [7, 7, 3, 3],
        "op": ["all_reduce", "all_reduce", "send", "recv"], "peer": [-1, -1, 1, 0], "nbytes": [4096] * 4,
        "state": ["completed"] * 4, "step": [3] * 4,
        "issue_ns": [T0 + 10 * ms, T0 + 30 * ms, T0 + 41 * ms, T0 + 40 * ms],
        "start_ns": [T0 + 10 * ms, T0 + 30 * ms, T0 + 41 * ms, T0 + 40 * ms],
        "end_ns": [T0 + 40 * ms, T0 + 40 * ms, T0 + 45 * ms, 0],  # the receive never completed
    })  # fmt: skip
    who = pd.DataFrame({"rank": [0, 1], "host": ["node-0", "node-0"]})
    return spans, ops, who


def test_timeline_draws_lanes_with_webgl_traces_and_links_matched_operations():
    spans, ops, who = _window()
    fig = figures.timeline_figure(spans, ops, who, T0, T0 + 50_000_000)
    by_name = {t.name: t for t in fig.data}
    assert {t.type for t in fig.data} == {"scattergl"}
    assert {"compute spans", "comm spans", "dp collectives", "matched collectives", "sends", "receives", "send → receive"} <= set(by_name)
    # the dp all-reduce of both ranks is joined through their arrivals (10 ms and 30 ms)
    assert [x for x in by_name["matched collectives"].x if x is not None] == [10.0, 30.0]
    # the send from rank 0 reaches rank 1's receive, which never completed: drawn to the window's end
    assert [x for x in by_name["send → receive"].x if x is not None] == [41.0, 50.0]
    assert list(fig.layout.yaxis.ticktext) == ["rank 0 (node-0)", "rank 1 (node-0)"]


def test_timeline_links_only_operations_of_one_attempt():
    """A restart numbers collectives anew: dp[0] #7 of attempt 0 and of attempt 1 are different operations."""
    spans, ops, who = _window()
    ops = ops.assign(attempt=[0, 1, 1, 1])
    by_name = {t.name: t for t in figures.timeline_figure(spans, ops, who, T0, T0 + 50_000_000).data}
    assert "matched collectives" not in by_name
    assert [x for x in by_name["send → receive"].x if x is not None] == [41.0, 50.0]
    events = json.loads(export.to_json(export.chrome_trace(spans, ops, who, "run-1", T0, T0 + 50_000_000)))["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "s"} == {"pp[0] #3"}


# --- the 3D-parallel graph and rank states ----------------------------------------------------


def _beats(**columns: list) -> pd.DataFrame:
    n = len(columns["rank"])
    base = {
        "host": ["node-0"] * n, "pid": [100] * n, "device": ["cpu"] * n, "tp": [0] * n, "pp": [0] * n, "dp": [0] * n,
        "beat_ns": [T0] * n, "step": [5] * n, "phase": ["forward"] * n, "beat_status": ["running"] * n,
        "wait_group": [""] * n, "wait_seq": [0] * n, "wait_op": [""] * n, "in_flight": [""] * n,
        "exit_ns": [0] * n, "exit_reason": [""] * n, "exit_code": [0] * n, "exit_signal": [0] * n, "exit_message": [""] * n,
    }  # fmt: skip
    return pd.DataFrame({**base, **columns})


def test_classify_names_each_state_by_its_rule():
    rows = _beats(
        rank=[0, 1, 2, 3, 4, 5, 6, 7, 8],
        beat_ns=[T0, T0, T0, T0 - 60 * 10**9, T0, T0, 0, T0, T0],
        beat_status=["running", "running", "running", "running", "stalled", "running", "running", "running", "running"],
        wait_group=["", "dp[3]", "", "", "", "", "", "", ""],
        wait_seq=[0, 812, 0, 0, 0, 0, 0, 0, 0],
        wait_op=["", "all_reduce", "", "", "", "", "", "", ""],
        exit_reason=["", "", "exception", "", "", "", "", "normal", ""],
        exit_message=["", "", "RuntimeError: boom", "", "", "", "", "", ""],
    )
    out = states.classify(rows, at_ns=T0 + 10**9, stragglers=[5], roots=[8]).set_index("rank")
    assert out["state"].to_dict() == {
        0: "computing", 1: "waiting", 2: "crashed", 3: "silent", 4: "blocked", 5: "straggler", 6: "not started",
        7: "finished", 8: "blocked",
    }
    assert out.loc[1, "detail"] == "waiting in all_reduce dp[3] #812"
    assert "RuntimeError: boom" in out.loc[2, "detail"]
    assert out.loc[8, "detail"].startswith("hang root")
    assert states.worst(out["state"]) == "crashed"


def test_active_incidents_are_those_begun_and_not_long_over():
    def incident(first: int, last: int, status: str) -> Incident:
        finding = Finding("hang", "hang", "critical", (1,), ("node-0",), first, last, "hang: rank 1")
        return Incident("run", finding, status, 1)

    closed = incident(T0, T0 + 10**9, "closed")
    assert states.active_incidents([closed], "hang", T0 + 2 * 10**9) == [closed]  # within the grace time
    assert states.active_incidents([closed], "hang", T0 + 10**12) == []
    assert states.active_incidents([closed], "hang", T0 - 1) == []  # not begun yet
    assert states.active_incidents([closed], "straggler", T0 + 1) == []


def test_graph_places_ranks_by_coordinates_with_an_edge_per_neighbour_and_rings_the_root():
    coords = [(t, p, d) for p in range(2) for d in range(2) for t in range(2)]  # Megatron's order
    rows = _beats(rank=list(range(8)), tp=[c[0] for c in coords], pp=[c[1] for c in coords], dp=[c[2] for c in coords],
                  host=[f"node-{r // 2}" for r in range(8)])  # fmt: skip
    ranked = states.classify(rows, T0, roots=[1])
    fig = figures.graph_figure(ranked, tp_size=2, roots=[1], root_hosts=["node-0"])
    by_name = {t.name: t for t in fig.data}
    segments = lambda name: sum(1 for x in by_name[name].x if x is None)  # noqa: E731
    assert (segments("tp group"), segments("pipeline neighbours"), segments("dp group")) == (4, 4, 4)
    assert list(by_name["hang root"].x) == [1.0]
    assert list(by_name["host of the hang's root"].x) == [0.0]  # rank 0 shares node-0 with the root
    assert any("hang root: rank 1 (node-0)" in a.text for a in fig.layout.annotations)
    hosts = figures.host_states(ranked)
    assert hosts.set_index("host").loc["node-0", "state"] == "blocked"
    by_host = {t.name: t for t in figures.host_graph_figure(hosts, ["node-0"]).data}
    assert list(by_host["blocked"].hovertext) == ["node-0 (2 ranks): 1 blocked, 1 computing"]
    assert len(by_host["computing"].x) == 3
    ring = by_host["host of the hang's root"]
    assert (list(ring.x), list(ring.y)) == (list(by_host["blocked"].x), list(by_host["blocked"].y))  # around node-0's square
    by_stage = {t.name: dict(zip(t.x, t.y)) for t in figures.stage_states_figure(ranked).data}
    assert by_stage == {"blocked": {"stage 0": 1}, "computing": {"stage 0": 3, "stage 1": 4}}


# --- hosts ------------------------------------------------------------------------------------


def test_host_figure_puts_the_events_strip_first_and_a_panel_per_metric():
    series = pd.DataFrame({"name": ["hw.temperature"] * 2 + ["system.cpu.utilization"] * 2, "device": ["cuda:0", "cuda:0", "host", "host"],
                           "time_ns": [T0, T0 + 10**9] * 2, "value": [70.0, 88.0, 0.5, 0.9]})  # fmt: skip
    events = pd.DataFrame({"name": ["hw.gpu.throttle.hw_thermal"], "device": ["cuda:0"], "time_ns": [T0 + 10**9], "peak": [1.0]})
    panels = (("hw.temperature", "GPU temperature (°C)", False), ("hw.power", "GPU power (W)", False),
              ("system.cpu.utilization", "host CPU utilisation", False))  # fmt: skip
    fig = figures.host_figure(series, events, panels)
    assert [a.text for a in fig.layout.annotations] == ["events (throttling, ECC, Xid)", "GPU temperature (°C)", "host CPU utilisation"]
    assert list(fig.data[0].y) == ["throttle.hw_thermal · cuda:0"]


# --- Perfetto export --------------------------------------------------------------------------


def test_chrome_trace_has_a_process_per_rank_a_track_per_stream_and_flows_for_matched_operations():
    spans, ops, who = _window()
    # a second dp all-reduce on rank 0 overlapping the first without nesting: it needs a track of its own
    extra = ops.iloc[[0]].assign(seq=8, issue_ns=T0 + 20_000_000, start_ns=T0 + 20_000_000, end_ns=T0 + 48_000_000)
    trace = export.chrome_trace(spans, pd.concat([ops, extra]), who, "run-1", T0, T0 + 50_000_000)
    events = json.loads(export.to_json(trace))["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0 (node-0)"), (1, "rank 1 (node-0)")}
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(0, "segments"), (0, "communication"), (0, "dp[0]"), (0, "dp[0] (2)"), (0, "pp[0]"), (1, "pp[0]")} <= tracks
    _assert_nested(events)
    flows = [e for e in events if e["ph"] in ("s", "f")]
    by_id: dict[int, dict[str, dict]] = {}
    for e in flows:
        by_id.setdefault(e["id"], {})[e["ph"]] = e
    assert all(set(pair) == {"s", "f"} and pair["f"]["bp"] == "e" for pair in by_id.values())
    arrows = {(p["s"]["name"], p["s"]["pid"], p["f"]["pid"]) for p in by_id.values()}
    # the all-reduce: from rank 1, which arrived last, to rank 0; the transfer: send (rank 0) -> receive (rank 1)
    assert arrows == {("dp[0] #7", 1, 0), ("pp[0] #3", 0, 1)}


def _assert_nested(events: list[dict]) -> None:
    """Slices on one track never overlap without nesting (Perfetto's rule)."""
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for slices in tracks.values():
        open_ends: list[float] = []
        for start, end in sorted(slices):
            open_ends = [x for x in open_ends if x > start]
            assert all(end <= x for x in open_ends), f"overlapping slices {slices}"
            open_ends.append(end)


# --- SQL cookbook and the data source ---------------------------------------------------------


def test_cookbook_placeholders_become_typed_values():
    sql = cookbook.EXAMPLES[1].sql
    assert cookbook.placeholders(sql) == {"run": "String", "group": "String", "seq": "Int64"}
    assert cookbook.value("812", "Int64") == 812
    assert cookbook.value("[1, 5]", "Array(UInt32)") == [1, 5]
    assert cookbook.value("dp[3]", "String") == "dp[3]"
    with pytest.raises(ValueError):
        cookbook.value("twelve", "UInt32")


def test_the_source_travels_in_the_environment_and_never_shows_a_password():
    chosen = Source(clickhouse="http://me:secret@db.example:8123/rankscope")
    assert Source.from_env({SOURCE_VARIABLE: chosen.to_env()}) == chosen
    assert "secret" not in chosen.describe() and "db.example:8123" in chosen.describe()
    assert Source.from_env({}).describe() == "collector at 127.0.0.1:7777"


# --- step anatomy -----------------------------------------------------------------------------


def test_the_anatomy_figure_stacks_the_categories_in_order_and_marks_the_path_step():
    frame = pd.DataFrame({
        "step": [1, 2, 1, 2, 1, 2], "category": ["unexplained", "unexplained", "compute", "compute", "bubble", "bubble"],
        "ms": [5.0, 6.0, 100.0, 120.0, 20.0, 25.0],
    })  # fmt: skip
    fig = figures.anatomy_figure(frame, ("compute", "optimizer", "bubble", "unexplained"), marked_step=2)
    assert [t.name for t in fig.data] == ["compute", "pipeline bubble", "unexplained"]  # stacking order, absent ones left out
    assert all(t.stackgroup == "steps" for t in fig.data)
    assert list(fig.data[0].y) == [100.0, 120.0] and list(fig.data[1].x) == [1, 2]
    assert [s.x0 for s in fig.layout.shapes] == [2]
    assert not figures.anatomy_figure(frame, ("compute",)).layout.shapes


def _path() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """A step's path: rank 2 computes, waits in an all-reduce for rank 3, the path moves to rank 3's backward."""
    links = pd.DataFrame({
        "rank": [3, 3, 2], "what": ["forward", "backward", "all_reduce dp[1] #4"], "kind": ["compute", "compute", "collective"],
        "start_ns": [T0, T0 + 100 * 10**6, T0 + 400 * 10**6], "end_ns": [T0 + 100 * 10**6, T0 + 400 * 10**6, T0 + 420 * 10**6],
        "waited_on": [None, None, 3],
    })  # fmt: skip
    spans = pd.DataFrame({"rank": [2, 3], "step": [4, 4], "name": ["backward", "backward"], "kind": ["compute", "compute"],
                          "microbatch": [0, 0], "start_ns": [T0, T0 + 100 * 10**6], "end_ns": [T0 + 300 * 10**6, T0 + 400 * 10**6]})  # fmt: skip
    who = pd.DataFrame({"rank": [2, 3], "host": ["node-1", "node-1"]})
    return links, spans, who


def test_the_critical_path_is_drawn_over_the_timeline_with_a_line_where_it_changes_rank():
    links, spans, who = _path()
    ops = pd.DataFrame(columns=["rank", "group_name", "seq", "op", "peer", "nbytes", "state", "step", "attempt", "issue_ns", "start_ns", "end_ns"])
    fig = figures.critical_path_figure(links, spans, ops, who, T0, T0 + 420 * 10**6)
    traces = {t.name: t for t in fig.data}
    assert "compute spans" in traces  # the timeline underneath
    path = traces["critical path"]
    assert [x for x in path.x if x is not None] == [0, 100, 100, 400, 400, 420]
    lanes = {y for y in path.y if y is not None}
    assert len(lanes) == 2  # rank 3's lane, then rank 2's
    moves = traces["path moves to the rank waited on"]
    assert [x for x in moves.x if x is not None] == [400, 400]
    assert "waited on rank 3" in path.hovertext[6]
    # links on ranks without a lane are left out, not drawn at a made-up place
    fig = figures.critical_path_figure(links, spans, ops, who[who["rank"] == 3], T0, T0 + 420 * 10**6)
    names = [t.name for t in fig.data]
    assert "path moves to the rank waited on" not in names and len([x for x in fig.data[names.index("critical path")].x if x is not None]) == 4


def test_the_contributions_figure_puts_the_largest_on_top_coloured_by_what_it_is():
    contributions = pd.DataFrame({
        "label": ["rank 5 backward", "dp[1] all_reduce", "backward on every rank of stage 0"], "level": ["rank", "group", "stage"],
        "diff_s": [0.18, 0.025, -0.004], "share": [0.85, 0.12, None],
    })  # fmt: skip
    bar = figures.contributions_figure(contributions).data[0]
    assert list(bar.y) == ["backward on every rank of stage 0", "dp[1] all_reduce", "rank 5 backward"]  # the first at the top
    assert list(bar.x) == pytest.approx([-4.0, 25.0, 180.0])
    assert list(bar.marker.color) == [figures.LEVEL_COLOURS["stage"], figures.LEVEL_COLOURS["group"], figures.LEVEL_COLOURS["rank"]]
    assert bar.hovertext[-1] == "rank 5 backward: +180.0 ms (85% of the difference)" and bar.hovertext[0].endswith("-4.0 ms")
    assert len(figures.contributions_figure(contributions, top=2).data[0].y) == 2
