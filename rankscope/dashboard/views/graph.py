"""3D-parallel graph: every rank at its (pp, tp, dp) place, coloured by what it was doing at a chosen
moment; the root of a hang and its host highlighted. Large runs are shown by host or by stage."""

import pandas as pd
import streamlit as st

from rankscope.dashboard import data, figures, states, ui
from rankscope.dashboard.data import Run

#: above this many ranks the graph starts aggregated by host
RANKS_UP_TO = 2048
#: data-parallel replicas drawn at once in the rank view of a large run (a slice; the slider moves it)
SLICE_REPLICAS = 32


def body(run: Run) -> None:
    ui.run_header(run, "3D-parallel graph")
    start, end = run.start_ns, run.end_ns or run.last_ns or run.start_ns
    at = min(max(ui.int_param("at") or _before_exits(run, end), start), end)
    left, right = st.columns([3, 1])
    if end > start:
        seconds = left.slider("Moment (seconds after the run started)", 0.0, (end - start) / 1e9, (at - start) / 1e9, step=1.0,
                              format="%.0f s")  # fmt: skip
        at = start + int(seconds * 1e9)
    view = right.radio("Show", ["ranks", "hosts", "stages"], index=0 if run.world_size <= RANKS_UP_TO else 1, horizontal=True)
    rows = data.rank_states(run, at)
    if rows.empty:
        st.info("No rank has registered yet.")
        return
    incidents = data.incidents(run)
    hangs = states.active_incidents(incidents, "hang", at)
    roots = sorted({r for i in hangs for r in i.finding.ranks})
    root_hosts = sorted({h for i in hangs for h in i.finding.hosts})
    stragglers = {r for i in states.active_incidents(incidents, "straggler", at) for r in i.finding.ranks}
    ranks = states.classify(rows, at, stragglers, roots)
    hosts = dict(zip(ranks["rank"].astype(int), ranks["host"]))
    counts = ranks["state"].value_counts()
    st.markdown(f"At **{ui.clock(at)}**: " + ", ".join(f"{counts[s]} {s}" for s in states.STATES if s in counts) + ".")
    for rank in roots:
        row = ranks[ranks["rank"] == rank].iloc[0]
        st.error(f"**Hang root: {ui.who(rank, hosts)}**: {row['detail']}; last heartbeat {ui.clock(row['beat_ns'])}. "
                 f"Its host {row['host']} is outlined.")  # fmt: skip
    if stragglers:
        st.warning("**Straggler" + ("s" if len(stragglers) > 1 else "") + ":** " + ", ".join(ui.who(r, hosts) for r in sorted(stragglers)))
    if view == "ranks":
        shown = _slice(ranks, roots)
        st.plotly_chart(figures.graph_figure(shown, run.tp, roots, root_hosts))
    elif view == "hosts":
        st.plotly_chart(figures.host_graph_figure(figures.host_states(ranks), root_hosts))
    else:
        st.plotly_chart(figures.stage_states_figure(ranks))
    trouble = ranks[~ranks["state"].isin(["computing", "finished"])]
    if not trouble.empty:
        listed = trouble.head(50).assign(rank=lambda t: t["rank"].map(lambda r: ui.who(r, hosts)))[["rank", "state", "detail"]]
        more = f" (the first 50 of {len(trouble)})" if len(trouble) > 50 else ""
        ui.table(listed, f"Ranks not simply computing{more}:")


def _before_exits(run: Run, end: int) -> int:
    """The default moment: the end, or just before the first rank ended (after it, ranks only finish)."""
    first = data.first_exit(run)
    return first - 1_000_000 if first else end


def _slice(ranks: pd.DataFrame, roots: list[int]) -> pd.DataFrame:
    """All ranks, or for a large run a window of data-parallel replicas (around the hang's root first)."""
    replicas = int(ranks["dp"].max()) + 1
    if replicas <= SLICE_REPLICAS:
        return ranks
    around = int(ranks.loc[ranks["rank"].isin(roots), "dp"].min()) if roots else 0
    first = st.slider("Data-parallel replicas shown", 0, replicas - 1, (around, min(replicas - 1, around + SLICE_REPLICAS - 1)))
    return ranks[ranks["dp"].between(*first)]


ui.page(body)
