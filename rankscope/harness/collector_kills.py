"""A collector killed with SIGKILL at random moments of a run, restarted each time on the same store.

The run is ``rankscope simulate`` (its ranks send through the agent's real Transport, spooling while
the collector is away and replaying when it is back, and count every row they sent, by kind) or a
real ``rankscope train`` of 8 ranks (tp 2, pp 2, dp 2; a tiny model): each rank's agent, with
``RANKSCOPE_DEBUG=1``, prints at its end the events its Transport took for sending, by kind, and
the launcher replays what the ranks left in their spools. A collector is started on a fixed port
and a fresh store; at seeded random moments of the run it is killed (``kill -9``: no flush, no
goodbye) and started again at once. Once the run has ended and delivered everything, the store's
rows of each kind are counted against what the ranks sent: stored, duplicated (rows stored more
than once: the count less the distinct rows) and lost (sent less distinct), and the live
diagnosis's incidents are read (a healthy run must have none).
Used by ``tests/test_collector_restart.py`` and ``benchmarks/collector_kills.py``.
"""

from __future__ import annotations

import ast
import os
import random
import re
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.agent.spool import leftovers
from rankscope.collector.client import Client
from rankscope.harness.orchestration import CLI, agent_env, free_port, replay_spool, start, stop, wait_for_address

#: what the ranks send and count, by the table each kind is stored in (a simulated run sends no metrics)
TABLES = {"spans": "spans", "collectives": "collectives", "heartbeats": "heartbeats", "step_metrics": "step_metrics",
          "metrics": "metrics", "end": "exits"}  # fmt: skip
#: the runs a collector can be killed under (``Job``)
JOBS = ("simulate", "train")
#: a trained rank's agent's last line with RANKSCOPE_DEBUG=1 (``rankscope.agent.runtime``)
AGENT_SENT = re.compile(r"rankscope agent: rank (\d+) sent (\{.*?\}) events, dropped (\d+)")


@dataclass(frozen=True)
class Job:
    """What runs against the killed collector: its command and environment, and how its own count of
    what it sent (by kind: events, and events dropped) is read from its log."""

    command: list[str]
    env: Mapping[str, str]
    sent: Callable[[str], tuple[dict[str, int], int]]


def simulated(address: str, run_id: str, *, ranks: int, steps: int, step_time_s: float, seed: int) -> Job:
    """``rankscope simulate`` of ``ranks`` ranks (tp 2, pp 2, the rest data-parallel)."""
    command = [*CLI, "simulate", "--ranks", str(ranks), "--tp", "2", "--pp", "2", "--dp", str(ranks // 4), "--steps", str(steps),
               "--step-time", str(step_time_s), "--microbatches", "4", "--collector", address, "--run-id", run_id,
               "--workers", "2", "--heartbeat", "0.25", "--flush", "0.25", "--sample-every", "1", "--seed", str(seed)]  # fmt: skip
    return Job(command, os.environ, lambda log: (_simulated_sent(log), 0))


def trained(address: str, run_id: str, spool: Path, *, steps: int) -> Job:
    """``rankscope train`` of 8 ranks (tp 2, pp 2, dp 2) and a tiny model, its agents sending every
    quarter second and saying at their end what they sent."""
    command = [*CLI, "train", "--nproc", "8", "--tp", "2", "--pp", "2", "--dp", "2", "--layers", "2", "--hidden", "32",
               "--heads", "2", "--seq", "16", "--vocab", "64", "--micro-batch", "2", "--global-batch", "8", "--steps", str(steps),
               "--log-every", "10"]  # fmt: skip
    env = {**agent_env(address, run_id, spool), "RANKSCOPE_DEBUG": "1", "RANKSCOPE_FLUSH_S": "0.25", "RANKSCOPE_HEARTBEAT_S": "0.25"}
    return Job(command, env, lambda log: _trained_sent(log, 8))

#: what a starting collector logs when it found a killed cycle's rows (``store/cycles.py``)
ROLLED_BACK = re.compile(r"rolled back the rows of flush cycles after \d+, never committed: (\{.*?\})")


@dataclass(frozen=True)
class Counted:
    """One table after the run: rows the ranks sent, the rows stored, and how many of them are distinct."""

    table: str
    sent: int
    stored: int
    distinct: int

    @property
    def duplicated(self) -> int:
        return self.stored - self.distinct

    @property
    def lost(self) -> int:
        return self.sent - self.distinct


@dataclass
class Outcome:
    """A run with kills: when the collector was killed (seconds into the run), the counts, the incidents."""

    run_id: str
    kills_s: list[float] = field(default_factory=list)
    counted: list[Counted] = field(default_factory=list)
    incidents: list[str] = field(default_factory=list)
    #: the run's exit status
    rc: int | None = None
    #: per restart that found a killed cycle's rows: rows rolled back by table (the kill fell inside a cycle)
    rolled_back: list[dict[str, int]] = field(default_factory=list)
    #: events the ranks' agents dropped themselves (spool full): not the collector's to store
    dropped: int = 0
    #: spool segments a trained run's launcher could not deliver (a collector too slow to answer),
    #: sent afterwards with ``rankscope spool replay`` before the rows were counted
    left: int = 0


def run_with_kills(
    workdir: Path, *, kills: int, seed: int, job: str = "simulate", ranks: int = 8, steps: int = 30, step_time_s: float = 0.5
) -> Outcome:
    """Run ``job`` (one of ``JOBS``: ``ranks`` simulated ranks, or 8 trained ones) against a collector
    killed ``kills`` times once the run has registered, each a random (seeded) 1-4 s after it came up;
    see the module doc."""
    rng = random.Random(seed)
    port = free_port()
    address = f"127.0.0.1:{port}"
    outcome = Outcome(run_id=f"kills-{job}-{seed}")
    if job == "train":
        run = trained(address, outcome.run_id, workdir / "spool", steps=steps)
    else:
        run = simulated(address, outcome.run_id, ranks=ranks, steps=steps, step_time_s=step_time_s, seed=seed)
    collector = _collector(workdir, address, 0)
    running = start(run.command, workdir / f"{job}.log", run.env)
    try:
        with Client(address) as client:  # the run's moments: from its first registration on
            _wait_for(client, outcome.run_id, "ranks", 1, 300)
        began = time.monotonic()
        for n in range(1, kills + 1):
            time.sleep(rng.uniform(1.0, 4.0))
            if running.poll() is not None:
                raise RuntimeError(f"the run ended before kill {n}: lengthen it ({steps} steps)")
            collector.kill()
            collector.wait()
            outcome.kills_s.append(round(time.monotonic() - began, 2))
            collector = _collector(workdir, address, n)
        outcome.rc = running.wait(steps * step_time_s + 600)
        sent, outcome.dropped = run.sent((workdir / f"{job}.log").read_text(errors="replace"))
        outcome.left = len(leftovers(workdir / "spool")) if (workdir / "spool").is_dir() else 0
        replay_spool(workdir / "spool", address, workdir / "replay.log")
        with Client(address) as client:
            _wait_for(client, outcome.run_id, "exits", sent.get("end", 0), 120)  # the spools are replayed by then (the ends come last)
            time.sleep(1.0)  # the last flush cycle
            outcome.counted = [_count(client, outcome.run_id, table, sent.get(kind, 0)) for kind, table in TABLES.items() if sent.get(kind)]
            rows = client.query("SELECT summary FROM incidents FINAL WHERE run_id = {run:String}", {"run": outcome.run_id})
            outcome.incidents = rows["summary"].to_pylist()
    finally:
        stop(running, 5)
        stop(collector, 15)
    logs = (workdir / f"collector-{n}.log" for n in range(len(outcome.kills_s) + 1))
    outcome.rolled_back = [ast.literal_eval(found) for log in logs for found in ROLLED_BACK.findall(log.read_text(errors="replace"))]
    return outcome


def table(outcomes: list[Outcome]) -> str:
    """The counts of every table over ``outcomes``, one line each, summed (Markdown)."""
    lines = ["| table | sent | stored | duplicated | lost |", "| --- | ---: | ---: | ---: | ---: |"]
    for name in TABLES.values():
        rows = [c for o in outcomes for c in o.counted if c.table == name]
        sums = [sum(getattr(c, f) for c in rows) for f in ("sent", "stored", "duplicated", "lost")]
        lines.append(f"| {name} | " + " | ".join(f"{v:,}" for v in sums) + " |")
    hits = [r for o in outcomes for r in o.rolled_back]
    kills = sum(len(o.kills_s) for o in outcomes)
    lines.append(f"\n{kills} kills, {len(hits)} of them inside a flush cycle: {sum(sum(r.values()) for r in hits):,} rows rolled back at restart")
    return "\n".join(lines)


def _collector(workdir: Path, address: str, n: int) -> subprocess.Popen[bytes]:
    log = workdir / f"collector-{n}.log"
    proc = start(
        [*CLI, "collector", "--store", str(workdir / "store"), "--listen", address, "--flush-interval", "0.2"], log, os.environ
    )
    try:
        wait_for_address(proc, log, 120)
    except BaseException:  # not up in time, or the caller interrupted: it is nobody's to stop otherwise
        stop(proc, 5)
        raise
    return proc


def _simulated_sent(log: str) -> dict[str, int]:
    """The simulator's own count of what it sent, by kind (its ``done:`` line)."""
    found = re.search(r"^done: .*?events (\{.*?\})", log, re.M)
    if found is None:
        raise RuntimeError(f"the simulation did not finish:\n{log[-2000:]}")
    return ast.literal_eval(found.group(1))


def _trained_sent(log: str, ranks: int) -> tuple[dict[str, int], int]:
    """What the trained ranks' agents said they sent, summed over the ranks (each says it once), and dropped."""
    said = {int(rank): (ast.literal_eval(sent), int(dropped)) for rank, sent, dropped in AGENT_SENT.findall(log)}
    if sorted(said) != list(range(ranks)):
        raise RuntimeError(f"{len(said)} of {ranks} ranks said what they sent:\n{log[-2000:]}")
    total: Counter[str] = Counter()
    for sent, _ in said.values():
        total.update(sent)
    return dict(total), sum(dropped for _, dropped in said.values())


def _wait_for(client: Client, run_id: str, table: str, rows: int, timeout_s: float) -> None:
    """Until ``table`` holds ``rows`` rows of the run, or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while _rows(client, run_id, table) < rows and time.monotonic() < deadline:
        time.sleep(0.5)


def _rows(client: Client, run_id: str, table: str) -> int:
    return int(client.query(f"SELECT count() AS n FROM {table} WHERE run_id = {{run:String}}", {"run": run_id})["n"][0].as_py())


def _count(client: Client, run_id: str, table: str, sent: int) -> Counted:
    distinct = f"SELECT count() AS n FROM (SELECT DISTINCT * EXCEPT (cycle) FROM {table} WHERE run_id = {{run:String}})"
    return Counted(table, sent, _rows(client, run_id, table), int(client.query(distinct, {"run": run_id})["n"][0].as_py()))
