"""What every page shares: the chosen run, URL parameters, live refresh, errors as messages, and
the words and links that name ranks, hosts and incidents.

The run lives in the URL (``?run=ID``) so a link to a page and run can be shared; a run picked
in the sidebar is also remembered for the session, because Streamlit drops query parameters when
the navigation menu switches pages. Without a choice every page follows the newest run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import pandas as pd
import streamlit as st

from rankscope.collector.client import QueryFailed, ResultTooLarge, Unauthenticated, Unreachable
from rankscope.common.incidents import Incident, who  # noqa: F401 - who: the pages name ranks as the incidents do (ui.who)
from rankscope.dashboard import connection, data, healing
from rankscope.dashboard.data import Run

log = logging.getLogger("rankscope.dashboard")

RUN_PARAM = "run"
NO_RUNS = (
    "No runs yet. Start training with the agent on, for example "
    "`RANKSCOPE_ENABLE=1 RANKSCOPE_COLLECTOR=127.0.0.1:7777 rankscope train`, and it appears here."
)
_PINNED = "rankscope_pinned_run"
#: seconds between redraws of a live page
REFRESH_S = 3.0

T = TypeVar("T")

PAGES = {
    "runs": "views/runs.py",
    "overview": "views/overview.py",
    "heatmap": "views/heatmap.py",
    "timeline": "views/timeline.py",
    "anatomy": "views/anatomy.py",
    "graph": "views/graph.py",
    "hosts": "views/hosts.py",
    "incidents": "views/incidents.py",
    "sql": "views/sql.py",
}


# --- the chosen run ---------------------------------------------------------------------------


def chosen_run_id() -> str | None:
    """The run in the URL, else the one picked earlier in this session; None: follow the newest."""
    chosen = st.query_params.get(RUN_PARAM) or st.session_state.get(_PINNED)
    if chosen:
        st.session_state[_PINNED] = chosen
        if st.query_params.get(RUN_PARAM) != chosen:
            st.query_params[RUN_PARAM] = chosen
    return chosen or None


def choose(run_id: str | None) -> None:
    """Pin ``run_id`` (None: follow the newest run again) and keep it in the URL."""
    if run_id:
        st.session_state[_PINNED] = run_id
        st.query_params[RUN_PARAM] = run_id
    else:
        st.session_state.pop(_PINNED, None)
        st.query_params.pop(RUN_PARAM, None)


def current_run() -> Run | None:
    """The chosen or newest run; None (with a message on the page) when there is none to show."""
    runs = data.runs()
    chosen = chosen_run_id()
    if not runs:
        st.info(NO_RUNS)
        return None
    if chosen is None:
        return runs[0]
    found = next((r for r in runs if r.id == chosen), None)
    if found is None:
        st.error(f"There is no run {chosen!r} among the {len(runs)} newest runs. Pick one on the Runs page.")
    return found


def run_picker() -> None:
    """The sidebar's run selector (quietly empty when the data cannot be read: the page says why)."""
    try:
        runs = data.runs()
    except QueryFailed:
        st.sidebar.caption(f"Reading: {connection.source().describe()} (not answering)")
        return
    chosen = chosen_run_id()
    options = ["", *(r.id for r in runs)]
    labels = {"": f"newest run ({runs[0].id})" if runs else "newest run", **{r.id: f"{r.id} · {r.status}" for r in runs}}
    if chosen and chosen not in labels:  # a run from a link that is not (or no longer) listed: the page says so
        options.append(chosen)
        labels[chosen] = f"{chosen} (not found)"
    key = f"run_picker:{chosen}"  # a new widget when the URL names another run, so it shows that run

    def picked() -> None:
        choose(st.session_state[key] or None)

    st.sidebar.selectbox("Run", options, index=options.index(chosen or ""), format_func=labels.__getitem__, key=key, on_change=picked)
    st.sidebar.caption(f"Reading: {connection.source().describe()}")


# --- pages ------------------------------------------------------------------------------------


def page(body: Callable[[Run], None]) -> None:
    """Draw a page about the chosen run: redrawn every REFRESH_S while the run is live, still once it
    is over; failures become messages, never tracebacks."""
    run = guarded(current_run)
    if run is None:
        return

    @st.fragment(run_every=REFRESH_S if run.live else None)
    def draw() -> None:
        fresh = guarded(current_run)
        if fresh is None:
            return
        if fresh.live != run.live:
            st.rerun()  # the run just ended (or came back): redraw the page without the timer
        guarded(body, fresh)

    draw()


def guarded(fn: Callable[..., T], *args: object) -> T | None:
    """``fn(*args)``, or None after putting what went wrong on the page in words a person can act on."""
    try:
        return fn(*args)
    except Unreachable as e:
        st.error(
            f"**No data.** {e}\n\nStart a collector (`rankscope collector`) or point the dashboard at the data: "
            "`rankscope dashboard --collector HOST:PORT`, `--clickhouse URL` or `--store DIR`."
        )
    except Unauthenticated as e:
        st.error(f"**The collector wants a token.** {e}\n\nGive it with `rankscope dashboard --token` or RANKSCOPE_TOKEN.")
    except ResultTooLarge as e:
        st.warning(f"**Too much to draw at once.** Narrow the window (fewer steps or ranks). ({e})")
    except QueryFailed as e:
        st.error(f"**A query failed.** {e}")
    except Exception as e:  # noqa: BLE001 - a page must end in a message, not a traceback
        log.exception("dashboard page failed")
        st.error(f"**This part of the page failed** ({type(e).__name__}: {e}). The server log has the details.")
    return None


# --- URL parameters ---------------------------------------------------------------------------


def param(name: str) -> str | None:
    value = st.query_params.get(name)
    return value or None


def int_param(name: str) -> int | None:
    """An integer URL parameter; None (and a note) when it is not one."""
    value = param(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        st.caption(f"Ignoring ?{name}={value!r}: not a whole number.")
        return None


def ints_param(name: str) -> tuple[int, ...]:
    """A comma-separated list of integers (``?ranks=1,5``); empty when absent or malformed."""
    value = param(name)
    if value is None:
        return ()
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        st.caption(f"Ignoring ?{name}={value!r}: expected numbers separated by commas.")
        return ()


# --- words ------------------------------------------------------------------------------------


def clock(ns: int) -> str:
    """A moment as people read it in UTC: ``2026-11-21 06:50:46.123 UTC``."""
    if not ns:
        return "never"
    seconds, rest = divmod(int(ns), 1_000_000_000)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{rest // 1_000_000:03d} UTC"


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours} h {minutes:02d} min" if hours else (f"{minutes} min {secs:02d} s" if minutes else f"{secs} s")


def hosts_of(run: Run) -> dict[int, str]:
    ranks = data.ranks(run)
    return dict(zip(ranks["rank"].astype(int), ranks["host"]))


STATUS_COLOURS = {"running": "green", "hung": "red", "finished": "blue", "failed": "red"}


def status_text(status: str) -> str:
    """A run's status as coloured bold Markdown (the word itself stays plain text)."""
    return f":{STATUS_COLOURS.get(status, 'gray')}[**{status}**]"


def run_header(run: Run, title: str) -> None:
    """The page title, and the run's id and status as text (so they can be read, searched and tested)."""
    st.header(title)
    live = " · refreshing live" if run.live else ""
    restarted = f" · attempt {run.attempt} (restarted {_times(run.attempt)})" if run.attempt else ""
    st.markdown(
        f"Run **{escape(run.id)}** · {status_text(run.status)} · {run.world_size} ranks "
        f"(TP {run.tp} × PP {run.pp} × DP {run.dp}) · step {run.steps} · {duration(run.duration_s)}{restarted}{live}"
    )


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


# --- restarts and self-healing ----------------------------------------------------------------

#: actions listed on a page (the newest; a run acts a handful of times)
ACTIONS_LISTED = 50
#: self-check figures listed on a page (failures first)
CHECKS_LISTED = 60


def restarts(run: Run) -> pd.DataFrame:
    """Where each attempt after the first began, and why (``healing.restarts``); no query for a run
    never restarted."""
    if not run.attempt:
        return healing.restarts(pd.DataFrame(), pd.DataFrame())
    return healing.restarts(data.attempts(run), data.actions(run))


def restart_notes(found: pd.DataFrame) -> None:
    """Each restart in a sentence: which attempt, from which step, without which hosts, why."""
    if len(found):
        st.markdown("\n".join(f"- 🔄 {escape(healing.restart_sentence(r))}" for r in found.to_dict("records")))


def healing_section(run: Run, found: pd.DataFrame | None = None) -> None:
    """The run's restarts, what the self-healing driver decided and did (``actions``) and the hosts'
    self-checks figure by figure, failures marked ❌; nothing at all for a run without any."""
    actions, checks = data.actions(run), data.selfchecks(run)
    found = restarts(run) if found is None else found
    if actions.empty and checks.empty and found.empty:
        return
    st.subheader("Self-healing" if len(actions) or len(checks) else "Restarts")
    restart_notes(found)
    if len(actions):
        rows = healing.actions_table(actions).tail(ACTIONS_LISTED)
        rows.insert(0, "time", rows.pop("time_ns").map(clock))
        more = f" (the {ACTIONS_LISTED} newest of {len(actions)})" if len(actions) > ACTIONS_LISTED else ""
        table(rows, f"What the self-healing driver (rankscope launch) decided and did, oldest first{more}:")
    if len(checks):
        verdicts = healing.host_verdicts(checks)
        st.markdown("\n".join(
            f"- {'✅' if v.passed else '❌'} **{escape(v.host)}** {'passed' if v.passed else 'failed'} its self-check"
            + (f" ({', '.join(v.failed)})" if v.failed else "") + (f": {escape(v.summary)}" if v.summary else "")
            for v in verdicts.itertuples()
        ))  # fmt: skip
        rows = healing.selfcheck_table(checks).head(CHECKS_LISTED)
        rows.insert(0, "time", rows.pop("time_ns").map(clock))
        more = f" (the first {CHECKS_LISTED} of {len(checks)})" if len(checks) > CHECKS_LISTED else ""
        table(rows, f"Self-check figures, each beside the same figure's median on the peer hosts; failures first{more}:")


# --- links to the evidence --------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    page: str
    label: str
    params: Mapping[str, str]


def evidence_links(run: Run, incident: Incident) -> list[Link]:
    """Where an incident's evidence shows, the page that shows it best first."""
    f = incident.finding
    ranks = ",".join(str(r) for r in f.ranks)
    base = {RUN_PARAM: run.id}
    peers = [int(r) for r in f.evidence.get("stage_ranks", [])]
    lanes = ",".join(str(r) for r in sorted(set(f.ranks) | set(peers))[:16])
    segment = f.evidence.get("segment")
    heat = Link(PAGES["heatmap"], "heat map", {**base, "ranks": ranks, **({"segment": str(segment)} if segment else {})})
    timeline = Link(PAGES["timeline"], "timeline", {**base, "ranks": lanes or ranks, "at": str(f.first_seen_ns)})
    graph = Link(PAGES["graph"], "3D-parallel graph", {**base, "at": str(f.last_seen_ns)})
    host_pages = [Link(PAGES["hosts"], f"host {h}", {**base, "host": h}) for h in f.hosts[:3]]
    best = {
        "straggler": [heat, timeline, graph],
        "hang": [graph, timeline, heat],
        "crash": [graph, timeline],
        "lost_rank": [graph, timeline],
        "lost_host": [graph, *host_pages],
        "slow_link": [timeline, graph],
        "gpu_throttle": [*host_pages, heat],
        "gpu_ecc": [*host_pages, graph],
        "gpu_xid": [*host_pages, graph],
    }.get(f.kind, [timeline, heat, graph])
    details = Link(PAGES["incidents"], "details", {**base, "incident": f.key})
    return [*best, details]


def links(items: Sequence[Link]) -> None:
    """A row of page links (they keep the run and the moment in the URL they open)."""
    columns = st.columns(len(items)) if items else []
    for column, link in zip(columns, items):
        column.page_link(link.page, label=link.label, query_params=dict(link.params), icon=":material/arrow_forward:")


def incident_box(run: Run, incident: Incident, details: bool = True) -> None:
    """One incident in words: its summary (naming the rank and host), when, and links to its evidence
    (and to its own details unless they are on this page)."""
    f = incident.finding
    text = (f"**{f.kind}** ({incident.status}) — {f.summary}\n\nranks {', '.join(map(str, f.ranks)) or '-'} · "
            f"hosts {', '.join(f.hosts) or '-'} · first seen {clock(f.first_seen_ns)} · last seen {clock(f.last_seen_ns)}")  # fmt: skip
    box = st.error if incident.status == "open" and f.severity == "critical" else st.warning if incident.status == "open" else st.info
    box(text)
    links([link for link in evidence_links(run, incident) if details or link.page != PAGES["incidents"]])


def escape(text: str) -> str:
    """Free text (run ids, summaries) safe inside Markdown: no accidental emphasis, code or links.

    Only what would change the text mid-line is escaped (Streamlit shows HTML as text anyway),
    so the Markdown source still reads like the text."""
    return "".join("\\" + c if c in "\\`*_[" else c for c in str(text))


def markdown_table(rows: Sequence[Mapping[str, object]]) -> str:
    """Rows as a Markdown table: page text, with links that work (st.table shows links as text)."""
    if not rows:
        return ""
    names = list(rows[0])
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(str(row[n]).replace("|", "\\|").replace("\n", " ") for n in names) + " |" for row in rows]
    return "\n".join(lines)


def table(frame: pd.DataFrame, caption: str | None = None) -> None:
    """A small table as page text (st.table), readable by people, browsers' search and tests alike;
    st.dataframe draws on a canvas, so its cells are none of these."""
    if caption:
        st.caption(caption)
    st.table(frame.reset_index(drop=True))
