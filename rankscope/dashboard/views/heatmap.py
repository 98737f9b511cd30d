"""Heat map: ranks (grouped by pipeline stage and host) x steps, coloured by a segment's time
relative to the ranks of the same stage (MegaScale's straggler heat map). A click opens the timeline.
A restarted run shows each step as the latest attempt that ran it, a dashed line where each attempt began."""

import pandas as pd
import streamlit as st

from rankscope.dashboard import data, figures, ui
from rankscope.dashboard.data import Run

def body(run: Run) -> None:
    ui.run_header(run, "Heat map")
    segments = data.segments(run)
    if segments.empty:
        st.info("No spans recorded for this run yet: there is nothing to compare across ranks.")
        return
    names = segments["name"].tolist()
    suspects = [i.finding for i in data.incidents(run) if i.finding.kind == "straggler"]
    wanted = ui.param("segment") or next((str(f.evidence.get("segment")) for f in suspects if f.evidence.get("segment") in names), None)
    left, middle, right = st.columns([2, 1, 3])
    segment = left.selectbox("Segment", names, index=names.index(wanted) if wanted in names else 0,
                             help="compute segments are compared on the rank's own work; waits in collectives are cut out")  # fmt: skip
    last_step = max(run.steps, int(segments["last_step"].max()), 1)  # heartbeats may lag the spans (or be missing)
    rows, first, last = data.heat_first_view(run.world_size, last_step)
    by = middle.radio("Rows", ["rank", "host"], index=["rank", "host"].index(rows), horizontal=True,
                      help="host: one row per host, showing its slowest rank")  # fmt: skip
    if last_step > 1:
        first, last = right.slider("Steps", 1, last_step, (first, last))
    cells = data.heat_cells(run, segment, first, last, by)
    if cells.empty:
        st.info(f"No {segment} spans in steps {first}-{last}.")
        return
    hosts = ui.hosts_of(run)
    top = figures.slowest(cells)
    slow = top[top["ratio"] >= 1.05]
    measure = "CPU time (host-only run on shared cores: wall time there mostly measures the scheduler)" if cells["cpu_time"].all() else "wall time"
    if slow.empty:
        st.success(f"No rank is persistently slower than its stage in {segment} (steps {first}-{last}).")
    else:
        lead = slow.iloc[0]
        st.markdown(f"**Slowest against its stage: {_name(lead, by, hosts)}**, {segment} {lead['ratio']:.2f}× its stage's median "
                    f"(median over steps {max(first, 2)}-{last}; at least 5% slower in {lead['steps']} steps).")  # fmt: skip
        for _, other in slow.iloc[1:].iterrows():
            st.markdown(f"- also slow: {_name(other, by, hosts)}, {other['ratio']:.2f}× its stage's median")
    st.caption(f"Compared on {measure}. 1.0 is the stage's median rank; red is slower, blue faster.")
    restarts = ui.restarts(run)
    if len(restarts):
        st.caption("The run was restarted: a step run again shows its latest run, and the dashed lines mark where each attempt "
                   "began. A row is a rank as the latest attempt numbers it (after a restart, the same rank may be another "
                   "process on another host); a rank only an earlier attempt had is blank after it.")  # fmt: skip
    named = sorted({rank for f in suspects for rank in f.ranks})
    if named:  # the diagnosis weighs more than this segment's colours (arrival order, critical path): its ranks are boxed
        who = ", ".join(ui.who(rank, hosts) for rank in named)
        even = not set(named) & set(slow["rank"].astype(int))
        st.markdown(f"**Named by the diagnosis (boxed): {who}**" + (f": its {segment} time is within its stage's here, its delay "
                    "shows elsewhere (the incident's evidence, and when it arrives at collectives on the timeline)" if even else ""))  # fmt: skip
        boxed = [str(rank) for rank in named] if by == "rank" else sorted({hosts.get(rank, "") for rank in named})
    else:
        boxed = [str(r) for r in slow["row"]]
    highlight = boxed + [str(r) for r in ui.ints_param("ranks") if by == "rank"]
    fig = figures.heatmap_figure(cells, segment, highlight, restarts)
    event = st.plotly_chart(fig, on_select="rerun", selection_mode="points", key="heat")
    rows = figures.heat_rows(cells)
    picked = _picked(event, rows)
    if picked is not None:
        rank, step = picked
        st.switch_page(ui.PAGES["timeline"], query_params={"run": run.id, "ranks": _with_peers(cells, rank), "from": str(step), "to": str(step)})
    target = int(slow.iloc[0]["rank"]) if not slow.empty else int(rows.iloc[0]["rank"])
    step = max(first, last - 1)
    st.page_link(ui.PAGES["timeline"], label=f"Open the timeline of rank {target} and its stage peers at step {step}", icon=":material/view_timeline:",
                 query_params={"run": run.id, "ranks": _with_peers(cells, target), "from": str(step), "to": str(step)})  # fmt: skip
    st.caption("Click a cell to open the timeline of that rank and its stage peers at that step.")


def _name(row: pd.Series, by: str, hosts: dict[int, str]) -> str:
    """How a row of ``figures.slowest`` is named on the page (the diagnosis's words for a rank)."""
    stage = f", {figures.stage_name(int(row['pp']))}" if row["pp"] >= 0 else ""
    return f"{ui.who(int(row['rank']), hosts)}{stage}" if by == "rank" else f"host {row['row']} (rank {row['rank']}){stage}"


def _with_peers(cells: pd.DataFrame, rank: int) -> str:
    """The rank and (up to 8 of) its pipeline stage's ranks, for the timeline's lanes."""
    stage = cells.loc[cells["rank"] == rank, "pp"].iloc[0]
    peers = sorted(cells.loc[cells["pp"] == stage, "rank"].unique())[:8]
    return ",".join(str(r) for r in sorted(set(peers) | {rank}))


def _picked(event: object, rows: pd.DataFrame) -> tuple[int, int] | None:
    """(rank, step) of a clicked cell, if any."""
    points = getattr(getattr(event, "selection", None), "points", None) or []
    for point in points:
        label, step = point.get("y"), point.get("x")
        match = rows[rows["label"] == label]
        if step is not None and not match.empty:
            return int(match.iloc[0]["rank"]), int(step)
    return None


ui.page(body)
