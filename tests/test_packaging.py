"""The wheel holds the rankscope package as laid out in rankscope/, and installs by role.

The wheel is built (not installed) from a copy of the source tree, so the build leaves nothing
in the work tree; the copy gets a few probe files that stand for future subpackages and data.
``pip install rankscope`` is the agent alone: its imports are checked here, and a fresh virtual
environment with the wheel and no extra records a real run into a collector of the full install.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import OFF_THIS_TREE, ROOT, ProcRunner, build_wheel, start_collector
from test_agent_activation import activations
from test_agent_collectives import SCRIPTS, collectives, exits, query
from test_cli import EXTRA_MODULES
from rankscope.cli.main import COMMANDS
from rankscope.collector.client import Client

PARTS = ("agent", "cli", "collector", "dashboard", "healing", "protos", "testbed", "trainer")
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
#: what the agent's install (no extra) holds, by the names its code imports
AGENT_IMPORTS = {"torch", "numpy", "google.protobuf", "grpc", "opentelemetry"}
#: optional imports of the agent's parts, each failing gracefully without its package
OPTIONAL_IMPORTS = {"pynvml": "the gpu extra: no GPU metrics", "grpc_tools": "protos/generate.py, the dev extra: make protos"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, zipfile.ZipFile]]:
    """(source copy with the probes, built wheel)."""
    src, path = build_wheel(tmp_path_factory.mktemp("wheel"), PROBES)
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
    src, zf = wheel
    meta = zf.read("rankscope-0.1.0.dist-info/METADATA").decode()
    assert "Version: 0.1.0" in meta
    assert "Requires-Python: <3.14,>=3.10" in meta or "Requires-Python: >=3.10,<3.14" in meta
    requires: dict[str, set[str]] = {}
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        requirement, _, marker = line.partition(";")
        extra = re.fullmatch(r'\s*extra == "([\w-]+)"', marker)
        requires.setdefault(extra.group(1) if extra else "", set()).add(requirement.strip())
    # The wire's lower bounds are the versions that generated rankscope/protos/v1 (older ones refuse its code).
    grpc_made = re.search(r"^GRPC_GENERATED_VERSION = '([\d.]+)'", (src / "rankscope/protos/v1/ingest_pb2_grpc.py").read_text(), re.M)
    protobuf_made = re.search(r"^# Protobuf Python Version: ((\d+)\.[\d.]+)", (src / "rankscope/protos/v1/telemetry_pb2.py").read_text(), re.M)
    assert grpc_made and protobuf_made
    assert requires.pop("") == {
        "torch>=2.6", "numpy", f"protobuf<{int(protobuf_made.group(2)) + 1},>={protobuf_made.group(1)}", f"grpcio>={grpc_made.group(1)}",
        "opentelemetry-api", "opentelemetry-sdk",
    }  # fmt: skip
    assert requires == {
        "gpu": {"nvidia-ml-py"},
        "stacks": {"py-spy"},
        "collector": {"pyarrow", "pandas", "clickhouse-connect", "chdb", "prometheus-client"},
        "dashboard": {"rankscope[collector]", "streamlit", "plotly"},
        "all": {"rankscope[collector,dashboard,gpu,stacks]"},
        "campaign": {"lightning", "accelerate"},
        "dev": {"pytest", "pytest-timeout", "pytest-xdist", "pytest-rerunfailures", "grpcio-tools", "playwright", "pyyaml", "import-linter"},
    }
    assert set(re.findall(r"^Provides-Extra: (.+)$", meta, re.M)) == set(requires)
    # the extra a command names when it is missing (rankscope.cli.main.missing_extra) is one of these
    declared = {name: getattr(importlib.import_module(module), "EXTRA", None) for name, module in COMMANDS.items()}
    assert {extra for extra in declared.values() if extra is not None} <= set(requires)
    assert declared["collector"] == "collector" and declared["dashboard"] == "dashboard" and declared["train"] is None
    entry_points = zf.read("rankscope-0.1.0.dist-info/entry_points.txt").decode()
    assert "rankscope = rankscope.cli.main:main" in entry_points


def test_the_agent_imports_only_what_its_install_holds() -> None:
    """rankscope's agent, shared types, wire code and trainer: `pip install rankscope` without extras runs them.

    Every import at any depth is the standard library, one of these parts, a package of the agent's
    install, or an optional one that fails gracefully."""
    parts = ("agent", "common", "protos", "trainer")
    found: dict[str, set[str]] = {}
    for part in parts:
        for path in (ROOT / "rankscope" / part).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())

    def allowed(name: str) -> bool:
        top = name.partition(".")[0]
        return (
            top in sys.stdlib_module_names or top in OPTIONAL_IMPORTS or name == "rankscope"
            or any(name == m or name.startswith(m + ".") for m in AGENT_IMPORTS | {f"rankscope.{p}" for p in parts})
        )  # fmt: skip

    assert {name: sorted(paths) for name, paths in found.items() if not allowed(name)} == {}


# --- the agent's install alone, in a fresh virtual environment ------------------------------------------


def makefile_torch() -> str:
    """The torch requirement the Makefile installs first: ``make TORCH=...`` passes it to the tests in the
    environment, else the Makefile's default (a local CPU wheel on the development machine)."""
    found = re.search(r"^TORCH \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, "the Makefile sets no TORCH"
    return os.environ.get("TORCH") or found.group(1)


@pytest.fixture(scope="module")
def agent_only(wheel_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a fresh virtual environment holding torch, installed as the Makefile does,
    and the wheel without extras, with what it requires and nothing else (about 40 s; the torch wheel
    takes most of it)."""
    venv = tmp_path_factory.mktemp("agent-only") / "venv"
    subprocess.run([str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q", "install"]
    for requirement in (makefile_torch(), str(wheel_file)):
        done = subprocess.run([*pip, requirement], capture_output=True, text=True, timeout=600, env={**os.environ, **OFF_THIS_TREE})
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return venv / "bin"


def run_in(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``args`` with the fresh environment's command ``args[0]``, in its directory (``python -c`` puts
    the working directory first on the path: not this tree)."""
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **OFF_THIS_TREE}, cwd=bin_dir.parent)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_agent_s_install_holds_none_of_the_collector_s_or_dashboard_s_packages(agent_only: Path) -> None:
    code = "import importlib.util, rankscope; print(rankscope.__file__); print(sorted(m for m in {} if importlib.util.find_spec(m)))"
    done = run_in(agent_only, "python", "-c", code.format(EXTRA_MODULES))
    assert done.returncode == 0, done.stderr
    where, present = done.stdout.splitlines()
    assert where.startswith(str(agent_only.parent)), where  # the wheel's rankscope, not this tree's
    assert present == "[]"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_commands_of_a_missing_extra_say_which_to_install(agent_only: Path, tmp_path: Path) -> None:
    assert run_in(agent_only, "rankscope", "--help").returncode == 0
    for argv, extra in ((["collector", "--store", str(tmp_path / "store")], "collector"), (["sql", "SELECT 1"], "collector"),
                        (["dashboard"], "dashboard")):  # fmt: skip
        done = run_in(agent_only, "rankscope", *argv)
        expected = rf"rankscope {argv[0]} needs the {extra} extra: pip install 'rankscope\[{extra}\]' \(no module named (\w+)\)\n"
        found = re.fullmatch(expected, done.stderr)
        assert done.returncode == 1 and found and found.group(1) in EXTRA_MODULES, done.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_agent_s_install_alone_records_a_ddp_run(agent_only: Path, proc_runner: ProcRunner, tmp_path: Path) -> None:
    """A 2-rank gloo DDP script under the fresh environment's torchrun, its agent switched on by the
    variable alone, into a collector of the full install (this interpreter's)."""
    collector = start_collector(proc_runner, tmp_path / "store", "--flush-interval", "0.2")
    run, steps = "agent-only", 3
    env = {**OFF_THIS_TREE, "RANKSCOPE_ENABLE": "1", "RANKSCOPE_DEBUG": "1", "RANKSCOPE_COLLECTOR": collector.target,
           "RANKSCOPE_RUN_ID": run, "RANKSCOPE_SPOOL_DIR": str(tmp_path / "spool"), "OMP_NUM_THREADS": "1"}  # fmt: skip
    job = proc_runner.start([str(agent_only / "torchrun"), "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "ddp_plain.py"),
                             "--steps", str(steps)], env=env, cwd=tmp_path, name="agent-only-job")  # fmt: skip
    assert job.wait(240) == 0, job.output()
    assert sorted(rank for rank, _ in activations(job)) == ["0", "1"], job.output()
    with Client(collector.target) as client:
        assert {r: e["reason"] for r, e in exits(client, run, 2, tmp_path / "spool").items()} == {0: "normal", 1: "normal"}
        spans = query(client, "SELECT rank, name, step FROM spans WHERE run_id = {run:String}", run)
        assert {(s["rank"], s["name"], s["step"]) for s in spans} == {
            (rank, name, step) for rank in range(2) for name in ("forward", "backward", "grad_sync", "optimizer") for step in range(1, steps + 1)
        }
        reduces = {(r["rank"], r["step"]) for r in collectives(client, run) if r["op"] == "all_reduce"}
        assert reduces == {(rank, step) for rank in range(2) for step in range(1, steps + 1)}
