"""A collector killed with SIGKILL at random moments of a run, restarted each time on the same store.

The run is ``rankscope simulate``: its ranks send through the agent's real Transport (spooling
while the collector is away, replaying when it is back) and count every row they sent, by kind.
A collector is started on a fixed port and a fresh store; at seeded random moments of the run it
is killed (``kill -9``: no flush, no goodbye) and started again at once. Once the run has ended and
delivered everything, the store's rows of each kind are counted against what the ranks sent:
stored, duplicated (rows stored more than once: the count less the distinct rows) and lost (sent
less distinct), and the live diagnosis's incidents are read (a healthy run must have none).
Used by ``tests/test_collector_restart.py`` and ``benchmarks/collector_kills.py``.
"""

from __future__ import annotations

import ast
import os
import random
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.collector.client import Client
from rankscope.harness.orchestration import CLI, free_port, start, stop, wait_for_address

#: what the simulated ranks send and count, by the table each kind is stored in
TABLES = {"spans": "spans", "collectives": "collectives", "heartbeats": "heartbeats", "step_metrics": "step_metrics", "end": "exits"}

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
    simulate_rc: int | None = None
    #: per restart that found a killed cycle's rows: rows rolled back by table (the kill fell inside a cycle)
    rolled_back: list[dict[str, int]] = field(default_factory=list)


def run_with_kills(workdir: Path, *, kills: int, seed: int, ranks: int = 8, steps: int = 30, step_time_s: float = 0.5) -> Outcome:
    """Simulate a run of ``ranks`` ranks (tp 2, pp 2, the rest data-parallel) against a collector
    killed ``kills`` times, each a random (seeded) 1-4 s after it came up; see the module doc."""
    rng = random.Random(seed)
    port = free_port()
    address = f"127.0.0.1:{port}"
    outcome = Outcome(run_id=f"kills-{seed}")
    duration = steps * step_time_s
    collector = _collector(workdir, address, 0)
    simulate = start(
        [*CLI, "simulate", "--ranks", str(ranks), "--tp", "2", "--pp", "2", "--dp", str(ranks // 4), "--steps", str(steps),
         "--step-time", str(step_time_s), "--microbatches", "4", "--collector", address, "--run-id", outcome.run_id,
         "--workers", "2", "--heartbeat", "0.25", "--flush", "0.25", "--sample-every", "1", "--seed", str(seed)],
        workdir / "simulate.log", os.environ,
    )  # fmt: skip
    try:
        began = time.monotonic()
        for n in range(1, kills + 1):
            time.sleep(rng.uniform(1.0, 4.0))
            if simulate.poll() is not None:
                raise RuntimeError(f"the run ended before kill {n}: lengthen it ({steps} steps)")
            collector.kill()
            collector.wait()
            outcome.kills_s.append(round(time.monotonic() - began, 2))
            collector = _collector(workdir, address, n)
        outcome.simulate_rc = simulate.wait(duration + 300)
        sent = _sent((workdir / "simulate.log").read_text(errors="replace"))
        with Client(address) as client:
            _wait_for(client, outcome.run_id, sent.get("end", 0), 120)
            outcome.counted = [_count(client, outcome.run_id, table, sent.get(kind, 0)) for kind, table in TABLES.items()]
            rows = client.query("SELECT summary FROM incidents FINAL WHERE run_id = {run:String}", {"run": outcome.run_id})
            outcome.incidents = rows["summary"].to_pylist()
    finally:
        stop(simulate, 5)
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
    wait_for_address(proc, log, 120)
    return proc


def _sent(log: str) -> dict[str, int]:
    """The simulator's own count of what it sent, by kind (its ``done:`` line)."""
    found = re.search(r"^done: .*?events (\{.*?\})", log, re.M)
    if found is None:
        raise RuntimeError(f"the simulation did not finish:\n{log[-2000:]}")
    return ast.literal_eval(found.group(1))


def _wait_for(client: Client, run_id: str, ends: int, timeout_s: float) -> None:
    """Until every rank's end is stored: the spools are replayed by then (the ends come last)."""
    deadline = time.monotonic() + timeout_s
    while _rows(client, run_id, "exits") < ends and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)  # the last flush cycle


def _rows(client: Client, run_id: str, table: str) -> int:
    return int(client.query(f"SELECT count() AS n FROM {table} WHERE run_id = {{run:String}}", {"run": run_id})["n"][0].as_py())


def _count(client: Client, run_id: str, table: str, sent: int) -> Counted:
    distinct = f"SELECT count() AS n FROM (SELECT DISTINCT * EXCEPT (cycle) FROM {table} WHERE run_id = {{run:String}})"
    return Counted(table, sent, _rows(client, run_id, table), int(client.query(distinct, {"run": run_id})["n"][0].as_py()))
