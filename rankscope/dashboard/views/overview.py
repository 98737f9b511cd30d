"""Overview: the open incidents on top, then step time, tokens/s, MFU and loss over the steps (a
restarted run's steps as their latest attempt ran them, a dashed line where each attempt began),
then the restarts and what the self-healing driver did."""

import math

import pandas as pd
import streamlit as st

from rankscope.dashboard import data, figures, ui
from rankscope.dashboard.data import Run


def body(run: Run) -> None:
    ui.run_header(run, "Overview")
    incidents = data.incidents(run)
    open_now = [i for i in incidents if i.status == "open"]
    if open_now:
        st.subheader(f"{len(open_now)} open incident{'s' if len(open_now) != 1 else ''}")
        for incident in open_now:
            ui.incident_box(run, incident)
    else:
        st.success("No open incidents.")
    closed = [i for i in incidents if i.status != "open"]
    if closed:  # open for a run that is over: its incidents closed when it ended, and they are the post mortem
        with st.expander(f"{len(closed)} closed incident{'s' if len(closed) != 1 else ''}", expanded=not run.live):
            for incident in closed:
                ui.incident_box(run, incident)
    restarts = ui.restarts(run)
    _scalars(run, restarts)
    ui.healing_section(run, restarts)


def _scalars(run: Run, restarts: pd.DataFrame) -> None:
    metrics = data.step_metrics(run)
    if metrics.empty:
        st.info("No training scalars recorded for this run yet (loss, step time, tokens/s: `agent.record_scalars`).")
        return
    latest = metrics.sort_values("first_step").groupby("name").last()
    columns = st.columns(4)
    for column, (name, label, fmt) in zip(columns, (("step_time_s", "step time", "{:.3f} s"), ("tokens_per_s", "tokens/s", "{:,.0f}"),
                                                    ("mfu", "MFU", "{:.1%}"), ("loss", "loss", "{:.4f}"))):  # fmt: skip
        if name in latest.index and math.isfinite(latest.loc[name, "mid"]):
            column.metric(f"{label} (step {int(latest.loc[name, 'first_step'])})", fmt.format(latest.loc[name, "mid"]))
        else:
            column.metric(label, "not reported")
    if "mfu" not in latest.index:
        st.caption("MFU is not reported: no peak FLOP/s is known for this device (CPU runs have none).")
    rerun = " A step run again after a restart shows its latest run; the dashed lines mark where each attempt began." if len(restarts) else ""
    st.caption("Each line is the median over the ranks reporting it; the band spans the slowest and fastest rank. "
               f"The loss comes from the last pipeline stage.{rerun}")  # fmt: skip
    st.plotly_chart(figures.overview_figure(metrics, restarts))


ui.page(body)
