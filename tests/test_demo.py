"""`rankscope demo` for real in a shortened form, and docs/demo.md and the Makefile kept true to it.

The end-to-end test starts the demo (collector, dashboard, an 8-rank run with a straggler), waits
for the straggler's incident, sends Ctrl-C, and checks that the demo exits cleanly, that no
process it started is left, and that the follow-up command it prints reads the kept store.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ProcRunner, free_port

from rankscope.cli import demo as demo_command
from rankscope.cli.main import main
from rankscope.common.processes import alive, process_tree

ROOT = Path(__file__).resolve().parents[1]
EXE = [sys.executable, "-m", "rankscope.cli.main"]


@pytest.mark.slow
@pytest.mark.foreground
@pytest.mark.timeout(300)
def test_demo_runs_reports_the_straggler_and_stops_everything(proc_runner: ProcRunner, tmp_path: Path) -> None:
    store = tmp_path / "store"
    demo = proc_runner.start(
        [*EXE, "demo", "--store", str(store), "--steps", "30", "--inject", "straggler:rank=5,factor=1.5,from_step=3",
         "--listen", "127.0.0.1:0", "--port", str(free_port())],
        env={"TMPDIR": str(tmp_path)}, name="demo",  # its log directory goes under TMPDIR
    )  # fmt: skip
    demo.wait_for("INCIDENT straggler: rank 5 (node-2)", timeout=200)
    raised = next(line for line in demo.stdout.splitlines() if "INCIDENT straggler: rank 5" in line)
    assert "costs 0% " not in raised, raised  # its cost walked on steps every rank had sent (issue 29)
    assert re.search(r"Open http://127\.0\.0\.1:\d+/\?run=demo-\w+", demo.stdout), demo.output()
    tree = process_tree(demo.pid)
    assert len(tree) >= 12, f"expected the demo, collector, dashboard, launcher, torchrun and 8 ranks: {tree}"

    demo.popen.send_signal(signal.SIGINT)  # Ctrl-C
    assert demo.wait(timeout=120) == 0, demo.output()
    assert not alive(tree), f"left running after the demo ended: {alive(tree)}\n{demo.output()}"
    assert "Everything is stopped" in demo.stdout and not demo.stderr, demo.output()

    # The printed follow-up commands work on the store the demo left.
    follow_ups = [shlex.split(line) for line in demo.stdout.splitlines() if line.startswith("  rankscope ")]
    sql = next(cmd for cmd in follow_ups if cmd[1] == "sql")
    done = subprocess.run([*EXE, *sql[1:], "--format", "json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = [(i["kind"], i["ranks"], i["hosts"]) for i in json.loads(done.stdout)]
    assert ("straggler", [5], ["node-2"]) in found, found
    diagnose = next(cmd for cmd in follow_ups if cmd[1] == "diagnose")
    done = subprocess.run([*EXE, *diagnose[1:], "--format", "json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert any(i["kind"] == "straggler" and i["ranks"] == [5] for i in json.loads(done.stdout)), done.stdout


def test_demo_refuses_faults_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "5"]) == 2
    assert main(["demo", "--straggler-rank", "2", "--hang-rank", "2"]) == 2
    assert main(["demo", "--hang-rank", "8"]) == 2
    assert main(["demo", "--inject", "straggler:rank=1"]) == 2
    assert capsys.readouterr().err.count("rankscope demo:") == 4


def test_docs_and_makefile_match_the_demo() -> None:
    """`make demo` runs `rankscope demo` (and nothing else), and every demo flag docs/demo.md names exists."""
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe and recipe.group(1).strip() == "$(VENV)/bin/rankscope demo"
    assert "make demo" in (ROOT / "README.md").read_text()
    section = (ROOT / "docs" / "demo.md").read_text()
    parser = argparse.ArgumentParser()
    demo_command.configure(parser)
    known = set(re.findall(r"--[a-z-]+", parser.format_help()))
    named = set(re.findall(r"`(--[a-z-]+)", section))
    assert named and named <= known, f"docs/demo.md names flags `rankscope demo` lacks: {named - known}"
