"""Incidents: the list, and one incident in full: summary, evidence, stack dump, the SQL that
reproduces it, what the self-healing driver did about it, and links to the heat map, timeline and
graph at that moment; then the run's restarts, actions and self-checks."""

import streamlit as st

from rankscope.common.incidents import Finding
from rankscope.dashboard import data, healing, ui
from rankscope.dashboard.data import Run


def body(run: Run) -> None:
    ui.run_header(run, "Incidents")
    _incidents(run)
    ui.healing_section(run)


def _incidents(run: Run) -> None:
    incidents = data.incidents(run)
    if not incidents:
        st.success("No incidents for this run.")
        return
    st.markdown("\n".join(f"- **{i.finding.kind}** ({i.status}): {ui.escape(i.finding.summary)}" for i in incidents))
    ids = [i.incident_id for i in incidents]
    wanted = ui.param("incident")
    chosen = st.selectbox("Incident", ids, index=ids.index(wanted) if wanted in ids else 0,
                          format_func=lambda key: next(f"{i.finding.kind} ({i.status}): {i.finding.summary}"[:140] for i in incidents if i.incident_id == key))  # fmt: skip
    if chosen != wanted:
        st.query_params["incident"] = chosen
    incident = next(i for i in incidents if i.incident_id == chosen)
    f = incident.finding
    st.subheader(f"{f.kind}: {', '.join(ui.who(r, ui.hosts_of(run)) for r in f.ranks) or 'the run'}")
    ui.incident_box(run, incident, details=False)
    st.markdown("**Evidence**")
    st.json(dict(f.evidence), expanded=1)
    st.markdown("**Stack dump**")
    _stacks(run, f)
    st.markdown("**The SQL that shows it** (copy it into `rankscope sql` or the SQL page)")
    st.code(f.sql or "-- this incident carries no query", language="sql", wrap_lines=True)
    st.page_link(ui.PAGES["sql"], label="Open it in the SQL console", icon=":material/database:", query_params={"run": run.id, "incident": f.key})
    _acted(run, incident.incident_id)


def _acted(run: Run, incident_id: str) -> None:
    """What the self-healing driver did about this incident (its actions that name it), if anything."""
    actions = data.actions(run)
    mine = actions[actions["incident_id"] == incident_id] if len(actions) else actions
    if mine.empty:
        return
    st.markdown("**What the self-healing driver did about it**")
    lines = [f"- {ui.clock(a.time_ns)} · attempt {a.attempt} · **{a.action}**" + (f" {ui.escape(a.hosts)}" if a.hosts != "-" else "")
             + (f": {ui.escape(a.reason)}" if a.reason != "-" else "") for a in healing.actions_table(mine).itertuples()]  # fmt: skip
    st.markdown("\n".join(lines))


def _stacks(run: Run, finding: Finding) -> None:
    """The dumps attached to the incident (a hang's evidence: its roots' own, and a stopped root's taken
    from outside by a sibling), else those stored for its ranks."""
    own = finding.evidence.get("stacks")
    if isinstance(own, str) and own:
        st.code(own, language="text")
        return
    attached = [(rank, dump) for key in ("stacks", "stacks_from_outside") if isinstance(finding.evidence.get(key), dict)
                for rank, dump in finding.evidence[key].items()]  # fmt: skip
    for rank, dump in attached:
        dump = dump if isinstance(dump, dict) else {"text": dump}
        by = f", taken from outside by rank {dump['taken_by']}" if "taken_by" in dump else ""
        st.caption(f"rank {rank}{by}" + (f" ({dump['method']})" if "method" in dump else ""))
        st.code(str(dump.get("text", "")), language="text")
    if attached:
        return
    dumps = data.stacks(run, tuple(finding.ranks))
    if dumps.empty:
        st.caption(f"No stack dump stored for rank{'s' if len(finding.ranks) != 1 else ''} {', '.join(map(str, finding.ranks))}.")
        return
    for dump in dumps.itertuples():
        st.caption(f"rank {dump.rank} on {dump.host}, {ui.clock(dump.time_ns)}, {dump.method} ({dump.reason})")
        st.code(dump.text, language="text")


ui.page(body)
