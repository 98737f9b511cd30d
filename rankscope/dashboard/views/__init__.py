"""The dashboard's pages, one small module each; Streamlit runs them by path (see ``rankscope/dashboard/app.py``)."""
