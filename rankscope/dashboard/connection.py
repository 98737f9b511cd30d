"""Where the dashboard reads from, and the one function every page query goes through.

``rankscope dashboard`` runs Streamlit in its own process and hands the data source over in the
environment (``RANKSCOPE_DASHBOARD_SOURCE``, JSON; the token stays in ``RANKSCOPE_TOKEN``, the
collector's CA bundle in ``RANKSCOPE_TLS_CA``): the app script is executed by Streamlit, not
called, so it cannot take arguments, and the environment also reaches AppTest, which runs the
script inside a test process.

The reader is a Streamlit resource: one per source for the whole server. A collector client is a
gRPC channel shared by every session; an embedded store can only be opened by one process at a
time (chDB locks its directory), so this process opens it once and keeps it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import streamlit as st

from rankscope.collector.client import DEFAULT_COLLECTOR, Reader, open_reader

SOURCE_VARIABLE = "RANKSCOPE_DASHBOARD_SOURCE"
TOKEN_VARIABLE = "RANKSCOPE_TOKEN"
TLS_CA_VARIABLE = "RANKSCOPE_TLS_CA"
#: rows a page query may return; a larger answer means the page asked for too wide a window
MAX_ROWS = 500_000


@dataclass(frozen=True)
class Source:
    """One of: a collector at HOST:PORT, a ClickHouse URL, or an embedded store directory."""

    collector: str | None = None
    clickhouse: str | None = None
    store: str | None = None

    def describe(self) -> str:
        """For the sidebar and error messages; a ClickHouse URL is shown without its password."""
        if self.store:
            return f"embedded store {self.store}"
        if self.clickhouse:
            from urllib.parse import urlsplit

            url = urlsplit(self.clickhouse)
            return f"ClickHouse at {url.hostname}:{url.port or 8123}"
        return f"collector at {self.collector or DEFAULT_COLLECTOR}"

    def to_env(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Source:
        """The source ``rankscope dashboard`` chose; the default collector when none was set."""
        text = environ.get(SOURCE_VARIABLE, "")
        values = json.loads(text) if text else {}
        return cls(**{k: values.get(k) for k in ("collector", "clickhouse", "store")})


def _close(reader: Reader) -> None:
    """Streamlit calls this when a reader leaves its cache (``reset``): a store's lock goes with it."""
    reader.close()


@st.cache_resource(show_spinner=False, on_release=_close)
def _reader(source: Source, token: str | None, tls_ca: str | None) -> Reader:
    """Opened once per source (raises the client's Unreachable when it cannot be; not cached then)."""
    return open_reader(
        collector=source.collector,
        clickhouse=source.clickhouse,
        store=Path(source.store) if source.store else None,
        token=token,
        tls_ca=Path(tls_ca) if tls_ca else None,
    )


def reset() -> None:
    """Close every reader this process opened; the next query opens a new one. An embedded store is
    then free for another process (or another store directory: chDB holds one per process)."""
    _reader.clear()


def source() -> Source:
    return Source.from_env()


def query(sql: str, params: Mapping[str, object] | None = None, max_rows: int = MAX_ROWS) -> pd.DataFrame:
    """Run one read-only statement and return it as a DataFrame.

    Raises the client's ``QueryFailed`` subclasses; pages show them as messages (``ui.page``).
    Times come back as timezone-aware pandas timestamps; the queries here mostly return
    integer nanoseconds instead, which survive every hop without rounding.
    """
    reader = _reader(source(), os.environ.get(TOKEN_VARIABLE) or None, os.environ.get(TLS_CA_VARIABLE) or None)
    return reader.query(sql, params, max_rows=max_rows).to_pandas()


def query_arrow(sql: str, params: Mapping[str, object] | None = None) -> pa.Table:
    """``query`` as an Arrow table: for the analyses shared with the command line (``rankscope compare``,
    the step anatomy), which take a ``query(sql, params) -> pyarrow.Table`` like the diagnosis."""
    reader = _reader(source(), os.environ.get(TOKEN_VARIABLE) or None, os.environ.get(TLS_CA_VARIABLE) or None)
    return reader.query(sql, params, max_rows=MAX_ROWS)
