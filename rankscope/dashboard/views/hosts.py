"""Hosts: GPU and host metrics over time per host and device, with throttling, ECC and Xid events marked,
and each node's state as healing sees it (healthy, suspect, checking, drained) with the reason.
A host that left a restarted run (evicted) stays listed, with no ranks, for its metrics."""

import pandas as pd
import streamlit as st

from rankscope.common import node_states
from rankscope.dashboard import data, figures, ui
from rankscope.dashboard.data import Run

#: events listed as text under the summary (the figure shows them all)
EVENTS_LISTED = 20


def body(run: Run) -> None:
    ui.run_header(run, "Hosts")
    hosts = data.hosts(run)
    if hosts.empty:
        st.info("No rank has registered yet, so there are no hosts to show.")
        return
    gpus = hosts["gpus"] > 0
    states = data.node_states()
    said = {row["host"]: row for _, row in states.iterrows() if row["host"] in set(hosts["host"])}
    summary = hosts.assign(
        ranks=hosts["ranks"].map(lambda r: ", ".join(map(str, r)) or "none now (left the run at a restart)"),
        **{"node state": hosts["host"].map(lambda h: _state(said[h]) if h in said else "never suspected"),
           "why": hosts["host"].map(lambda h: said[h]["reason"] if h in said else "")},
        **{"GPUs": hosts["gpus"], "metric samples": hosts["samples"],
           "hottest GPU (°C)": hosts["max_temp_c"].map("{:.0f}".format).where(gpus, "none"),
           "mean GPU use": hosts["gpu_util"].map("{:.0%}".format).where(gpus, "none"),
           "throttled samples": hosts["throttled"], "new uncorrected ECC": hosts["ecc_new"].astype(int), "Xid codes": hosts["xid_codes"]},
    )[["host", "ranks", "node state", "why", "GPUs", "metric samples", "hottest GPU (°C)", "mean GPU use", "throttled samples", "new uncorrected ECC", "Xid codes"]]  # fmt: skip
    ui.table(summary)
    names = hosts["host"].tolist()
    troubled = hosts[(hosts["throttled"] > 0) | (hosts["ecc_new"] > 0) | (hosts["xid_codes"] > 0)]["host"].tolist()
    reporting = hosts[hosts["samples"] > 0]["host"].tolist()
    wanted = ui.param("host") or next(iter(troubled or reporting or names))
    host = st.selectbox("Host", names, index=names.index(wanted) if wanted in names else 0)
    series = data.host_series(run, host)
    events = data.host_events(run, host)
    if not events.empty:
        st.markdown(f"**{len(events)} event sample{'s' if len(events) != 1 else ''} on {host}** (throttling, ECC errors, Xid):")
        st.markdown("\n".join(f"- {ui.clock(e.time_ns)}: {e.name} on {e.device} ({e.peak:g})" for e in events.head(EVENTS_LISTED).itertuples()))
    if series.empty:
        st.info(f"No metrics from {host}. Each host's metrics come from its local rank 0, and GPU metrics only where NVML answers.")
        return
    if not series["name"].str.startswith("hw.").any():
        st.caption(f"{host} reported no GPU metrics (no GPU, or NVML unavailable): host metrics only.")
    st.plotly_chart(figures.host_figure(series, events, data.HOST_PANELS))


def _state(node: pd.Series) -> str:
    """A node's state as healing sees it, since when, and whether it waits for a person."""
    held = " for a person (drained twice within the hour)" if node_states.held(node) else ""
    return f"{node['state']}{held} since {pd.Timestamp(node['since']).strftime('%Y-%m-%d %H:%M:%S')}"


ui.page(body)
