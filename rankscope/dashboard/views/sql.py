"""SQL: a read-only console for post mortems, with cookbook queries; results as a table with CSV download."""

import streamlit as st

from rankscope.collector.store.schema import TABLES
from rankscope.dashboard import connection, cookbook, data, ui
from rankscope.dashboard.data import Run

OWN = "(your own statement)"


def console() -> None:
    st.header("SQL")
    run = ui.guarded(ui.current_run)
    st.markdown("One read-only statement (SELECT, WITH, SHOW, DESCRIBE, EXPLAIN) on the stored data; "
                "`{name:Type}` placeholders are bound by the engine. Tables: "
                + ", ".join(f"`{t.name}`" for t in TABLES if t.name not in ("schema_version", "batches")) + ".")  # fmt: skip
    examples = {e.title: e for e in cookbook.EXAMPLES}

    def load() -> None:
        example = examples.get(st.session_state["sql_example"])
        if example is not None:
            st.session_state["sql_text"] = example.sql

    from_incident = _incident_sql(run)
    if from_incident and st.session_state.get("sql_incident") != ui.param("incident"):  # arrived from an incident's link
        st.session_state["sql_text"], st.session_state["sql_incident"] = from_incident, ui.param("incident")
    st.session_state.setdefault("sql_text", cookbook.EXAMPLES[0].sql)
    title = st.selectbox("Cookbook", [OWN, *examples], index=0 if from_incident else 1, key="sql_example", on_change=load)
    if title in examples:
        st.caption(examples[title].why)
    st.text_area("Statement", key="sql_text", height=240)
    statement = st.session_state["sql_text"]
    values = _parameters(statement, run, examples.get(title))
    if values is not None and st.button("Run", type="primary"):
        ui.guarded(_show, statement, values)


def _incident_sql(run: Run | None) -> str | None:
    """The statement of the incident named in the URL (the Incidents page links here with it)."""
    wanted = ui.param("incident")
    if run is None or wanted is None:
        return None
    return next((i.finding.sql for i in data.incidents(run) if i.incident_id == wanted and i.finding.sql), None)


def _parameters(statement: str, run: Run | None, example: cookbook.Example | None) -> dict[str, object] | None:
    """A value for each placeholder: the shown run for ``run``, an input for the others; None if one is invalid."""
    values: dict[str, object] = {}
    filled = _defaults(run, example)
    for name, kind in cookbook.placeholders(statement).items():
        if name == "run" and run is not None:
            st.caption(f"`{{run:String}}` is the run shown: **{run.id}**")
            values[name] = run.id
            continue
        text = st.text_input(f"{name} ({kind})", value=filled.get(name, ""), key=f"sql_param_{name}")
        try:
            values[name] = cookbook.value(text, kind)
        except ValueError as e:
            st.error(f"{name}: {e}")
            return None
    return values


def _defaults(run: Run | None, example: cookbook.Example | None) -> dict[str, str]:
    if run is None or example is None or not example.defaults:
        return {}
    known: dict[str, str] = {}
    ranks = data.ranks(run)
    if len(ranks):
        known["host"] = str(ranks.iloc[0]["host"])
    latest = data.latest_collective(run)
    if latest is not None:
        known["group"], known["seq"] = latest[0], str(latest[1])
    return {name: known[which] for name, which in example.defaults.items() if which in known}


def _show(statement: str, values: dict[str, object]) -> None:
    result = connection.query(statement, values)
    st.markdown(f"**{len(result):,} row{'s' if len(result) != 1 else ''}**")
    st.dataframe(result, hide_index=True)
    st.download_button("Download CSV", result.to_csv(index=False).encode(), file_name="rankscope-query.csv", mime="text/csv",
                       on_click="ignore", icon=":material/download:")  # fmt: skip


ui.guarded(console)
