"""Live diagnosis as a run grows: the time of a pass at step 100, 1,000 and 10,000 of a 1,024-rank run.

    python benchmarks/diagnosis_growth.py [--tp 8 --pp 4 --dp 32] [--checkpoints 100,1000,10000] [--repeats 4]
                                          [--baseline REV] [--heatmap] [--straggler 1.3]

The run is the scale simulator's (rankscope/harness/simulate), written straight into one embedded store
(chDB) by ``rankscope/harness/simulate/anatomy_rows.py``: every span and collective of every rank, each rank's
step time and heartbeat every step, the last stage's loss, GPU gauges every 5 steps, and a 1.3x
(``--straggler``) straggler from step 30 (so that a pass also finds and costs an incident, as a live one would).

At each checkpoint the run is written up to a few steps short of it and the background merges are
waited for; a first pass warms up what the diagnosis keeps between passes (as the collector's loop
does); then ``--repeats`` times one more step is written and a pass timed: each detector as
``diagnose`` calls it, on the run's context kept between passes, plus the loop's query for the
active runs. The table gives the median of the repeats per checkpoint, and the ratio of the last
checkpoint to the first (flat: 1.0), then the straggler detector's mean and slowest pass, and the
same of a pass right after each timed one, with nothing new stored (most live passes at 100,000 ranks).
``--baseline REV`` times the detectors of another revision (git) on the same store after the same
inserts, each side first in turn, each with its own windows (``WINDOW_MODULES`` of ``REV``) and
state, and counts the passes where the two straggler detectors' findings differ. ``--heatmap`` also times
the dashboard's heat map of the whole job, as it first draws it at that size (the newest 100
steps of the backward segment, a row per host above 1,024 ranks). The store is removed at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

from rankscope.collector.anatomy import path as anatomy_path
from rankscope.harness.simulate import anatomy_rows
from rankscope.collector.diagnosis import crash, engine, gpu, hang, nan, slow_link, straggler
from rankscope.collector.diagnosis.context import RunContext
from rankscope.common.settings import Settings
from rankscope.harness.simulate import topology
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.migrations import migrate
from store import settle  # benchmarks/store.py: this script runs from benchmarks/

RUN = "growth"
STEP_TIME_S = 2.0
STRAGGLER_FROM = 30
DETECTORS = ("active runs", "hang", "crash", "straggler", "nan", "slow_link", "gpu")
HEATMAP = "heat map (dashboard)"


DETECTOR_MODULES = ("engine", "hang", "crash", "straggler", "nan", "slow_link", "gpu")
#: what the detectors keep between passes: a baseline's detectors use its own
WINDOW_MODULES = ("segment_window", "arrivals", "transfer_window")
CURRENT = SimpleNamespace(engine=engine, hang=hang, crash=crash, straggler=straggler, nan=nan, slow_link=slow_link, gpu=gpu, paths={})


def detectors_of(rev: str, into: Path) -> SimpleNamespace:
    """The diagnosis modules of git revision ``rev``, loaded beside this one's (they import what they
    share, the run context and incidents, from this checkout; their windows, ``WINDOW_MODULES``, from
    ``rev`` where it has them)."""
    root = Path(__file__).resolve().parent.parent
    modules: dict[str, ModuleType] = {}
    package = sys.modules.setdefault("rankscope_baseline", ModuleType("rankscope_baseline"))
    package.__path__ = []
    for name in (*WINDOW_MODULES, *DETECTOR_MODULES):
        for folder in ("rankscope/collector/diagnosis", "collector/diagnosis"):  # the layout since session 24, and before it
            shown = subprocess.run(["git", "show", f"{rev}:{folder}/{name}.py"], cwd=root, capture_output=True, text=True)
            if shown.returncode == 0:
                break
        else:
            if name in WINDOW_MODULES:
                continue  # not in that revision: its detectors had none
            raise SystemExit(f"{rev}: no diagnosis module {name}: {shown.stderr.strip()}")
        source = shown.stdout
        for own in (n for n in WINDOW_MODULES if n in modules):
            source = source.replace(f"from rankscope.collector.diagnosis import {own}", f"from rankscope_baseline import {own}")
            source = source.replace(f"rankscope.collector.diagnosis.{own} ", f"rankscope_baseline.{own} ")
        path = into / f"baseline_{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"rankscope_baseline.{name}", path)
        assert spec is not None and spec.loader is not None
        modules[name] = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        setattr(package, name, modules[name])
        spec.loader.exec_module(modules[name])
    return SimpleNamespace(**modules, paths={})


def one_pass(store: EmbeddedStore, ctx: RunContext, now_ns: int, d: SimpleNamespace = CURRENT) -> tuple[dict[str, float], list]:
    """Seconds of each part of one live pass over the run (``diagnose``'s detectors, in its order), by
    the detector modules ``d``, with the critical paths they kept (incidents' costs) as their own
    collector would have kept them: neither side walks a step's path for the other; and the straggler
    detector's findings (each side's the same, or the faster one lost something)."""
    anatomy_path._PATHS = d.paths
    engine, hang, crash, straggler, nan, slow_link, gpu = (getattr(d, n) for n in DETECTOR_MODULES)
    parts: dict[str, Callable[[], object]] = {
        "active runs": lambda: store.query_arrow(engine.ACTIVE_RUNS_SQL, {"recent_s": 60, "now": now_ns}),
        "hang": lambda: hang.detect(ctx),
        "crash": lambda: crash.detect(ctx, now_ns=now_ns),
        "straggler": lambda: straggler.detect(ctx),
        "nan": lambda: nan.detect(ctx),
        "slow_link": lambda: slow_link.detect(ctx),
        "gpu": lambda: gpu.detect(ctx),
    }
    seconds, found = {}, {}
    for name, part in parts.items():
        started = time.perf_counter()
        found[name] = part()
        seconds[name] = time.perf_counter() - started
    return seconds, found["straggler"]


def heat_map_s(store: EmbeddedStore, world_size: int, last_step: int, repeats: int) -> float:
    """Median seconds of the heat map's query as the dashboard first draws it (``data.heat_first_view``)."""
    from streamlit import logger

    logger.set_log_level("error")  # its caches warn once per query function that no app runs them
    from rankscope.dashboard import data

    by, first, last = data.heat_first_view(world_size, last_step)
    sql = data.HEAT_CELLS_SQL + data.HEAT_BY[by]
    params = {"run": RUN, "segment": "backward", "first": first, "last": last}
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        store.query_arrow(sql, params)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--checkpoints", default="100,1000,10000", help="steps at which passes are timed, comma-separated")
    parser.add_argument("--repeats", type=int, default=4, help="timed passes per checkpoint, one more step written before each")
    parser.add_argument("--baseline", metavar="REV", help="also time the detectors of this git revision, side by side")
    parser.add_argument("--heatmap", action="store_true", help="also time the dashboard's heat map of the whole job")
    parser.add_argument("--straggler", type=float, default=1.3, metavar="FACTOR",
                        help="how much slower the straggler computes (1.3: at 12,288 ranks its excess is about the 1%% floor of a step, named in some passes only)")  # fmt: skip
    args = parser.parse_args()
    checkpoints = sorted(int(c) for c in args.checkpoints.split(","))
    if checkpoints[0] <= STRAGGLER_FROM + args.repeats + 10:
        parser.error(f"--checkpoints: the first must be above {STRAGGLER_FROM + args.repeats + 10} (the straggler starts at step {STRAGGLER_FROM})")

    topo = topology.build(args.tp, args.pp, args.dp)
    model = anatomy_rows.model(topo, microbatches=args.microbatches, step_time_s=STEP_TIME_S,
                            stragglers=[(topo.world_size - 5, STRAGGLER_FROM, args.straggler)])  # fmt: skip
    per_insert = max(1, 400_000 // (topo.world_size * 20))
    tmp = Path(tempfile.mkdtemp(prefix="rankscope-bench-growth-"))
    sides = {"this": CURRENT}
    if args.baseline:
        sides[args.baseline] = detectors_of(args.baseline, tmp)
    store = EmbeddedStore(tmp / "store")
    try:
        migrate(store, store.database, None)
        print(f"store: {store.describe()}; {topo.world_size:,} ranks (tp {args.tp}, pp {args.pp}, dp {args.dp})\n", flush=True)
        written, end_ns, ctxs = 0, anatomy_rows.T0, {}
        differ = passes = named = 0
        every: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        idle: dict[str, list[float]] = {side: [] for side in sides}  # the straggler's pass again, nothing new stored
        results: dict[tuple[str, int], dict[str, float]] = {}
        for checkpoint in checkpoints:
            started = time.perf_counter()
            upto = checkpoint - args.repeats
            steps = anatomy_rows.write_run(store, topo, model, range(written + 1, upto + 1), run_id=RUN, start_ns=end_ns,
                                        register=written == 0, steps_per_insert=per_insert, signals=True)  # fmt: skip
            written, end_ns = upto, steps[-1].end_ns
            waited = settle(store, limit_s=600)
            print(f"step {checkpoint}: wrote up to step {upto} in {time.perf_counter() - started:.0f} s, merges {waited:.0f} s", flush=True)
            ctxs = ctxs or {side: RunContext.load(RUN, store.query_arrow, Settings()) for side in sides}  # a side's state its own
            for side, d in sides.items():
                one_pass(store, ctxs[side], end_ns, d)  # what a live pass keeps from the one before
            timings: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
            for repeat in range(args.repeats):
                steps = anatomy_rows.write_run(store, topo, model, range(written + 1, written + 2), run_id=RUN, start_ns=end_ns,
                                            register=False, steps_per_insert=1, signals=True)  # fmt: skip
                written, end_ns = written + 1, steps[-1].end_ns
                # each side first after the insert in turn: the first pass meets its parts unmerged
                found = {}
                for side in list(sides)[:: 1 if repeat % 2 == 0 else -1]:
                    seconds, found[side] = one_pass(store, ctxs[side], end_ns, sides[side])
                    timings[side].append(seconds)
                    every[side].append(seconds)
                for side in sides:
                    idle[side].append(one_pass(store, ctxs[side], end_ns, sides[side])[0]["straggler"])
                passes += 1
                differ += any(found[side] != found["this"] for side in sides)
                named += len(found["this"])
            for side in sides:
                got = {name: statistics.median(t[name] for t in timings[side]) for name in DETECTORS}
                if args.heatmap and side == "this":
                    got[HEATMAP] = heat_map_s(store, topo.world_size, written, args.repeats)
                got["pass"] = statistics.median(sum(t.values()) for t in timings[side])
                results[(side, checkpoint)] = got
                print(f"step {checkpoint} ({side}): pass {got['pass'] * 1e3:.0f} ms  " + "  ".join(f"{n} {got[n] * 1e3:.0f}" for n in DETECTORS),
                      flush=True)  # fmt: skip
        rows_n = sum(store.query_arrow(f"SELECT count() AS n FROM {t} WHERE run_id = {{run:String}}", {"run": RUN})["n"][0].as_py()
                     for t in ("spans", "collectives", "heartbeats", "step_metrics", "metrics"))  # fmt: skip
        first, last = checkpoints[0], checkpoints[-1]
        print(f"\n{rows_n:,} rows at step {written:,}")
        for side in sides:
            taken = [t["straggler"] for t in every[side]]
            print(f"straggler ({side}): mean {statistics.mean(taken) * 1e3:.0f} ms, slowest {max(taken) * 1e3:.0f} ms "
                  f"over {len(taken)} timed passes; with nothing new since the pass before: mean "
                  f"{statistics.mean(idle[side]) * 1e3:.0f} ms, slowest {max(idle[side]) * 1e3:.0f} ms")  # fmt: skip
        if args.baseline:
            print(f"the straggler's findings differ between the sides in {differ} of {passes} timed passes ({named} findings in all)")
        print()
        print("| part of a pass | " + " | ".join(f"step {c:,}" for c in checkpoints) + f" | step {last:,} / step {first:,} |")
        print("|---|" + "---|" * (len(checkpoints) + 1))
        for name in (*DETECTORS, "pass", *([HEATMAP] if args.heatmap else [])):
            for side in sides if name != HEATMAP else ["this"]:
                cells = " | ".join(f"{results[(side, c)][name] * 1e3:.0f} ms" for c in checkpoints)
                ratio = results[(side, last)][name] / max(results[(side, first)][name], 1e-9)
                label = "**whole pass**" if name == "pass" else name
                print(f"| {label}{'' if side == 'this' else f' ({side})'} | {cells} | {ratio:.2f} |")
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
