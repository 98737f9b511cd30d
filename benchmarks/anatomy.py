"""Step anatomy at scale: one step of 12,288 ranks, and a whole 1,000-step run of 1,024 ranks.

    python benchmarks/anatomy.py [--tp 8 --pp 16 --dp 96] [--microbatches 8] [--repeats 5]
                                 [--run-tp 8 --run-pp 8 --run-dp 16] [--run-steps 1000] [--run-microbatches 4]

The rows are the scale simulator's full timelines (rankscope/harness/simulate: every span and every
collective of every rank, as a real agent records them, with a straggler injected), written
straight into one embedded store (chDB) by ``rankscope/harness/simulate/anatomy_rows.py``, then read as
``rankscope anatomy --store`` reads them (a StoreReader: the read-only guard, limits, a connection
per query):

(a) TP x PP x DP ranks (12,288 by default), three steps: the anatomy of the middle one, its
    breakdown, its critical path (with the costs of its links) and the waterfall; first call and the
    median of ``--repeats``; and what the straggler costs against what it really added (the
    simulator's same step without it);
(b) a run of RUN_TP x RUN_PP x RUN_DP ranks (1,024) and ``--run-steps`` steps: the breakdown of every
    step (one statement per ``CHUNK_RANK_STEPS`` rank-steps), the critical path of its median step.

Prints one markdown table. The store is removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rankscope.collector.anatomy import anatomy, breakdown, critical_path, waterfall

from rankscope.harness.simulate import anatomy_rows
from rankscope.collector.anatomy.categories import CHUNK_RANK_STEPS
from rankscope.collector.client import StoreReader
from rankscope.harness.simulate import topology
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.migrations import migrate
from store import settle  # benchmarks/store.py: this script runs from benchmarks/

STEP_TIME_S = 2.0


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """(first call's seconds, median of the ``repeats`` after it, the last result)."""
    started = time.perf_counter()
    result = fn()
    first = time.perf_counter() - started
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - started)
    return first, statistics.median(seconds) if seconds else first, result


def rows(store: EmbeddedStore, run_id: str) -> int:
    n = 0
    for table in ("spans", "collectives"):
        n += store.query_arrow(f"SELECT count() AS n FROM {table} WHERE run_id = {{run:String}}", {"run": run_id})["n"][0].as_py()
    return int(n)


def accuracy(query: Any, topo: Any, microbatches: int, run_id: str, step: Any, rank: int, where: str) -> tuple[str, str, str]:
    """A row: the straggler's cost on the critical path of ``step`` against what it really added (the simulator's
    same step without it)."""
    path = critical_path(query, run_id, step.number)
    assert path is not None
    clean = anatomy_rows.model(topo, microbatches=microbatches, step_time_s=STEP_TIME_S).step(step.number, step.start_ns)
    added = (step.duration_ns - clean.duration_ns) / 1e6
    cost = path.cost_of([rank]) / 1e6
    return (f"(a) 1.3x straggler {where} (rank {rank}): its cost on the path vs the step time it added",
            f"cost {cost:.1f} ms, added {added:.1f} ms", f"{(cost - added) / added:+.0%}" if added else "n/a")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--dp", type=int, default=96)
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step in (a)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each measurement in (a) after the first")
    parser.add_argument("--run-tp", type=int, default=8)
    parser.add_argument("--run-pp", type=int, default=8)
    parser.add_argument("--run-dp", type=int, default=16)
    parser.add_argument("--run-steps", type=int, default=1000)
    parser.add_argument("--run-microbatches", type=int, default=4, help="micro-batches per step in (b)")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="rankscope-bench-anatomy-"))
    store = EmbeddedStore(tmp / "store")
    try:
        migrate(store, store.database, None)
        reader = StoreReader(store)
        query = lambda sql, params: reader.query(sql, params)
        print(f"store: {store.describe()}\n")
        table: list[tuple[str, str, str]] = []

        # (a) one step of TP x PP x DP ranks, a straggler in the last stage (the pipeline's slowest: the
        # simulator's last stage also computes the loss), so that its excess sets the step's length
        topo = topology.build(args.tp, args.pp, args.dp)
        last_stage = topo.world_size - topo.tp * topo.dp + 3
        model = anatomy_rows.model(topo, microbatches=args.microbatches, step_time_s=STEP_TIME_S, stragglers=[(last_stage, 2, 1.3)])
        started = time.perf_counter()
        steps = anatomy_rows.write_run(store, topo, model, range(1, 4), run_id="big", steps_per_insert=1)
        loaded = time.perf_counter() - started
        settle(store)
        world, step = topo.world_size, 2
        n = rows(store, "big")
        table.append((f"(a) store 3 steps of {world:,} ranks (full timelines)", f"{n:,} rows (spans + collectives)", f"{loaded:.1f} s"))
        b_first, b_med, found_b = timed(lambda: breakdown(query, "big", step, step), args.repeats)
        p_first, p_med, path = timed(lambda: critical_path(query, "big", step), args.repeats)
        a_first, a_med, found = timed(lambda: anatomy(query, "big", step, step, path_step=step), args.repeats)
        assert found_b.total is not None and path is not None and found.path is not None
        waterfall(found_b.total)
        table.append((f"(a) breakdown of step {step}", f"{world:,} ranks", f"{b_med * 1e3:.0f} ms (first {b_first * 1e3:.0f} ms)"))
        table.append((f"(a) critical path of step {step} and its costs", f"{len(path.links)} links across {len({k.rank for k in path.links})} ranks",
                      f"{p_med * 1e3:.0f} ms (first {p_first * 1e3:.0f} ms)"))  # fmt: skip
        table.append((f"(a) anatomy of step {step}: all three", "breakdown, path, waterfall", f"{a_med * 1e3:.0f} ms (first {a_first * 1e3:.0f} ms)"))
        table.append(accuracy(query, topo, args.microbatches, "big", steps[1], last_stage, "in the last stage"))
        # the same 1.3x straggler where the pipeline has slack (stage pp/4): the first-order cost overstates
        early = topo.world_size // 4 + 3
        slack = anatomy_rows.model(topo, microbatches=args.microbatches, step_time_s=STEP_TIME_S, stragglers=[(early, 2, 1.3)])
        slack_steps = anatomy_rows.write_run(store, topo, slack, range(1, 4), run_id="slack", steps_per_insert=1)
        settle(store)
        table.append(accuracy(query, topo, args.microbatches, "slack", slack_steps[1], early, f"in stage {args.pp // 4}, with slack"))

        # (b) a whole run
        run_topo = topology.build(args.run_tp, args.run_pp, args.run_dp)
        run_model = anatomy_rows.model(run_topo, microbatches=args.run_microbatches, step_time_s=STEP_TIME_S,
                                    stragglers=[(run_topo.world_size // 2 + 1, args.run_steps // 2, 1.2)])  # fmt: skip
        started = time.perf_counter()
        anatomy_rows.write_run(store, run_topo, run_model, range(1, args.run_steps + 1), run_id="run",
                            steps_per_insert=max(1, 1_000_000 // (run_topo.world_size * 45)))  # fmt: skip
        loaded = time.perf_counter() - started
        waited = settle(store)
        n = rows(store, "run")
        rank_steps = run_topo.world_size * args.run_steps
        table.append((f"(b) store {args.run_steps:,} steps of {run_topo.world_size:,} ranks", f"{n:,} rows",
                      f"{loaded:.0f} s (+ {waited:.0f} s of merges)"))  # fmt: skip
        started = time.perf_counter()
        whole = breakdown(query, "run", 1, args.run_steps)
        b_s = time.perf_counter() - started
        median = whole.median_step()
        assert median is not None
        started = time.perf_counter()
        run_path = critical_path(query, "run", median)
        p_s = time.perf_counter() - started
        assert run_path is not None
        statements = -(-args.run_steps // max(1, CHUNK_RANK_STEPS // run_topo.world_size))
        table.append((f"(b) breakdown of all {args.run_steps:,} steps", f"{rank_steps:,} rank-steps, {statements} statements",
                      f"{b_s:.1f} s ({b_s / args.run_steps * 1e3:.0f} ms per step)"))  # fmt: skip
        table.append((f"(b) critical path of the median step ({median})", f"{len(run_path.links)} links", f"{p_s * 1e3:.0f} ms"))

        print("| what | size | time |")
        print("|---|---|---|")
        for row in table:
            print(f"| {' | '.join(row)} |")
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
