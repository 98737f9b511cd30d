"""Running the dashboard's pages in this process (Streamlit's AppTest) and reading what they show:
shared by tests/test_dashboard.py (a recorded run) and tests/test_dashboard_app.py (edge cases)."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from rankscope.agent import autoload
from rankscope.dashboard.connection import SOURCE_VARIABLE, Source

APP = Path(__file__).resolve().parents[1] / "rankscope" / "dashboard" / "app.py"
PAGES = ("runs", "overview", "heatmap", "timeline", "anatomy", "graph", "hosts", "incidents", "sql")
#: the elements that carry the page's messages and prose
MESSAGES = ("error", "warning", "info", "success", "markdown", "caption")


def read_from(mp: pytest.MonkeyPatch, source: Source) -> None:
    """Point the pages run in this process at ``source``, and undo what running the app does to it."""
    mp.setenv(SOURCE_VARIABLE, source.to_env())
    mp.setattr(autoload, "_forbidden", autoload._forbidden)  # app.py's forbid() marks this process: undo it


def open_page(name: str, **params: str) -> AppTest:
    """The page ``name`` (a file under rankscope/dashboard/views/) opened with these query parameters; it raised nothing."""
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params.update(params)
    at.run()
    if name != "overview":
        at.switch_page(f"views/{name}.py").run()
    assert not at.exception, (name, [e.value for e in at.exception])
    return at


def said(at: AppTest) -> str:
    """The page's messages and prose, as one string."""
    return "\n".join(str(e.value) for kind in MESSAGES for e in getattr(at, kind))


def page_text(at: AppTest) -> str:
    """Everything a person can read on the page, as one string."""
    parts = [str(e.value) for kind in ("header", "subheader") for e in getattr(at, kind)]
    parts += [said(at)] + [str(e.value) for e in at.code]
    parts += [e.value.to_string() for e in at.table]
    parts += [f"{m.label} {m.value}" for m in at.metric]
    return "\n".join(parts)


def array(value: object) -> np.ndarray:
    """A figure's array as plotly.py writes it: a list, or base64 typed data (``bdata``)."""
    if isinstance(value, dict) and "bdata" in value:
        flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        shape = value.get("shape")
        return flat.reshape([int(n) for n in str(shape).split(",")]) if shape else flat
    return np.array(value, dtype=float)
