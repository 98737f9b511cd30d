"""Runs: every run with its status, shape, progress and open incidents; pick one."""

from urllib.parse import quote

import streamlit as st

from rankscope.dashboard import data, ui

st.header("Runs")


@st.fragment(run_every=ui.REFRESH_S)
def refresh() -> None:
    ui.guarded(runs_list)


def runs_list() -> None:
    runs = data.runs()
    if not runs:
        st.info(ui.NO_RUNS)
        return
    chosen = ui.chosen_run_id() or runs[0].id
    st.markdown(f"{len(runs)} run{'s' if len(runs) != 1 else ''}, newest first. Showing **{chosen}** on the other pages; "
                "click a run to show it instead (the link keeps the choice, so it can be shared).")  # fmt: skip
    rows = [
        {
            "run": f"[{ui.escape(r.id)}](./?run={quote(r.id)})" + (" ◀" if r.id == chosen else ""),
            "status": ui.status_text(r.status),
            "world size": r.world_size,
            "TP × PP × DP": f"{r.tp} × {r.pp} × {r.dp}",
            "steps": r.steps,
            "started": ui.clock(r.start_ns),
            "duration": ui.duration(r.duration_s),
            "open incidents": r.open_incidents,
            "incidents": r.incidents,
        }
        for r in runs
    ]
    st.markdown(ui.markdown_table(rows))


refresh()
