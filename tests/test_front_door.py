"""What a new user meets first, beside the README's own commands (tests/test_docs.py runs those, its fault
drill included, untuned): a collector that stops or freezes under a running job, and the mistakes
everyone makes, each answered in one clear line.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SCRIPTS, ProcRunner, incidents, release_starved, start_collector

from rankscope.agent.spool import leftovers

RUNS_SQL = "SELECT DISTINCT run_id FROM runs"
TINY = ["--nproc", "2", "--tp", "1", "--pp", "1", "--dp", "2", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16",
        "--vocab", "64", "--micro-batch", "2", "--global-batch", "4", "--steps", "3"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rankscope_train_sends_what_its_ranks_left_in_the_spool(proc_runner: ProcRunner, tmp_path: Path) -> None:
    """A collector frozen for the whole job (as a starved one is: it acknowledges nothing in time): the ranks
    train on, spool everything and exit; `rankscope train` sends it once the collector runs again, so the
    run is whole in the store when the command returns."""
    collector = start_collector(proc_runner, tmp_path / "store")
    spool = tmp_path / "spool"
    env = {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": collector.target, "RANKSCOPE_SPOOL_DIR": str(spool)}
    os.killpg(collector.proc.popen.pid, signal.SIGSTOP)
    try:
        training = proc_runner.start([str(Path(sys.executable).parent / "rankscope"), "train", *TINY], env=env, cwd=tmp_path, name="train")
        training.wait_for("sending them to", timeout=300)
        assert "step     3/3 | loss" in training.stdout, training.output()  # the job ran while nothing was acknowledged
        # what the ranks left, as counted before the replay took it (the replay adopts the files at once)
        assert re.search(r"the ranks left [1-9]\d* spool segment file\(s\)", training.stdout), training.output()
    finally:
        os.killpg(collector.proc.popen.pid, signal.SIGCONT)
    assert training.wait(180) == 0, training.output()
    assert re.search(r"rankscope train: replayed [1-9]\d* batches .*; 0 segment file\(s\) left", training.stdout), training.output()
    assert leftovers(spool) == []

    from rankscope.collector.client import Client

    with Client(collector.target) as client:
        status_sql = "SELECT run_id, argMax(status, updated) AS status FROM runs GROUP BY run_id"
        runs, deadline = client.query(status_sql).to_pylist(), time.monotonic() + 30
        while runs and runs[0]["status"] == "running" and time.monotonic() < deadline:  # the status follows the ends' flush
            time.sleep(0.5)
            runs = client.query(status_sql).to_pylist()
        assert [r["status"] for r in runs] == ["finished"], f"{runs}\n{training.output()}"
        run = runs[0]["run_id"]
        steps = client.query("SELECT rank, groupUniqArray(step) AS steps FROM step_metrics WHERE run_id = {run:String} GROUP BY rank "
                             "ORDER BY rank", {"run": run}).to_pylist()  # fmt: skip
        ends = client.query("SELECT rank, reason FROM exits WHERE run_id = {run:String} ORDER BY rank", {"run": run}).to_pylist()
    assert [(r["rank"], sorted(r["steps"])) for r in steps] == [(0, [1, 2, 3]), (1, [1, 2, 3])], steps
    assert [(r["rank"], r["reason"]) for r in ends] == [(0, "normal"), (1, "normal")], ends  # the last words came too


def _nobody_silent_after(proc_runner: ProcRunner, tmp_path: Path, fault: Callable[[int], object]) -> str:
    """A 4-rank DDP job, a step a second, beside a collector (``--silent-after 4``) that ``fault(pid)`` hits
    from outside in the middle of the run (returning once it is over): the job finishes, trains on for
    30 s more, and nobody is named lost, crashed or hung. Returns the job's output."""
    collector = start_collector(proc_runner, tmp_path / "store", "--silent-after", "4", "--diagnose-every", "1")
    env = {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": collector.target, "RANKSCOPE_SPOOL_DIR": str(tmp_path / "spool")}
    stop = tmp_path / "stop"  # the job trains until it sees this file: as long as the fault needs
    job = proc_runner.torchrun([str(SCRIPTS / "ddp_plain.py"), "--steps", "1000", "--pace-s", "1", "--until", str(stop)], 4, env=env)
    collector.proc.wait_for("registered", timeout=120)
    time.sleep(5)  # heard beating
    fault(collector.proc.popen.pid)
    over = time.monotonic()
    time.sleep(30)  # the ranks' probes, then their silence judged
    stop.touch()
    assert job.wait(120) == 0, job.output()

    from rankscope.collector.client import Client
    from rankscope.collector.diagnosis import crash, hang

    with Client(collector.target) as client:
        run = client.query(RUNS_SQL).to_pylist()[0]["run_id"]
    found = incidents(collector.target, run, lambda found, client: time.monotonic() - over > 45, 60)
    # What a collector that cannot listen could get wrong: silence (crash, lost) and a stall (hang). Not the
    # straggler detector, which a busy CI machine has fed a transient 2x on a run's millisecond segments.
    silence = [i for i in found if i["kind"] in (*crash.KINDS, *hang.KINDS)]
    assert silence == [], f"{found}\n{collector.proc.output()}\n{job.output()}"
    return job.output()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_collector_stopped_longer_than_the_silence_bar_names_nobody_lost(proc_runner: ProcRunner, tmp_path: Path) -> None:
    """The collector stopped (SIGSTOP, as a starved one is) for 12 s, three times its --silent-after: the
    ranks' calls wait in its sockets, and once it runs again nobody is named lost, crashed or hung."""

    def stopped(pid: int) -> None:
        os.killpg(pid, signal.SIGSTOP)
        try:
            time.sleep(12)
        finally:
            os.killpg(pid, signal.SIGCONT)

    _nobody_silent_after(proc_runner, tmp_path, stopped)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_coming_back_one_by_one_after_a_collector_starved_past_their_deadline_are_not_lost(
    proc_runner: ProcRunner, starve: Callable[[int, float], Path], tmp_path: Path
) -> None:  # fmt: skip
    """The collector cut to 1% of a core for 40 s, past the agents' 30 s call deadline: they spool and
    probe, and come back one by one, seconds apart, as it catches up (seen: the last 13 s after the
    others, beside CPU hogs). None of them is named lost, crashed or hung while it is on its way back."""
    from rankscope.agent.transport import CALL_TIMEOUT_S

    def starved(pid: int) -> None:
        group = starve(pid, 0.01)
        time.sleep(CALL_TIMEOUT_S + 10)
        release_starved(group)

    output = _nobody_silent_after(proc_runner, tmp_path, starved)
    assert re.search(r"the collector at \S+ is back after [\d.]+ s", output), f"no agent's call outlived its deadline: starve longer\n{output}"

# --- the errors a new user meets: one clear line on stderr, a non-zero exit -------------------------

COLLECTOR_ERRORS = [
    # (command after `rankscope`, exit status, what the one line says)
    (["sql", "DROP TABLE runs"], 2, "refused"),
    (["sql", "INSERT INTO runs (run_id) VALUES ('x')"], 2, "refused"),
    (["diagnose", "--run", "no-such-run"], 2, "no run 'no-such-run' in the store"),
]
PLAIN_ERRORS = [
    (["train", "--bogus"], 2, r"unrecognized arguments: --bogus \(see rankscope train --help\)"),
    (["train", "--nproc", "2", "--inject", "straggler:rank=x,factor=2,from_step=1"], 2, "rank='x' is not a whole number"),
    (["train", "--inject", "wobble:rank=1"], 2, "does not start with a known fault kind"),
    (["train", "--inject", "hang:rank=99,step=2"], 2, "is not a rank of this 8-rank job"),
    (["sql", "--format", "xml", "SELECT 1"], 2, "invalid choice: 'xml'"),
    (["collector", "--flush-interval", "0"], 2, "must be more than 0 seconds"),
    (["diagnose", "--run", "r", "--collector", "127.0.0.1:1"], 1, "cannot reach the collector at 127.0.0.1:1: Connection refused"),
    (["no-such-command"], 2, "invalid choice: 'no-such-command'"),
]


def _one_line(argv: list[str], status: int, says: str, tmp_path: Path, timeout_s: float = 60) -> None:
    import subprocess

    env = {**os.environ, "RANKSCOPE_SPOOL_DIR": str(tmp_path / "spool")}  # not this machine's: diagnose would mention what is left there
    done = subprocess.run([str(Path(sys.executable).parent / "rankscope"), *argv], capture_output=True, text=True,
                          cwd=tmp_path, timeout=timeout_s, stdin=subprocess.DEVNULL, env=env)  # fmt: skip
    lines = done.stderr.splitlines()
    assert done.returncode == status and len(lines) == 1, (done.returncode, done.stdout, done.stderr)
    assert re.search(says, lines[0]) and lines[0].startswith("rankscope"), lines


@pytest.mark.parametrize(("argv", "status", "says"), PLAIN_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_mistake_is_one_clear_line(argv: list[str], status: int, says: str, tmp_path: Path) -> None:
    _one_line(argv, status, says, tmp_path)


def test_the_mistakes_that_need_a_collector_are_one_clear_line(proc_runner: ProcRunner, tmp_path: Path) -> None:
    collector = start_collector(proc_runner, tmp_path / "store")
    for argv, status, says in COLLECTOR_ERRORS:
        _one_line([*argv, "--collector", collector.target], status, says, tmp_path)


@pytest.mark.timeout(120)
def test_a_collector_that_does_not_answer_is_one_clear_line(tmp_path: Path) -> None:
    """A port that accepts connections and never speaks gRPC (a hung collector, a wrong service)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        _one_line(["sql", "--collector", target, "SELECT 1"], 1, f"cannot reach the collector at {target}", tmp_path, timeout_s=90)
