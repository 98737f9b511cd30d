"""The agent in a real training run whose collector is missing at first.

The job is started with the agent on and no collector listening; a collector comes up mid-run.
Training must not wait for it (steps while it is down are as fast as after), and everything
recorded while it was down must arrive, exactly once, from the spool (replayed by the agents, and
by `rankscope spool replay` for what they left at exit).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import pytest

from conftest import ProcRunner, free_port

from rankscope.collector.client import Client

pytestmark = pytest.mark.slow

STEPS = 60  # the collector comes up a few seconds in: at 0.1-0.5 s a step, enough steps are left after it
TRAIN = [sys.executable, "-m", "rankscope.cli.main", "train", "--tp", "1", "--pp", "2", "--dp", "2", "--layers", "2",
         "--hidden", "256", "--heads", "4", "--seq", "128", "--vocab", "512", "--micro-batch", "2", "--global-batch", "8",
         "--steps", str(STEPS)]  # fmt: skip


@pytest.mark.foreground  # step times with the collector down and up, compared
@pytest.mark.timeout(400)
def test_collector_started_mid_run_gets_everything_once(proc_runner: ProcRunner, tmp_path: Path) -> None:
    port = free_port()
    metrics = tmp_path / "metrics.jsonl"
    env = {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": f"127.0.0.1:{port}", "RANKSCOPE_RUN_ID": "mid-run",
           "RANKSCOPE_SPOOL_DIR": str(tmp_path / "spool"), "RANKSCOPE_HEARTBEAT_S": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip
    train = proc_runner.start([*TRAIN, "--metrics-json", str(metrics)], env=env, name="train")
    _wait_for_step(metrics, 3, train)
    collector = proc_runner.start(
        [sys.executable, "-m", "rankscope.cli.main", "collector", "--store", str(tmp_path / "store"),
         "--listen", f"127.0.0.1:{port}", "--flush-interval", "0.3", "--no-diagnosis"],
        name="collector",
    )  # fmt: skip
    collector.wait_for("listening on", 60)
    up_at_step = _last_step(metrics)
    assert train.wait(300) == 0, train.output()
    assert "Traceback" not in train.stderr, train.output()

    times = {line["step"]: line["step_time_s"] for line in map(json.loads, metrics.read_text().splitlines())}
    down = [times[s] for s in range(2, up_at_step + 1)]  # step 1 pays for start-up
    up = [times[s] for s in range(up_at_step + 1, STEPS + 1)]
    assert len(down) >= 2 and len(up) >= 5, f"the collector came up at step {up_at_step} of {STEPS}: lengthen the run"
    assert statistics.median(down) < 1.5 * statistics.median(up), times  # no waiting for the collector

    # Ranks flush for a few seconds at exit; what a busy machine did not send by then stays in the
    # spool for the next agent on the host, or for `rankscope spool replay`, as documented.
    replay = proc_runner.start([sys.executable, "-m", "rankscope.cli.main", "spool", "replay", str(tmp_path / "spool"),
                                "--collector", f"127.0.0.1:{port}"], name="replay")  # fmt: skip
    assert replay.wait(120) == 0, replay.output()
    with Client(f"127.0.0.1:{port}") as client:
        _wait_until(lambda: _count(client, "exits") >= 4, 60, lambda: client.query(
            "SELECT rank, reason, message FROM exits WHERE run_id = 'mid-run'", {}).to_pylist())  # every rank's last word
        per_rank = client.query(
            "SELECT rank, uniqExact(step) AS steps, count() AS spans, "
            "uniqExact(step, name, microbatch, attributes, start_time) AS distinct_spans "
            "FROM spans WHERE run_id = 'mid-run' AND step > 0 GROUP BY rank ORDER BY rank", {}
        ).to_pylist()
        registered = client.query("SELECT DISTINCT rank, pid FROM ranks WHERE run_id = 'mid-run' ORDER BY rank", {}).to_pylist()
    assert [r["rank"] for r in per_rank] == [0, 1, 2, 3]
    for r in per_rank:
        assert r["steps"] == STEPS, r  # the steps recorded while the collector was down arrived too
        assert r["spans"] == r["distinct_spans"], r  # and none twice
    # Exactly the training ranks registered: four ranks, four processes, not the launcher's.
    assert sorted({r["rank"] for r in registered}) == [0, 1, 2, 3]
    assert train.pid not in {r["pid"] for r in registered}
    assert not list((tmp_path / "spool").glob("*.seg")), "everything spooled was acknowledged"


def _count(client: Client, table: str) -> int:
    return client.query(f"SELECT count() AS n FROM {table} WHERE run_id = 'mid-run'", {})["n"][0].as_py()


def _last_step(metrics: Path) -> int:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def _wait_for_step(metrics: Path, step: int, proc: object) -> None:
    deadline = time.monotonic() + 180
    while _last_step(metrics) < step:
        assert proc.returncode is None, proc.output()  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "training did not reach the step"
        time.sleep(0.2)


def _wait_until(condition: object, timeout_s: float, state: object) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out; found {state()}"  # type: ignore[operator]
        time.sleep(0.3)
