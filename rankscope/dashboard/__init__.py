"""Streamlit dashboard with Plotly figures, reading through the collector's query API or straight from ClickHouse."""
