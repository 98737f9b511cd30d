"""The dashboard on a real recorded run: an 8-rank training run with rank 5 made 1.5x slower.

One run is recorded for the whole session (``straggler_run`` in conftest.py: a real collector,
``rankscope train`` with the agent on; test_diagnosis_scenarios.py scores the same run). Then:

- a collector (``--no-diagnosis``: the incidents stay as the live diagnosis wrote them) serves the
  store, and AppTest runs every page in this process reading through it, as the dashboard does by
  default;
- ``rankscope dashboard --store`` serves a copy of the store (chDB lets one process hold a store
  directory, and the collector holds the original) to Debian's chromium driven by Playwright,
  which opens every page, checks what a person looks for, downloads the trace and saves
  screenshots under test-artifacts/dashboard/.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs

import numpy as np
import pytest

from conftest import free_port, start_collector
from dashboard_pages import PAGES, array, open_page, page_text, read_from
from streamlit.testing.v1 import AppTest

from rankscope.harness import local_scenarios as scenarios
from rankscope.dashboard import connection, cookbook, data, export
from rankscope.dashboard.connection import Source

pytestmark = [pytest.mark.slow, pytest.mark.foreground]  # the session's straggler run: made in the foreground lane

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]  # fmt: skip
STRAGGLER = "rank 5 (node-2)"


@pytest.fixture(scope="module")
def recorded(straggler_run: tuple[Path, scenarios.Score]) -> tuple[str, Path, Path, scenarios.Score, str]:
    """(run id, store, a copy of the store, the diagnosis's score, what to read if the live diagnosis
    missed the straggler) of the session's real straggler run (conftest.py)."""
    workdir, score = straggler_run
    copy = workdir / "store-copy"
    shutil.copytree(workdir / "store", copy, symlinks=True)  # chDB links tables into store/ with relative symlinks
    return score.run_id, workdir / "store", copy, score, "" if score.passed else _why_missed(workdir, copy, score.run_id)


def _why_missed(workdir: Path, store: Path, run_id: str) -> str:
    """The end of the collector's log (its incidents and warnings) and the offline diagnosis of the
    whole run (read before anything holds the copy)."""
    offline = subprocess.run([sys.executable, "-m", "rankscope.cli.main", "diagnose", "--store", str(store), "--run", run_id],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    log = (workdir / "collector.log").read_text(errors="replace").splitlines()[-30:]
    return "\n".join(["offline diagnosis:", offline.stdout[-3000:], offline.stderr[-2000:], "end of the collector's log:", *log])


def _diagnosed(recorded: tuple[str, Path, Path, scenarios.Score, str]) -> str:
    """The id of the incident naming rank 5: the pages that show incidents need the live diagnosis to have found it."""
    score = recorded[3]
    found = [i["incident_id"] for i in score.expected if 5 in i["ranks"]]
    assert found, f"the live diagnosis (not the dashboard) missed rank 5: {score.line()}\n{recorded[4]}"
    return found[0]


@pytest.fixture(scope="module")
def collector(recorded: tuple[str, Path, Path], module_runner) -> str:
    """The address of a collector serving the recorded store."""
    return start_collector(module_runner, recorded[1], "--no-diagnosis", timeout=60).target


@pytest.fixture(scope="module")
def reading(collector: str) -> Iterator[str]:
    """Point in-process pages at the collector; undo what running the app does to this process."""
    with pytest.MonkeyPatch.context() as mp:
        read_from(mp, Source(collector=collector))
        yield collector
        connection.reset()


def _figure(at: AppTest, index: int = 0) -> dict:
    return json.loads(at.get("plotly_chart")[index].proto.spec)


def _links(at: AppTest) -> list[tuple[str, str]]:
    """(page file, query string) of every page link."""
    return [(e.proto.page, e.proto.query_string) for e in at.get("page_link")]


# --- AppTest, page by page --------------------------------------------------------------------


def test_runs_lists_the_run_with_status_shape_and_steps(recorded, reading):
    run_id = recorded[0]
    text = page_text(open_page("runs"))
    row = next(line for line in text.splitlines() if run_id in line and "|" in line)
    assert "finished" in row and "2 × 2 × 2" in row and "| 14 |" in row
    assert f"(./?run={run_id})" in row  # a link that opens the run (the run lives in the URL)


def test_overview_names_the_run_its_incidents_and_draws_the_training_curves(recorded, reading):
    _diagnosed(recorded)
    run_id = recorded[0]
    at = open_page("overview")
    text = page_text(at)
    assert f"Run **{run_id}**" in text and "finished" in text and "refreshing live" not in text
    assert STRAGGLER in text and "slower" in text  # the closed straggler incident, in words
    panels = [a["text"] for a in _figure(at)["layout"]["annotations"]]
    assert panels[:2] == ["step time (s)", "tokens/s"] and "loss" in panels
    assert "MFU is not reported" in text  # a CPU run has no peak FLOP/s
    assert any(Path(page).stem == "heatmap" and "segment=" in query for page, query in _links(at))


def test_heatmap_names_the_injected_straggler_and_outlines_it(recorded, reading):
    at = open_page("heatmap", run=recorded[0])
    text = page_text(at)
    assert f"Slowest against its stage: {STRAGGLER}, stage 1" in text
    assert "CPU time" in text
    fig = _figure(at)
    heat = fig["data"][0]
    assert heat["type"] == "heatmap" and len(heat["y"]) == 8
    row = heat["y"].index("rank 5 · node-2 · stage 1")
    assert any(s["type"] == "rect" and s["y0"] == row - 0.5 for s in fig["layout"]["shapes"])
    ratios, steps = array(heat["z"])[row], array(heat["x"])
    assert np.nanmedian(ratios[steps >= 5]) > 1.1, "rank 5's backward is slower than its stage's median from step 5"
    timeline = [parse_qs(query) for path, query in _links(at) if Path(path).stem == "timeline"]
    assert any("5" in q.get("ranks", [""])[0].split(",") for q in timeline), timeline


def test_timeline_draws_the_window_and_names_the_last_rank_to_arrive(recorded, reading):
    at = open_page("timeline", run=recorded[0], ranks="4,5,6,7", **{"from": "8", "to": "8"})
    text = page_text(at)
    assert "Steps **8-8**, 4 ranks" in text
    assert "arrived last" in text and "last to arrive" in text
    traces = _figure(at)["data"]
    assert {t["type"] for t in traces} == {"scattergl"}
    assert {"compute spans", "tp collectives", "matched collectives", "sends", "receives"} <= {t["name"] for t in traces}
    assert [b.label for b in at.get("download_button")] == ["Download trace (Perfetto / Chrome JSON)"]


def test_graph_shows_every_rank_by_state_and_marks_the_straggler(recorded, reading):
    incident_id = _diagnosed(recorded)
    run_id = recorded[0]
    run = next(r for r in data.runs() if r.id == run_id)
    # a moment inside the incident: the episode of slow steps it reports may begin late in a run on a loaded machine
    found = next(i.finding for i in data.incidents(run) if i.incident_id == incident_id)
    at = open_page("graph", run=run_id, at=str((found.first_seen_ns + found.last_seen_ns) // 2))
    assert "computing" in next(m.value for m in at.markdown if m.value.startswith("At **"))  # the states, counted in words
    assert STRAGGLER in at.warning[0].value and "Straggler" in at.warning[0].value
    fig = _figure(at)
    ranks = {int(label) for t in fig["data"] if t.get("mode") == "markers+text" for label in t["text"]}
    assert ranks == set(range(8))
    assert {"tp group", "pipeline neighbours", "dp group"} <= {t["name"] for t in fig["data"]}


def test_hosts_lists_every_host_and_plots_the_one_reporting(recorded, reading):
    at = open_page("hosts", run=recorded[0])
    hosts = at.table[0].value["host"].tolist()
    assert hosts == ["node-0", "node-1", "node-2", "node-3"]
    panels = [a["text"] for a in _figure(at)["layout"]["annotations"]]
    assert "host CPU utilisation" in panels
    assert "reported no GPU metrics" in page_text(at)


def test_incidents_show_summary_evidence_sql_and_links_to_the_moment(recorded, reading):
    incident = _diagnosed(recorded)
    run_id = recorded[0]
    at = open_page("incidents", run=run_id, incident=incident)
    text = page_text(at)
    assert next(s for s in at.selectbox if s.label == "Incident").value == incident
    assert STRAGGLER in text and "slower" in text
    assert "FROM step_segments" in at.code[0].value and run_id in at.code[0].value
    assert "segment" in at.json[0].value
    pages = {Path(page).stem for page, _ in _links(at)}
    assert {"heatmap", "timeline", "graph", "sql"} <= pages
    assert all(f"run={run_id}" in query for _, query in _links(at))


def test_sql_console_runs_a_cookbook_query_and_offers_csv(recorded, reading):
    at = open_page("sql", run=recorded[0])
    at.selectbox(key="sql_example").select("Slowest ranks per step").run()
    at.button[0].click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    result = at.dataframe[0].value
    assert list(result.columns) == ["step", "rank", "host", "stage", "compute_ms", "vs_stage_median"]
    assert len(result) == 3 * 14
    assert [b.label for b in at.get("download_button")] == ["Download CSV"]


def test_every_cookbook_query_runs_on_the_recorded_run(recorded, reading):
    run = next(r for r in data.runs() if r.id == recorded[0])
    group, seq = data.latest_collective(run)
    values = {"run": run.id, "group": group, "seq": seq, "host": "node-0"}
    # a CPU run has no GPU; whether it has incidents is the diagnosis's business
    may_be_empty = {"GPU temperature of one host", "Incidents of the run"}
    for example in cookbook.EXAMPLES:
        params = {name: values[name] for name in cookbook.placeholders(example.sql)}
        rows = connection.query(example.sql, params)
        assert example.title in may_be_empty or len(rows), example.title


def test_a_refused_statement_is_a_message(recorded, reading):
    at = open_page("sql", run=recorded[0])
    at.text_area(key="sql_text").input("DROP TABLE spans").run()
    at.button[0].click().run()
    assert not at.exception
    assert "only read statements are accepted" in at.error[0].value


def test_an_unknown_run_or_a_malformed_parameter_is_a_message(recorded, reading):
    at = open_page("heatmap", run="no-such-run")
    assert "There is no run 'no-such-run'" in at.error[0].value
    at = open_page("graph", run=recorded[0], at="yesterday")
    assert "Ignoring ?at='yesterday'" in page_text(at)


def test_every_page_redraws_within_a_second_once_cached(recorded, reading):
    for name in PAGES:
        at = open_page(name, run=recorded[0])
        started = time.perf_counter()
        at.run()
        elapsed = time.perf_counter() - started
        assert not at.exception
        assert elapsed < 1.0, f"{name} took {elapsed:.2f} s"


def test_the_exported_trace_is_chrome_json_with_processes_tracks_and_flows(recorded, reading):
    run = next(r for r in data.runs() if r.id == recorded[0])
    who = data.ranks(run)
    start, end = data.window(run, 6, 6)
    ranks = tuple(range(8))
    trace = json.loads(export.to_json(export.chrome_trace(data.spans(run, ranks, start, end), data.operations(run, ranks, start, end),
                                                          who, run.id, start, end)))  # fmt: skip
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X", "s", "f"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes[5] == "rank 5 (node-2)" and len(processes) == 8
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == 5}
    assert {"segments", "communication", "tp[2]", "dp[3]", "pp[1]"} <= tracks
    flows: dict[int, set[str]] = {}
    for e in events:
        if e["ph"] in ("s", "f"):
            flows.setdefault(e["id"], set()).add(e["ph"])
    assert len(flows) > 50 and all(phases == {"s", "f"} for phases in flows.values())
    assert all(e.get("dur", 0) >= 0 and e["ts"] >= 0 for e in events if e["ph"] in ("X", "s", "f"))


# --- a real browser ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(recorded, module_runner) -> str:
    """``rankscope dashboard --store`` on the copy of the store; its base URL."""
    port = free_port()
    proc = module_runner.start([sys.executable, "-m", "rankscope.cli.main", "dashboard", "--store", str(recorded[2]), "--port", str(port)],
                               name="dashboard")  # fmt: skip
    proc.wait_for(f"http://127.0.0.1:{port}/", timeout=30)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"{base}/_stcore/health", timeout=2).read() == b"ok":
                return base
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"the dashboard never answered /_stcore/health\n{proc.output()}")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not CHROMIUM.exists():
        pytest.skip("/usr/bin/chromium is missing (make browser installs it): browser tests skipped")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


#: page -> (URL path, text that must show, whether it draws a figure)
BROWSER_PAGES = {
    "runs": ("runs", "newest first", False),
    "overview": ("", "step time", True),
    "heatmap": ("heatmap", f"Slowest against its stage: {STRAGGLER}", True),
    "timeline": ("timeline", "Arrival skew", True),
    "graph": ("graph", "Ranks not simply computing", True),
    "hosts": ("hosts", "node-3", True),
    "incidents": ("incidents", re.compile(re.escape(STRAGGLER) + ": .* slower than its stage peers"), False),
    "sql": ("sql", "The three ranks per step whose compute took longest", False),
}


@pytest.mark.parametrize("name", list(BROWSER_PAGES))
def test_every_page_in_a_real_browser(name, recorded, served, browser):
    path, expected, has_figure = BROWSER_PAGES[name]
    if name == "incidents":
        _diagnosed(recorded)  # the page must list the straggler incident, so the live diagnosis must have found it
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{served}/{path}?run={recorded[0]}")
        page.wait_for_selector("[data-testid='stAppViewContainer']", timeout=60_000)
        page.get_by_text(expected).first.wait_for(timeout=60_000)
        if has_figure:
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
        page.wait_for_timeout(500)
        assert page.locator("[data-testid='stException']").count() == 0
        assert recorded[0] in page.inner_text("body")
    finally:  # the screenshot shows what went wrong, too
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
        page.close()


def test_a_click_on_the_heatmap_opens_the_timeline_of_that_rank_and_step(recorded, served, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{served}/heatmap?run={recorded[0]}&segment=backward")
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
        page.wait_for_timeout(1000)
        plot = page.locator(".js-plotly-plot .nsewdrag").first.bounding_box()
        # rows are ranks 0-7, columns steps 1-14: the middle of rank 5's row at step 8
        page.mouse.click(plot["x"] + plot["width"] * 7.5 / 14, plot["y"] + plot["height"] * 5.5 / 8)
        page.wait_for_url("**/timeline?**", timeout=60_000)
        page.get_by_text("Steps 8-8").first.wait_for(timeout=60_000)
        assert "ranks=4%2C5%2C6%2C7" in page.url or "ranks=4,5,6,7" in page.url
    finally:
        page.close()


def test_download_trace_in_the_browser(recorded, served, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{served}/timeline?run={recorded[0]}&from=6&to=6&ranks=4,5")
        button = page.get_by_role("button", name="Download trace")
        button.wait_for(timeout=60_000)
        with page.expect_download(timeout=60_000) as download:
            button.click()
        trace = json.loads(Path(download.value.path()).read_text())
    finally:
        page.close()
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 4 (node-2)", "rank 5 (node-2)"}
    assert trace["otherData"]["run_id"] == recorded[0]
