"""Timeline: a lane per rank for a window of steps, with compute and communication spans, collectives
coloured by group, sends and receives; matched collectives joined, and who arrived last."""

import streamlit as st

from rankscope.dashboard import data, export, figures, ui
from rankscope.dashboard.data import Run

#: lanes shown at first in a large run (any ranks can be picked)
DEFAULT_LANES = 16
#: the widest window, in steps: spans of more would not be readable anyway
MAX_STEPS = 20


def body(run: Run) -> None:
    ui.run_header(run, "Timeline")
    who = data.ranks(run)
    if who.empty or run.steps == 0:
        st.info("No rank has registered or reached step 1 yet: there is no timeline to draw.")
        return
    first, last = _steps(run)
    all_ranks = who["rank"].astype(int).tolist()
    current = who[who["attempt"] == who["attempt"].max()]["rank"].astype(int).tolist()  # not the ranks only an earlier, larger world had
    wanted = [r for r in ui.ints_param("ranks") if r in all_ranks] or current[:DEFAULT_LANES]
    hosts = ui.hosts_of(run)
    left, right = st.columns([1, 2])
    if run.steps > 1:
        first, last = left.slider("Steps", 1, run.steps, (first, last), help=f"at most {MAX_STEPS} steps at once")
        first = max(first, last - MAX_STEPS + 1)
    chosen = right.multiselect("Ranks", all_ranks, default=wanted, format_func=lambda r: ui.who(r, hosts))
    if not chosen:
        st.info("Pick at least one rank.")
        return
    lanes = who[who["rank"].isin(chosen)].sort_values("rank")
    start_ns, end_ns = data.window(run, first, last)
    if not start_ns:
        st.info(f"No spans recorded in steps {first}-{last}.")
        return
    ranks = tuple(int(r) for r in lanes["rank"])
    spans = data.spans(run, ranks, start_ns, end_ns)
    ops = data.operations(run, ranks, start_ns, end_ns)
    st.markdown(f"Steps **{first}-{last}**, {len(ranks)} rank{'s' if len(ranks) != 1 else ''}: {len(spans):,} spans and "
                f"{len(ops):,} operations from {ui.clock(start_ns)} to {ui.clock(end_ns)} ({(end_ns - start_ns) / 1e6:,.0f} ms).")  # fmt: skip
    if spans.empty and ops.empty:
        st.info("These ranks recorded nothing in this window.")
        return
    st.plotly_chart(figures.timeline_figure(spans, ops, lanes, start_ns, end_ns))
    st.download_button(
        "Download trace (Perfetto / Chrome JSON)",
        data=lambda: export.to_json(export.chrome_trace(spans, ops, lanes, run.id, start_ns, end_ns)),
        file_name=f"{run.id}-steps-{first}-{last}.json", mime="application/json", on_click="ignore", icon=":material/download:",
        help="one process per rank, one track per stream, flow arrows between matched collectives; open it in ui.perfetto.dev",
    )  # fmt: skip
    _skew(run, start_ns, end_ns, hosts)


def _steps(run: Run) -> tuple[int, int]:
    """The window from the URL (?from=&to=, or ?at= a moment), else the newest complete step."""
    first, last, at = ui.int_param("from"), ui.int_param("to"), ui.int_param("at")
    if first is not None:
        last = last if last is not None else first
    elif at is not None:
        first = last = data.step_at(run, at)
    else:
        first = last = max(1, run.steps - 1 if run.live else run.steps)
    last = min(max(last, 1), run.steps)
    return min(max(first, 1), last), last


def _skew(run: Run, start_ns: int, end_ns: int, hosts: dict[int, str]) -> None:
    skew = data.arrival_skew(run, start_ns, end_ns)
    st.subheader("Arrival skew")
    if skew.empty:
        st.caption("No collective with two or more members in this window.")
        return
    top = skew.iloc[0]
    st.markdown(f"Widest: **{top['op']} {top['group_name']} #{top['seq']}**: {ui.who(top['last_rank'], hosts)} arrived last, "
                f"{top['skew_ms']:,.1f} ms after {ui.who(top['first_rank'], hosts)}; the others waited for it.")  # fmt: skip
    rows = skew.assign(
        collective=skew["op"] + " " + skew["group_name"] + " #" + skew["seq"].astype(str),
        **{"skew (ms)": skew["skew_ms"].map("{:,.1f}".format), "last to arrive": skew["last_rank"].map(lambda r: ui.who(r, hosts)),
           "first to arrive": skew["first_rank"].map(lambda r: ui.who(r, hosts))},
    )[["collective", "members", "skew (ms)", "last to arrive", "first to arrive"]]  # fmt: skip
    ui.table(rows, "Collectives of the window (all members counted) by the spread of their members' arrivals.")


ui.page(body)
