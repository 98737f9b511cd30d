"""The dashboard's entry point: ``streamlit run`` executes this file on every interaction.

``rankscope dashboard`` starts it (see ``rankscope/cli/dashboard.py``); the data source comes from the
environment (``connection.py``). Pages are small modules under ``views/``, listed here once. Not
``pages/``: Streamlit serves a folder of that name as pages of its own, so a URL such as
``/graph`` would run the page script without this file (no navigation, no page set-up).
"""

from rankscope.agent.autoload import forbid

# First: this process is no training rank, whatever the environment says. Only this process: the
# pages start no processes, `rankscope dashboard` marks its children itself, and AppTest runs this
# script inside a test process whose later children must stay free to activate.
forbid("dashboard", children=False)

import streamlit as st  # noqa: E402 - after forbid() on purpose

from rankscope.dashboard import ui  # noqa: E402

st.set_page_config(page_title="rankscope", page_icon=":material/troubleshoot:", layout="wide")

navigation = st.navigation(
    [
        st.Page(ui.PAGES["runs"], title="Runs", icon=":material/list:", url_path="runs"),
        st.Page(ui.PAGES["overview"], title="Overview", icon=":material/monitoring:", url_path="overview", default=True),
        st.Page(ui.PAGES["heatmap"], title="Heat map", icon=":material/grid_on:", url_path="heatmap"),
        st.Page(ui.PAGES["timeline"], title="Timeline", icon=":material/view_timeline:", url_path="timeline"),
        st.Page(ui.PAGES["anatomy"], title="Step anatomy", icon=":material/stacked_bar_chart:", url_path="anatomy"),
        st.Page(ui.PAGES["graph"], title="3D-parallel graph", icon=":material/hub:", url_path="graph"),
        st.Page(ui.PAGES["hosts"], title="Hosts", icon=":material/dns:", url_path="hosts"),
        st.Page(ui.PAGES["incidents"], title="Incidents", icon=":material/warning:", url_path="incidents"),
        st.Page(ui.PAGES["sql"], title="SQL", icon=":material/database:", url_path="sql"),
    ]
)
st.sidebar.title("rankscope")
ui.run_picker()
navigation.run()
