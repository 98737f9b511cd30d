"""Step anatomy: where the step time goes, step by step (compute, optimizer, data, pipeline bubble, exposed
communication, unexplained); the critical path of one step drawn on the timeline of the ranks it runs
through; and what makes this run, or a stretch of its steps, slower or faster than another (the
ranked contributions of ``rankscope compare``)."""

from typing import Any

import pandas as pd
import streamlit as st

from rankscope.collector.compare import CompareError
from rankscope.dashboard import data, figures, ui
from rankscope.dashboard.data import Run

#: steps shown at first (the newest ones); the slider widens the window up to MAX_STEPS
DEFAULT_STEPS = 50
MAX_STEPS = 200
#: lanes of the critical path's timeline: the ranks the path spends most time on
MAX_LANES = 16
#: rows of the comparison's tables
LISTED = 12
#: the first steps carry start-up costs: the comparison of two ranges of one run starts after them
WARMUP_STEPS = 2

NO_CORE = ("The critical path is not available in this build: it comes from the step-anatomy core "
           "(rankscope.collector.anatomy), which is not installed here.")  # fmt: skip


def body(run: Run) -> None:
    ui.run_header(run, "Step anatomy")
    segments = data.segments(run)
    if segments.empty:
        st.info("No spans recorded for this run yet: there is no step to take apart.")
        return
    last_step = max(run.steps, int(segments["last_step"].max()), 1)
    first, last = max(1, last_step - DEFAULT_STEPS + 1), last_step
    if last_step > 1:
        first, last = st.slider("Steps", 1, last_step, (first, last), help=f"at most {MAX_STEPS} steps at once", key="anatomy_steps")
        first = max(first, last - MAX_STEPS + 1)
    found = data.anatomy_steps(run, first, last)
    step = _chosen_step(run, found, first, last)
    ui.guarded(_breakdown, found, first, last, step)
    ui.guarded(_critical_path, run, step)
    ui.guarded(_comparison, run, last_step)


def _chosen_step(run: Run, found: dict[str, Any], first: int, last: int) -> int:
    """The step whose critical path is drawn: ?step=, else the range's median step (by its slowest rank),
    else its newest complete step."""
    wanted = ui.int_param("step")
    default = wanted if wanted is not None and first <= wanted <= last else found.get("median_step")
    if default is None or not first <= default <= last:
        default = max(first, last - 1 if run.live else last)
    return int(st.number_input("Step of the critical path", min_value=first, max_value=last, value=int(default), step=1, key="anatomy_step",
                               help="the median step of the range (by its slowest rank) unless you pick another"))  # fmt: skip


def _breakdown(found: dict[str, Any], first: int, last: int, step: int) -> None:
    st.subheader("Where the step time goes")
    frame = found["frame"]
    if frame.empty:
        st.info(f"No step of {first}-{last} has been taken apart yet (no spans, or no step completed).")
        return
    total = {c: v for c, v in found["total"].items() if v and v > 0}
    whole = sum(total.values())
    if whole > 0:
        parts = " · ".join(f"{figures.category_label(c)} {v / whole:.0%}" for c, v in sorted(total.items(), key=lambda kv: -kv[1]))
        st.markdown(f"Steps **{first}-{last}**, the mean rank's step: {whole:,.1f} ms: {parts}.")
    st.plotly_chart(figures.anatomy_figure(frame, found["categories"], step), key="anatomy_breakdown")
    if found["source"] == "anatomy":
        st.caption("Each moment of a rank's step counts once, for the first of: compute, optimizer, data loading, pipeline bubble "
                   "(a stage exchanging with or waiting for its neighbour, with no work of its own), exposed communication (a "
                   "collective that no work overlaps), and unexplained (what no span covers). The mean over ranks; the dotted "
                   "line marks the step whose critical path is drawn below.")  # fmt: skip
    else:
        st.caption("The step-anatomy core (rankscope.collector.anatomy) is not in this build: each kind of span's time per step "
                   "(the mean over ranks; communication includes waiting for other ranks), and unexplained is the rest of the "
                   "step time.")  # fmt: skip


def _critical_path(run: Run, step: int) -> None:
    st.subheader(f"Critical path of step {step}")
    path = data.critical_path(run, step)
    if path is not None and not path.get("available", True):
        st.info(NO_CORE)
        return
    if path is None:
        st.info(f"No spans recorded in step {step}: there is no path to draw.")
        return
    links, costs = path["links"], path["costs"]
    hosts = ui.hosts_of(run)
    on_path = (links["end_ns"] - links["start_ns"]).groupby(links["rank"]).sum().sort_values(ascending=False)
    lanes = sorted(int(r) for r in on_path.index[:MAX_LANES])
    text = (f"Step **{step}** took **{path['step_ms']:,.1f} ms** along its critical path: {len(links)} links through "
            f"{len(on_path)} rank{'s' if len(on_path) != 1 else ''}.")  # fmt: skip
    if len(costs):
        top = costs.iloc[0]
        text += (f" The costliest: **{ui.who(int(top['rank']), hosts)} {ui.escape(top['link'])}**, {top['cost_ms']:,.1f} ms more than "
                 f"its peers ({top['share']:.0%} of the step); without it the step would take about {path['without_slowest_ms']:,.1f} ms.")  # fmt: skip
    st.markdown(text)
    who = data.ranks(run)
    who = who[who["rank"].isin(lanes)].sort_values("rank")
    ranks = tuple(int(r) for r in who["rank"])
    start_ns, end_ns = int(path["start_ns"]), int(path["end_ns"])
    spans = data.spans(run, ranks, start_ns, end_ns)
    ops = data.operations(run, ranks, start_ns, end_ns)
    st.plotly_chart(figures.critical_path_figure(links, spans, ops, who, start_ns, end_ns), key="anatomy_path")
    more = f" (the {MAX_LANES} ranks it spends most time on, of {len(on_path)})" if len(on_path) > MAX_LANES else ""
    st.caption(f"The black bars are the path, rank by rank{more}; a dashed line is where it moves to the rank that was waited on.")
    if len(costs):
        rows = costs.head(LISTED).assign(
            rank=lambda c: c["rank"].map(lambda r: ui.who(int(r), hosts)),
            **{"on the path (ms)": lambda c: c["on_path_ms"].map("{:,.1f}".format),
               "cost (ms)": lambda c: c["cost_ms"].map("{:,.1f}".format), "share of the step": lambda c: c["share"].map("{:.0%}".format)},
        )[["rank", "link", "kind", "on the path (ms)", "cost (ms)", "share of the step"]]  # fmt: skip
        ui.table(rows, "What each link costs the step: how much shorter it would be if that link were as fast as on its peers.")


def _comparison(run: Run, last_step: int) -> None:
    st.subheader("Compared with")
    mode = st.radio("Compare this run with", ["another run", "other steps of this run"], horizontal=True, key="anatomy_mode",
                    index=1 if ui.param("against") == run.id else 0)  # fmt: skip
    try:
        if mode == "another run":
            others = [r.id for r in data.runs() if r.id != run.id]
            wanted = ui.param("against")
            options = ["", *others, *([wanted] if wanted and wanted not in others and wanted != run.id else [])]
            baseline = st.selectbox("Baseline run (A); this run is B", options, index=options.index(wanted) if wanted in options else 0,
                                    format_func=lambda r: r or "pick a run", key="anatomy_baseline")  # fmt: skip
            if not baseline:
                st.caption("Pick a run to compare with: the segments, ranks and groups that account for the difference in step time "
                           "are listed, largest first (as `rankscope compare` prints them).")  # fmt: skip
                return
            result = data.comparison(run, baseline, None, None)
        else:
            if last_step < 2:
                st.info("This run has a single step so far: there is nothing to compare it with.")
                return
            start = min(WARMUP_STEPS + 1, last_step - 1)
            middle = start + (last_step - start) // 2
            left, right = st.columns(2)
            a = left.slider("Baseline steps (A)", 1, last_step, (start, max(start, middle)), key="anatomy_a")
            b = right.slider("Steps compared (B)", 1, last_step, (min(middle + 1, last_step), last_step), key="anatomy_b")
            result = data.comparison(run, run.id, a, b)
    except CompareError as e:
        st.warning(f"Cannot compare: {e}")
        return
    _contributions(result)


def _contributions(result: dict[str, Any]) -> None:
    a, b = result["a"], result["b"]
    st.markdown(f"**{ui.escape(result['summary'])}**")
    st.caption(f"A: run {ui.escape(a['run'])}, steps {a['first_step']}-{a['last_step']}, {a['step_time_s'] * 1e3:,.1f} ms per step · "
               f"B: run {ui.escape(b['run'])}, steps {b['first_step']}-{b['last_step']}, {b['step_time_s'] * 1e3:,.1f} ms per step · "
               f"{ui.escape(result['matching']['note'])}")  # fmt: skip
    causes = pd.DataFrame(result["contributions"], columns=["label", "level", "a_s", "b_s", "diff_s", "share"])
    if causes.empty:
        st.info("Nothing to compare: the two sides share no segment, rank or group.")
        return
    st.plotly_chart(figures.contributions_figure(causes, LISTED), key="anatomy_contributions")
    ui.table(_rows(causes.head(LISTED), "contribution"),
             "What accounts for the difference, largest first, each as a share of the step-time difference (they overlap: "
             "they need not add up to 100%). A rank's change is what it changed beyond its pipeline stage.")  # fmt: skip
    waits = pd.DataFrame(result["waits"], columns=["label", "level", "a_s", "b_s", "diff_s", "share"])
    moved = waits[waits["diff_s"].abs() > 0]
    if len(moved):
        ui.table(_rows(moved.head(LISTED), "wait"), "Waits: ranks waiting for a slower peer, and whom they waited for (effects, not causes).")


def _rows(frame: pd.DataFrame, what: str) -> pd.DataFrame:
    return pd.DataFrame({
        what: frame["label"], "A (ms)": (frame["a_s"] * 1e3).map("{:,.1f}".format), "B (ms)": (frame["b_s"] * 1e3).map("{:,.1f}".format),
        "change (ms)": (frame["diff_s"] * 1e3).map("{:+,.1f}".format),
        "share": frame["share"].map(lambda s: "" if s is None or pd.isna(s) else f"{s:.0%}"),
    })  # fmt: skip


ui.page(body)
