"""The wheel holds the rankscope package as laid out in rankscope/, subpackages and data files included.

The wheel is built (not installed) from a copy of the source tree, so the build leaves nothing
in the work tree; the copy gets a few probe files that stand for future subpackages and data.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("agent", "cli", "collector", "dashboard", "healing", "protos", "testbed", "trainer")
SKIP = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    "rankscope-data", "test-artifacts", ".whl", ".gl", "tests", "benchmarks",
)
# Files added to the copy: a future subpackage, and data files of each kind that must ship.
PROBES = (
    "rankscope/collector/_probe_pkg/__init__.py",
    "rankscope/collector/_probe_pkg/deeper/__init__.py",
    "rankscope/collector/_probe_pkg/schema.sql",
    "rankscope/protos/_probe.proto",
    "rankscope/dashboard/_probe.css",
    "rankscope/dashboard/_probe_pkg/__init__.py",
    "rankscope/dashboard/_probe_pkg/layout.json",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, zipfile.ZipFile]]:
    """(source copy, built wheel)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    for probe in PROBES:
        (src / probe).parent.mkdir(parents=True, exist_ok=True)
        (src / probe).write_text("# probe\n" if probe.endswith(".py") else "probe\n")
    out = tmp / "out"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", str(src), "-w", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    (path,) = out.glob("rankscope-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield src, zf


def test_wheel_holds_every_part_under_rankscope(wheel: tuple[Path, zipfile.ZipFile]) -> None:
    src, zf = wheel
    names = set(zf.namelist())
    required = {
        "rankscope/__init__.py",
        "rankscope/cli/main.py",
        "rankscope/cli/train.py",
        *(f"rankscope/{part}/__init__.py" for part in PARTS),
    }
    assert sorted(required - names) == []
    # Every Python file, at any depth, is in the wheel at its path in the source tree.
    sources = {path.relative_to(src).as_posix() for path in (src / "rankscope").rglob("*.py") if "__pycache__" not in path.parts}
    assert sorted(sources - names) == []
    assert set(PROBES) <= names
    # Nothing else at the top: no bare trainer/, tests/, setup.py; the agent's start-up hook is meant to be there.
    assert {name.split("/")[0] for name in names} == {"rankscope", "rankscope-0.1.0.dist-info", "rankscope-agent.pth"}


def test_wheel_metadata(wheel: tuple[Path, zipfile.ZipFile]) -> None:
    _, zf = wheel
    meta = zf.read("rankscope-0.1.0.dist-info/METADATA").decode()
    assert "Version: 0.1.0" in meta
    assert "Requires-Python: <3.14,>=3.10" in meta or "Requires-Python: >=3.10,<3.14" in meta
    assert "Requires-Dist: torch>=2.6" in meta
    assert "Provides-Extra: dev" in meta
    entry_points = zf.read("rankscope-0.1.0.dist-info/entry_points.txt").decode()
    assert "rankscope = rankscope.cli.main:main" in entry_points
