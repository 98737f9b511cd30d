"""DataFrame -> Plotly figure, and the numbers a figure highlights; pure, no Streamlit.

Each function takes what one ``data`` query returned and builds one figure, so the figures can be
tested with small hand-written frames. Large figures follow Plotly's limits: spans and ranks are
WebGL traces (``scattergl``, one trace per colour with ``None`` between segments, so thousands of
spans are a handful of traces), and a heat map with more cells than a DOM heat map handles well is
sent as one PNG image (``binary_string``) of colours computed here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.colors import sample_colorscale
from plotly.subplots import make_subplots

from rankscope.dashboard.states import worst

# --- shared look -------------------------------------------------------------------------------

KIND_COLOURS = {"compute": "#4C78A8", "data": "#9D755D", "optimizer": "#B279A2", "user": "#BAB0AC", "comm": "#F58518"}
FAMILY_COLOURS = {"tp": "#54A24B", "pp": "#E45756", "dp": "#72B7B2", "other": "#EECA3B"}
STATE_COLOURS = {
    "crashed": "#000000", "silent": "#7F7F7F", "blocked": "#D62728", "straggler": "#FF7F0E", "waiting": "#FFD54F",
    "computing": "#2CA02C", "finished": "#AEC7E8", "not started": "#DDDDDD",
}  # fmt: skip
#: states drawn dark enough to need white labels
DARK_STATES = ("crashed", "silent", "blocked")
ROOT_COLOUR = "#D62728"
#: ratio to the stage median at the two ends of the heat map's colour scale (1.0, normal, in the middle)
HEAT_RANGE = (0.7, 1.3)
HEAT_SCALE = "RdBu_r"
#: above this many cells the heat map is one image instead of a DOM heat map
HEAT_IMAGE_CELLS = 60_000
MARGIN = {"l": 10, "r": 10, "t": 40, "b": 10}


def family(group: str) -> str:
    """The parallelism a process group belongs to: "tp[3]" -> "tp"; anything else is "other"."""
    head = group.split("[", 1)[0]
    return head if head in ("tp", "pp", "dp") else "other"


def _segments(starts: np.ndarray, ends: np.ndarray, y: np.ndarray) -> tuple[list, list]:
    """x and y of one line trace drawing ``len(starts)`` separate horizontal segments."""
    n = len(starts)
    xs = np.empty(3 * n, dtype=object)
    ys = np.empty(3 * n, dtype=object)
    xs[0::3], xs[1::3], xs[2::3] = starts, ends, None
    ys[0::3], ys[1::3], ys[2::3] = y, y, None
    return xs.tolist(), ys.tolist()


#: the distance between two lanes of the timeline (or rows of the graph): a gap sets them apart
LANE = 1.4


def _down(lane: np.ndarray | pd.Series | float, offset: float) -> np.ndarray | float:
    """The y of a lane (plus an offset inside it), lanes going down the page. WebGL traces are drawn
    wrongly on a reversed axis by the plotly.js Streamlit ships (seen with 1.67), so the values
    themselves go down instead."""
    return -(np.asarray(lane, dtype=float) * LANE + offset) if not np.isscalar(lane) else -(lane * LANE + offset)


def _ms(ns: pd.Series | np.ndarray, origin_ns: int) -> np.ndarray:
    """Nanosecond times as milliseconds after ``origin_ns`` (floats keep sub-microsecond steps there)."""
    return (np.asarray(ns, dtype=np.int64) - origin_ns) / 1e6


def _hover(text: pd.Series | np.ndarray) -> list:
    """Hover text for the vertices made by ``_segments`` (both ends of a segment say the same)."""
    values = np.asarray(text, dtype=object)
    out = np.empty(3 * len(values), dtype=object)
    out[0::3], out[1::3], out[2::3] = values, values, None
    return out.tolist()


# --- restarts ----------------------------------------------------------------------------------

RESTART_COLOUR = "#6A3D9A"


def _restart_marks(restarts: pd.DataFrame | None, x_of: Callable[[int], float | None]) -> tuple[list[dict], list[dict]]:
    """Shapes and annotations marking where each attempt began: a dashed vertical line over the whole
    figure at ``x_of(step)`` (None: not drawn there) and its label above it.

    ``restarts``: step, label (``healing.restarts``); rows whose step is unknown (-1) are skipped."""
    shapes: list[dict] = []
    notes: list[dict] = []
    for r in (restarts.itertuples() if restarts is not None and len(restarts) else ()):
        x = x_of(int(r.step)) if int(r.step) > 0 else None
        if x is None:
            continue
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
                       "line": {"color": RESTART_COLOUR, "width": 2, "dash": "dash"}, "name": f"attempt {r.attempt}"})  # fmt: skip
        notes.append({"x": x, "y": 1, "xref": "x", "yref": "paper", "yanchor": "bottom", "xanchor": "left", "yshift": 2,
                      "text": str(r.label), "showarrow": False, "font": {"size": 11, "color": RESTART_COLOUR}})  # fmt: skip
    return shapes, notes


# --- overview ----------------------------------------------------------------------------------

OVERVIEW_PANELS = {
    "step_time_s": "step time (s)",
    "tokens_per_s": "tokens/s",
    "mfu": "MFU",
    "loss": "loss",
    "grad_norm": "gradient norm",
}


def overview_figure(metrics: pd.DataFrame, restarts: pd.DataFrame | None = None) -> go.Figure:
    """One panel per training scalar present: the median over ranks, with the min-max band; a
    dashed line where each attempt after a restart began.

    ``metrics``: first_step, name, mid, low, high (``data.step_metrics``); ``restarts``: attempt,
    step, label (``healing.restarts``).
    """
    names = [n for n in OVERVIEW_PANELS if n in set(metrics["name"])]
    fig = make_subplots(rows=max(len(names), 1), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=[OVERVIEW_PANELS[n] for n in names])  # fmt: skip
    for row, name in enumerate(names, start=1):
        m = metrics[metrics["name"] == name].sort_values("first_step")
        x = m["first_step"].tolist()
        band = x + x[::-1]
        fig.add_trace(go.Scatter(x=band, y=m["high"].tolist() + m["low"].tolist()[::-1], fill="toself", mode="lines", line={"width": 0},
                                 fillcolor="rgba(76,120,168,0.2)", hoverinfo="skip", showlegend=False), row=row, col=1)  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=m["mid"], mode="lines+markers", name=OVERVIEW_PANELS[name], line={"color": "#4C78A8"},
                                 marker={"size": 4}, showlegend=False,
                                 hovertemplate="step %{x}: %{y:.4g} (median over ranks)<extra></extra>"), row=row, col=1)  # fmt: skip
    fig.update_xaxes(title_text="step", row=max(len(names), 1), col=1)
    fig.update_layout(height=170 * max(len(names), 1) + 60, margin=MARGIN)
    shapes, notes = _restart_marks(restarts, float)
    if shapes:  # (one column of panels sharing the step axis: a line over the whole height crosses them all)
        fig.update_layout(shapes=shapes, annotations=[*fig.layout.annotations, *notes], margin={**MARGIN, "t": 60})
    return fig


# --- heat map ----------------------------------------------------------------------------------


def stage_name(pp: int) -> str:
    """A pipeline stage's name; the ranks of a job that declared no 3D layout (plain DDP) have none: pp -1."""
    return f"stage {pp}" if pp >= 0 else "no stages declared"


def heat_rows(cells: pd.DataFrame) -> pd.DataFrame:
    """The heat map's rows, grouped by pipeline stage, then host (hosts in the order of their first
    rank, so node-2 comes before node-10): row, rank, host, pp, label."""
    rows = cells.groupby("row", as_index=False).agg(rank=("rank", "min"), host=("host", "first"), pp=("pp", "min"))
    rows["host_order"] = rows.groupby("host")["rank"].transform("min")
    rows = rows.sort_values(["pp", "host_order", "rank"]).reset_index(drop=True)
    by_rank = rows["row"].astype(str).eq(rows["rank"].astype(str)).all()
    stage = rows["pp"].map(lambda p: f" · {stage_name(p)}" if p >= 0 else "")
    rows["label"] = ("rank " + rows["rank"].astype(str) + " · " + rows["host"] + stage) if by_rank else (rows["host"] + stage)
    return rows.drop(columns="host_order")


def slowest(cells: pd.DataFrame, top: int = 3, first_step: int = 2) -> pd.DataFrame:
    """The rows slowest against their stage, by the median of their ratios from ``first_step`` on.

    Step 1 carries one-time start-up costs (the straggler detector skips it too). Returns row,
    rank (of the row's worst cell), host, pp, ratio (median), worst (max), steps (how many steps
    were at least 5% slow). Vectorised: a 12,288-rank map has hundreds of thousands of cells.
    """
    use = cells[cells["step"] >= first_step] if (cells["step"] >= first_step).any() else cells
    use = use.dropna(subset=["ratio"]).assign(slow=lambda c: c["ratio"] >= 1.05)
    if use.empty:
        return pd.DataFrame(columns=["row", "rank", "host", "pp", "ratio", "worst", "steps"])
    grouped = use.groupby("row")
    summary = grouped.agg(ratio=("ratio", "median"), worst=("ratio", "max"), steps=("slow", "sum"), host=("host", "first"),
                          pp=("pp", "min"))  # fmt: skip
    summary["rank"] = use.loc[grouped["ratio"].idxmax(), ["row", "rank"]].set_index("row")["rank"]
    summary = summary.reset_index().sort_values("ratio", ascending=False).head(top).reset_index(drop=True)
    return summary.astype({"rank": int, "steps": int})


def heatmap_figure(cells: pd.DataFrame, segment: str, highlight: Sequence[str] = (), restarts: pd.DataFrame | None = None) -> go.Figure:
    """Rows (ranks or hosts, grouped by stage and host) x steps, coloured by the ratio to the stage median.

    ``cells``: step, row, rank, host, pp, ns, ratio (``data.heat_cells``). ``highlight``: rows
    to outline (the slowest). ``restarts``: attempt, step, label (``healing.restarts``): a dashed
    line before the first step of each attempt shown. Up to HEAT_IMAGE_CELLS cells a Heatmap trace
    with a hover per cell, above that an image (which stays fast at 12,288 ranks x hundreds of steps).
    """
    rows = heat_rows(cells)
    steps = np.sort(cells["step"].unique())
    z = np.full((len(rows), len(steps)), np.nan)
    ms = np.full_like(z, np.nan)
    col = np.searchsorted(steps, cells["step"].to_numpy())
    at = pd.Index(rows["row"]).get_indexer(cells["row"])
    z[at, col] = cells["ratio"].to_numpy(dtype=float)
    ms[at, col] = cells["ns"].to_numpy(dtype=float) / 1e6
    labels = rows["label"].tolist()
    image = z.size > HEAT_IMAGE_CELLS
    if not image:
        fig = go.Figure(go.Heatmap(
            z=z, x=steps, y=labels, zmin=HEAT_RANGE[0], zmax=HEAT_RANGE[1], zmid=1.0, colorscale=HEAT_SCALE,
            colorbar={"title": {"text": "× stage<br>median"}}, hoverinfo="skip",
            **({"xgap": 1, "ygap": 1} if len(rows) <= 64 else {}),  # gaps would hide the cells of a tall map
        ))  # fmt: skip
        # Plotly selects points, not heat map cells: an invisible marker on each cell makes a click a
        # selection the page can act on (and carries the hover).
        grid_y, grid_x = np.meshgrid(np.arange(len(labels)), steps, indexing="ij")
        fig.add_trace(go.Scatter(
            x=grid_x.ravel(), y=np.array(labels, dtype=object)[grid_y.ravel()], mode="markers", showlegend=False, name="cells",
            marker={"size": 14, "opacity": 0}, customdata=np.stack([z.ravel(), ms.ravel()], axis=1),
            hovertemplate="%{y}<br>step %{x}: %{customdata[1]:.1f} ms, %{customdata[0]:.2f}× its stage's median<extra></extra>",
        ))  # fmt: skip
        fig.update_yaxes(autorange="reversed", type="category")
        x0, x1 = steps.min() - 0.5, steps.max() + 0.5
        column_of = lambda step: step - 0.5  # noqa: E731 - the x axis is the step
    else:
        fig = px.imshow(_heat_rgb(z), binary_string=True, aspect="auto", origin="upper")
        every = max(1, len(steps) // 10)
        fig.update_xaxes(tickvals=list(range(0, len(steps), every)), ticktext=[str(s) for s in steps[::every]])
        fig.update_yaxes(showticklabels=False)
        x0, x1 = -0.5, len(steps) - 0.5
        column_of = lambda step: float(np.searchsorted(steps, step)) - 0.5  # noqa: E731 - the x axis is the column
    restart_lines, restart_notes = _restart_marks(restarts, lambda step: column_of(step) if steps.min() <= step <= steps.max() else None)
    # Shapes address a category axis by position, like an image's rows: row i spans i +- 0.5.
    boxes = [{"type": "rect", "x0": x0, "x1": x1, "y0": y - 0.5, "y1": y + 0.5, "line": {"color": "black", "width": 2}}
             for y in np.flatnonzero(rows["row"].astype(str).isin([str(h) for h in highlight]))]  # fmt: skip
    stages = [{"type": "line", "x0": x0, "x1": x1, "y0": y, "y1": y, "line": {"color": "#444", "width": 1, "dash": "dot"}}
              for y in (np.flatnonzero(np.diff(rows["pp"].to_numpy())) + 0.5)[:64]]  # between pipeline stages  # fmt: skip
    fig.update_layout(
        shapes=boxes + stages + restart_lines, title=f"{segment}: time per step relative to the stage median (red: slower)",
        height=min(900, max(260, 22 * len(rows) + 120)), margin={**MARGIN, "t": 60} if restart_lines else MARGIN,
        **({"annotations": restart_notes} if restart_notes else {}),
    )
    fig.update_xaxes(title_text="step")
    return fig


def _heat_rgb(z: np.ndarray) -> np.ndarray:
    """The heat map's colours as an RGB image (grey where there is no value)."""
    lo, hi = HEAT_RANGE
    levels = np.linspace(0, 1, 256)
    palette = np.array([[int(v) for v in c[4:-1].split(",")] for c in sample_colorscale(HEAT_SCALE, levels.tolist())], dtype=np.uint8)
    scaled = np.clip((np.nan_to_num(z, nan=1.0) - lo) / (hi - lo), 0, 1)
    rgb = palette[(scaled * 255).round().astype(int)]
    rgb[np.isnan(z)] = (200, 200, 200)
    return rgb


# --- timeline ----------------------------------------------------------------------------------

#: vertical offsets inside one rank's lane
WORK_Y, COMM_Y, OPS_Y = 0.0, 0.27, 0.54


def timeline_figure(spans: pd.DataFrame, ops: pd.DataFrame, who: pd.DataFrame, start_ns: int, end_ns: int) -> go.Figure:
    """One lane per rank: its own segments, its communication spans, and its operations.

    ``spans`` and ``ops`` as ``data.spans`` / ``data.operations`` return them; ``who``: rank,
    host (the lanes, in order). Times are drawn in milliseconds from ``start_ns``. Collectives
    are coloured by group family (tp, pp, dp, other); the members of one collective (same group
    and sequence) are joined by a grey line through their arrivals; a send is joined to its
    receive by a red line from the send's issue to the receive's end.
    """
    lanes = {int(r): i for i, r in enumerate(who["rank"])}
    fig = go.Figure()
    window_ms = (end_ns - start_ns) / 1e6
    for kind, part in spans.groupby("kind", sort=True):
        lane = _down(part["rank"].map(lanes), COMM_Y if kind == "comm" else WORK_Y)
        x, y = _segments(_ms(part["start_ns"], start_ns), _ms(part["end_ns"], start_ns), lane)
        text = (part["name"] + " (" + kind + "), step " + part["step"].astype(str) + ", microbatch " + part["microbatch"].astype(str)
                + ": " + ((part["end_ns"] - part["start_ns"]) / 1e6).round(2).astype(str) + " ms")  # fmt: skip
        fig.add_trace(go.Scattergl(x=x, y=y, mode="lines", name=f"{kind} spans", line={"width": 9, "color": KIND_COLOURS.get(kind, "#999")},
                                   hovertext=_hover(text), hoverinfo="text"))  # fmt: skip
    if len(ops):
        collectives = ops[ops["peer"] < 0]
        ends = np.where(collectives["end_ns"] > 0, collectives["end_ns"], end_ns)
        for fam, part in collectives.assign(end=ends, fam=collectives["group_name"].map(family)).groupby("fam"):
            x, y = _segments(_ms(part["issue_ns"], start_ns), _ms(part["end"], start_ns), _down(part["rank"].map(lanes), OPS_Y))
            text = (part["op"] + " " + part["group_name"] + " #" + part["seq"].astype(str) + ", " + part["nbytes"].astype(str)
                    + " bytes, " + ((part["end"] - part["issue_ns"]) / 1e6).round(2).astype(str) + " ms, " + part["state"])  # fmt: skip
            fig.add_trace(go.Scattergl(x=x, y=y, mode="lines", name=f"{fam} collectives", line={"width": 7, "color": FAMILY_COLOURS[fam]},
                                       hovertext=_hover(text), hoverinfo="text"))  # fmt: skip
        _matched_links(fig, collectives, lanes, start_ns)
        _transfers(fig, ops[ops["peer"] >= 0], lanes, start_ns, end_ns)
    fig.update_yaxes(tickvals=[_down(i, COMM_Y) for i in lanes.values()],
                     ticktext=[f"rank {r} ({h})" for r, h in zip(who["rank"], who["host"])], zeroline=False, showgrid=False)  # fmt: skip
    fig.update_xaxes(title_text="ms from the window's start", range=[0, window_ms])
    fig.update_layout(height=max(300, 70 * len(lanes) + 120), margin=MARGIN, legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"})
    return fig


def _matched_links(fig: go.Figure, collectives: pd.DataFrame, lanes: dict[int, int], start_ns: int) -> None:
    """A grey line through the arrivals of the members of each collective (same group and sequence)."""
    key = ["attempt", "group_name", "seq"] if "attempt" in collectives else ["group_name", "seq"]  # a restart numbers them anew
    members = collectives.assign(lane=collectives["rank"].map(lanes)).sort_values([*key, "lane"])
    xs: list = []
    ys: list = []
    for _, one in members.groupby(key, sort=False):
        if len(one) < 2:
            continue
        xs += [*_ms(one["issue_ns"], start_ns).tolist(), None]
        ys += [*_down(one["lane"], OPS_Y).tolist(), None]
    if xs:
        fig.add_trace(go.Scattergl(x=xs, y=ys, mode="lines", name="matched collectives", line={"width": 1, "color": "rgba(90,90,90,0.6)"},
                                   hoverinfo="skip"))  # fmt: skip


def _transfers(fig: go.Figure, p2p: pd.DataFrame, lanes: dict[int, int], start_ns: int, end_ns: int) -> None:
    """Send and receive markers, and a line from each send to its receive (drawn to the window's end if it never completed)."""
    if p2p.empty:
        return
    is_send = p2p["op"].str.contains("send", case=False)
    for label, part, symbol in (("sends", p2p[is_send], "triangle-right"), ("receives", p2p[~is_send], "triangle-left")):
        if part.empty:
            continue
        text = (part["op"] + " " + part["group_name"] + " #" + part["seq"].astype(str) + " with rank " + part["peer"].astype(str)
                + ", " + part["nbytes"].astype(str) + " bytes")  # fmt: skip
        fig.add_trace(go.Scattergl(x=_ms(part["issue_ns"], start_ns), y=_down(part["rank"].map(lanes), OPS_Y), mode="markers", name=label,
                                   marker={"symbol": symbol, "size": 9, "color": "#E45756"}, hovertext=text, hoverinfo="text"))  # fmt: skip
    same = ["attempt", "group_name", "seq"] if "attempt" in p2p else ["group_name", "seq"]
    sends = p2p[is_send][["rank", "peer", *same, "issue_ns"]]
    recvs = p2p[~is_send][["rank", "peer", *same, "end_ns"]]
    pairs = sends.merge(recvs, left_on=["peer", "rank", *same], right_on=["rank", "peer", *same],
                        suffixes=("_src", "_dst"))  # fmt: skip
    if pairs.empty:
        return
    xs, ys = [], []
    done = np.where(pairs["end_ns"] > 0, pairs["end_ns"], end_ns)
    for src, dst, issue, end in zip(pairs["rank_src"], pairs["rank_dst"], _ms(pairs["issue_ns"], start_ns), _ms(done, start_ns)):
        xs += [issue, end, None]
        ys += [_down(lanes[src], OPS_Y), _down(lanes[dst], OPS_Y), None]
    fig.add_trace(go.Scattergl(x=xs, y=ys, mode="lines", name="send → receive", line={"width": 1.5, "color": "#E45756"}, hoverinfo="skip"))


# --- 3D-parallel graph -------------------------------------------------------------------------


def graph_positions(tp: pd.Series, pp: pd.Series, dp: pd.Series, tp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """x, y of ranks on the page: a block per pipeline stage, tensor-parallel peers side by side,
    data-parallel replicas one above the other."""
    x = pp.to_numpy() * (tp_size + 1) + tp.to_numpy()
    return x.astype(float), _down(dp, 0.0)


def graph_figure(states: pd.DataFrame, tp_size: int, roots: Sequence[int] = (), root_hosts: Sequence[str] = ()) -> go.Figure:
    """Every rank at its (pp, tp, dp) place, coloured by state, with its tp, pipeline and dp edges.

    ``states``: ``states.classify`` output (rank, host, pid, tp, pp, dp, state, detail, step,
    phase, beat_ns, in_flight). The roots of a hang get a red ring and a label; the other ranks
    of their hosts an orange ring.
    """
    s = states.reset_index(drop=True)
    x, y = graph_positions(s["tp"], s["pp"], s["dp"], tp_size)
    s = s.assign(x=x, y=y)
    fig = go.Figure()
    place = {(t, p, d): (xx, yy) for t, p, d, xx, yy in zip(s["tp"], s["pp"], s["dp"], s["x"], s["y"])}
    # Neighbours along each axis: tp chains inside a tensor-parallel group, pipeline neighbours
    # (drawn as arcs, so they do not run through the next stage's ranks), dp chains.
    kinds = (("tp group", (1, 0, 0), 0.0, "tp"), ("pipeline neighbours", (0, 1, 0), 0.35, "pp"), ("dp group", (0, 0, 1), 0.0, "dp"))
    for name, (dt, dpp, ddp), bend, colour in kinds:
        xs: list = []
        ys: list = []
        for (t, p, d), (x0, y0) in place.items():
            there = place.get((t + dt, p + dpp, d + ddp))
            if there is None:
                continue
            x1, y1 = there
            xs += [x0, (x0 + x1) / 2, x1, None]
            ys += [y0, (y0 + y1) / 2 + bend, y1, None]
        if xs:
            fig.add_trace(go.Scattergl(x=xs, y=ys, mode="lines", name=name, hoverinfo="skip",
                                       line={"width": 1, "color": FAMILY_COLOURS[colour]}, opacity=0.6))  # fmt: skip
    size = float(np.clip(420 / np.sqrt(max(len(s), 1)), 5, 30))
    hover = ("rank " + s["rank"].astype(str) + " · " + s["host"].astype(str) + " · pid " + s["pid"].astype(str)
             + "<br>tp " + s["tp"].astype(str) + ", pp " + s["pp"].astype(str) + ", dp " + s["dp"].astype(str)
             + "<br>" + s["detail"].astype(str) + "<br>step " + s["step"].astype(str) + ", phase " + s["phase"].astype(str)
             + "<br>last heartbeat " + pd.to_datetime(s["beat_ns"], utc=True).dt.strftime("%H:%M:%S").fillna("none")
             + "<br>in flight: " + s["in_flight"].replace("", "nothing").astype(str))  # fmt: skip
    labelled = len(s) <= 256
    for state in (st for st in STATE_COLOURS if st in set(s["state"])):
        part = s["state"] == state
        fig.add_trace(go.Scattergl(
            x=s.loc[part, "x"], y=s.loc[part, "y"], mode="markers+text" if labelled else "markers", name=state,
            text=s.loc[part, "rank"].astype(str) if labelled else None, textposition="middle center",
            textfont={"size": 11, "color": "white" if state in DARK_STATES else "#111"},
            marker={"size": size, "color": STATE_COLOURS[state], "line": {"width": 1, "color": "#333"}},
            hovertext=hover[part], hoverinfo="text",
        ))  # fmt: skip
    _rings(fig, s[s["host"].isin(root_hosts) & ~s["rank"].isin(roots)], size, "#FF7F0E", "host of the hang's root")
    _rings(fig, s[s["rank"].isin(roots)], size, ROOT_COLOUR, "hang root")
    for _, r in s[s["rank"].isin(roots)].iterrows():
        fig.add_annotation(x=r["x"], y=r["y"], text=f"hang root: rank {r['rank']} ({r['host']})", showarrow=True, arrowcolor=ROOT_COLOUR,
                           font={"color": ROOT_COLOUR}, ay=-40, bgcolor="white", bordercolor=ROOT_COLOUR)  # fmt: skip
    stages = sorted(s["pp"].unique())
    fig.update_xaxes(tickvals=[p * (tp_size + 1) + (tp_size - 1) / 2 for p in stages], ticktext=[stage_name(p) for p in stages],
                     zeroline=False, showgrid=False)  # fmt: skip
    replicas = sorted(s["dp"].unique())
    step = max(1, len(replicas) // 16)
    fig.update_yaxes(title_text="data-parallel replica", tickvals=[_down(d, 0.0) for d in replicas[::step]],
                     ticktext=[str(d) for d in replicas[::step]], zeroline=False, showgrid=False)  # fmt: skip
    fig.update_layout(height=min(900, max(320, 60 * (s["dp"].max() + 1) + 140)), margin=MARGIN,
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"})  # fmt: skip
    return fig


def _rings(fig: go.Figure, ranks: pd.DataFrame, size: float, colour: str, name: str) -> None:
    if ranks.empty:
        return
    fig.add_trace(go.Scattergl(x=ranks["x"], y=ranks["y"], mode="markers", name=name, hoverinfo="skip",
                               marker={"size": size + 10, "color": "rgba(0,0,0,0)", "line": {"width": 3, "color": colour}}))  # fmt: skip


def host_states(states: pd.DataFrame) -> pd.DataFrame:
    """One row per host: stage (its lowest), ranks, worst state, and the count of each state."""
    grouped = states.groupby("host")
    out = grouped.agg(pp=("pp", "min"), ranks=("rank", "size"), first_rank=("rank", "min"), state=("state", worst)).reset_index()
    counts = states.pivot_table(index="host", columns="state", values="rank", aggfunc="size", fill_value=0)
    out["counts"] = out["host"].map(lambda h: ", ".join(f"{int(n)} {st}" for st, n in counts.loc[h].items() if n))
    return out.sort_values(["pp", "first_rank"]).reset_index(drop=True)


def host_graph_figure(hosts: pd.DataFrame, root_hosts: Sequence[str] = ()) -> go.Figure:
    """The graph aggregated by host (for runs too large to draw rank by rank): a column of hosts per
    pipeline stage, each coloured by the worst state among its ranks."""
    h = hosts.copy()
    h["x"] = h["pp"].astype(float)
    h["y"] = _down(h.groupby("pp").cumcount(), 0.0)
    fig = go.Figure()
    size = float(np.clip(300 / np.sqrt(max(h.groupby("pp").size().max(), 1)), 4, 22))
    for state in (st for st in STATE_COLOURS if st in set(h["state"])):
        part = h[h["state"] == state]
        fig.add_trace(go.Scattergl(x=part["x"], y=part["y"], mode="markers", name=state,
                                   marker={"size": size, "color": STATE_COLOURS[state], "symbol": "square"},
                                   hovertext=part["host"] + " (" + part["ranks"].astype(str) + " ranks): " + part["counts"],
                                   hoverinfo="text"))  # fmt: skip
    _rings(fig, h[h["host"].isin(root_hosts)], size, ROOT_COLOUR, "host of the hang's root")
    fig.update_xaxes(tickvals=sorted(h["pp"].unique()), ticktext=[stage_name(p) for p in sorted(h["pp"].unique())], showgrid=False)
    fig.update_yaxes(title_text="host", showgrid=False, showticklabels=False)
    fig.update_layout(height=600, margin=MARGIN, legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"})
    return fig


def stage_states_figure(states: pd.DataFrame) -> go.Figure:
    """How many ranks of each pipeline stage are in each state (the coarsest view of a big run)."""
    counts = states.groupby(["pp", "state"]).size().reset_index(name="ranks")
    fig = go.Figure()
    for state in (st for st in STATE_COLOURS if st in set(counts["state"])):
        part = counts[counts["state"] == state]
        fig.add_trace(go.Bar(x=[stage_name(p) for p in part["pp"]], y=part["ranks"], name=state, marker_color=STATE_COLOURS[state]))
    fig.update_layout(barmode="stack", height=360, margin=MARGIN, yaxis_title="ranks")
    return fig


# --- hosts -------------------------------------------------------------------------------------


def host_figure(series: pd.DataFrame, events: pd.DataFrame, panels: Sequence[tuple[str, str, bool]]) -> go.Figure:
    """A panel per metric present, a line per device; above them a strip of throttling, ECC and Xid events.

    ``series``: name, device, time_ns, value (``data.host_series``); ``events``: name, device,
    time_ns, peak (``data.host_events``); ``panels``: (metric, title, is_rate) in display order.
    """
    present = [(name, title) for name, title, _ in panels if name in set(series["name"])]
    titles = (["events (throttling, ECC, Xid)"] if len(events) else []) + [title for _, title in present]
    rows = max(len(titles), 1)
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.03, subplot_titles=titles)
    row = 1
    if len(events):
        label = events["name"].str.replace("hw.gpu.", "", regex=False).str.replace("hw.errors.", "", regex=False) + " · " + events["device"]
        fig.add_trace(go.Scatter(x=pd.to_datetime(events["time_ns"], utc=True), y=label, mode="markers", name="events",
                                 marker={"symbol": "x", "size": 9, "color": ROOT_COLOUR}, showlegend=False,
                                 hovertemplate="%{y} at %{x}<extra></extra>"), row=1, col=1)  # fmt: skip
        row = 2
    # One colour per device across the panels, and one legend entry for it.
    colours = dict(zip(sorted(series["device"].unique()), itertools.cycle(px.colors.qualitative.Plotly)))
    shown: set[str] = set()
    for name, title in present:
        for device, part in series[series["name"] == name].groupby("device"):
            fig.add_trace(go.Scatter(x=pd.to_datetime(part["time_ns"], utc=True), y=part["value"], mode="lines", name=device,
                                     legendgroup=device, showlegend=device not in shown, line={"color": colours[device]},
                                     hovertemplate=f"{title} · {device}: %{{y:.4g}}<extra></extra>"), row=row, col=1)  # fmt: skip
            shown.add(device)
        row += 1
    fig.update_layout(height=150 * rows + 80, margin=MARGIN)
    return fig


# --- step anatomy ------------------------------------------------------------------------------

CATEGORY_COLOURS = {
    "compute": "#4C78A8", "optimizer": "#B279A2", "data": "#9D755D", "bubble": "#E45756", "exposed_comm": "#F58518",
    "comm": "#F58518", "unexplained": "#BAB0AC",
}  # fmt: skip
CATEGORY_LABELS = {"exposed_comm": "exposed communication", "bubble": "pipeline bubble", "comm": "communication (waits included)"}
#: the critical path's row inside a rank's lane: in the gap below the lane's operations
PATH_Y = 0.81
PATH_COLOUR = "#111111"
LEVEL_COLOURS = {"rank": "#D62728", "stage": "#4C78A8", "group": "#72B7B2", "wait": "#BAB0AC"}


def category_label(category: str) -> str:
    return CATEGORY_LABELS.get(category, category)


def anatomy_figure(frame: pd.DataFrame, categories: Sequence[str], marked_step: int | None = None) -> go.Figure:
    """Where the mean rank's step time went, step by step: one stacked area per category, in ``categories``'
    order (the first at the bottom); a dotted line at ``marked_step`` (the step whose critical path is drawn).

    ``frame``: step, category, ms (``data.anatomy_steps``)."""
    fig = go.Figure()
    present = [c for c in categories if c in set(frame["category"])]
    for category in present:
        part = frame[frame["category"] == category].sort_values("step")
        fig.add_trace(go.Scatter(
            x=part["step"], y=part["ms"], mode="lines", stackgroup="steps", name=category_label(category),
            line={"width": 0.5, "color": CATEGORY_COLOURS.get(category, "#999")},
            hovertemplate=f"step %{{x}}: %{{y:,.1f}} ms {category_label(category)}<extra></extra>",
        ))  # fmt: skip
    shapes = []
    if marked_step is not None:
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": marked_step, "x1": marked_step, "y0": 0, "y1": 1,
                       "line": {"color": PATH_COLOUR, "width": 1, "dash": "dot"}, "name": "critical path step"})  # fmt: skip
    fig.update_layout(height=360, margin=MARGIN, shapes=shapes, legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"},
                      yaxis_title="ms per step (mean rank)")  # fmt: skip
    fig.update_xaxes(title_text="step")
    return fig


def critical_path_figure(links: pd.DataFrame, spans: pd.DataFrame, ops: pd.DataFrame, who: pd.DataFrame, start_ns: int, end_ns: int) -> go.Figure:
    """The timeline of the ranks on a step's critical path (``timeline_figure``), with the path drawn over
    it: a black bar per link in its rank's lane, and a dashed line where the path moves to the rank it
    waited on.

    ``links``: rank, what, kind, start_ns, end_ns, waited_on, in time order (``data.critical_path``)."""
    fig = timeline_figure(spans, ops, who, start_ns, end_ns)
    lanes = {int(r): i for i, r in enumerate(who["rank"])}
    on = links[links["rank"].isin(list(lanes))].reset_index(drop=True)
    if on.empty:
        return fig
    lane = on["rank"].map(lanes).to_numpy()
    x, y = _segments(_ms(on["start_ns"], start_ns), _ms(on["end_ns"], start_ns), _down(lane, PATH_Y))
    waited = on["waited_on"].map(lambda r: "" if pd.isna(r) else f", waited on rank {int(r)}")
    text = ("critical path: rank " + on["rank"].astype(str) + " " + on["what"] + " (" + on["kind"] + "): "
            + ((on["end_ns"] - on["start_ns"]) / 1e6).round(2).astype(str) + " ms" + waited)  # fmt: skip
    fig.add_trace(go.Scattergl(x=x, y=y, mode="lines", name="critical path", line={"width": 6, "color": PATH_COLOUR},
                               hovertext=_hover(text), hoverinfo="text"))  # fmt: skip
    xs: list = []
    ys: list = []
    for i in range(1, len(on)):
        if lane[i] != lane[i - 1]:
            at = float(_ms(np.array([on.loc[i, "start_ns"]]), start_ns)[0])
            xs += [at, at, None]
            ys += [_down(lane[i - 1], PATH_Y), _down(lane[i], PATH_Y), None]
    if xs:
        fig.add_trace(go.Scattergl(x=xs, y=ys, mode="lines", name="path moves to the rank waited on",
                                   line={"width": 2, "color": PATH_COLOUR, "dash": "dash"}, hoverinfo="skip"))  # fmt: skip
    return fig


def contributions_figure(contributions: pd.DataFrame, top: int = 12) -> go.Figure:
    """The ``top`` contributions of a comparison (``rankscope compare``) as horizontal bars, the first at the
    top: each one's change in ms, coloured by what it is (a rank, a stage, a group's transfers).

    ``contributions``: label, level, diff_s, share (the comparison's JSON ``contributions``)."""
    rows = contributions.head(top).iloc[::-1]
    share = rows["share"].map(lambda s: "" if s is None or pd.isna(s) else f" ({s:.0%} of the difference)") if "share" in rows else ""
    fig = go.Figure(go.Bar(
        x=rows["diff_s"] * 1e3, y=rows["label"], orientation="h", marker={"color": [LEVEL_COLOURS.get(v, "#999") for v in rows["level"]]},
        hovertext=rows["label"] + ": " + (rows["diff_s"] * 1e3).map("{:+,.1f} ms".format) + share, hoverinfo="text",
    ))  # fmt: skip
    fig.update_layout(height=max(220, 28 * len(rows) + 90), margin=MARGIN, xaxis_title="change in ms per step (B minus A)")
    fig.update_yaxes(type="category")
    return fig
