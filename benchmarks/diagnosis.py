"""Diagnosis, right and fast: 8 real ranks, then 12,288 simulated ones.

    python benchmarks/diagnosis.py [--skip-scenarios] [--tp 8 --pp 16 --dp 96] [--batches-per-s 300] [--step-time 2]

(a) every built-in fault scenario (rankscope/harness/local_scenarios.py) on a real 8-rank training run
    with the agent and a real collector: passed (right kind, rank and host, nothing else), seconds
    and steps from the fault to the incident;
(b) one ``rankscope simulate`` run of TP x PP x DP ranks (12,288 by default) against one real
    collector, a straggler injected early and a hang later: the rank and host each incident
    names, when the live diagnosis first wrote it (straggler: after the fault began; hang: after
    the hang threshold), what the collector took in; then, over the stored run (the collector
    restarted without its own diagnosis, so nothing else runs), each detector's pass through a
    collector client, median of ``--repeats``; with ``--baseline DIR``, the same run first against
    the collector of the source tree DIR (``git archive COMMIT | tar -x -C DIR``), side by side.

Prints one markdown table per part. Every process it starts is stopped, the stores are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from rankscope.harness.local_scenarios import FAULT_START_SQL
from rankscope.harness.orchestration import CLI, free_port, postmortem, start, start_collector, stop

STRAGGLER = (3000, 1.3, 4)  # rank, factor, from step
HANG_RANK = 7777
HANG_AFTER_S = 30.0
FIRST_WRITTEN_SQL = (
    "SELECT kind, ranks, hosts, any(summary) AS summary, toUnixTimestamp64Nano(min(first_seen)) AS first_seen_ns, "
    "toInt64(min(version)) AS written_ns FROM incidents WHERE run_id = {run:String} GROUP BY kind, ranks, hosts"
)


def scenarios_table(log: Callable[[str], None]) -> list[str]:
    """(a): every built-in scenario, in order."""
    from rankscope.harness import local_scenarios as scenarios

    rows = ["| scenario | fault | passed | seconds to detect | steps to detect |", "|---|---|---|---|---|"]
    for scenario in scenarios.SCENARIOS.values():
        score = scenarios.run(scenario, log=log)
        log(score.line())
        seconds = f"{score.seconds_to_detect:.1f}" if score.seconds_to_detect is not None else "-"
        steps = str(score.steps_to_detect) if score.steps_to_detect is not None else "-"
        rows.append(f"| {scenario.name} | {scenario.inject or 'none'} | {'yes' if score.passed else 'NO'} | {seconds} | {steps} |")
    return rows


def wait_for_incidents(client: object, run_id: str, timeout_s: float, sim: subprocess.Popen[bytes], sim_log: Path,
                       lags: list[Lag], log: Callable[[str], None]) -> list[dict]:  # fmt: skip
    """Poll until a straggler and a hang naming the injected ranks are written (or time runs out).

    Every 15 s, the simulator's latest progress line, how far behind the collector was with each
    kind of ``lags`` since the last line, and the incidents so far.
    """
    deadline, shown = time.monotonic() + timeout_s, 0.0
    while time.monotonic() < deadline and sim.poll() is None:
        found = client.query(FIRST_WRITTEN_SQL, {"run": run_id}).to_pylist()  # type: ignore[attr-defined]
        named = {(i["kind"], tuple(i["ranks"])) for i in found}
        if {("straggler", (STRAGGLER[0],)), ("hang", (HANG_RANK,))} <= named:
            for lag in lags:
                lag.sample()
            return found
        if time.monotonic() - shown >= 15:
            shown = time.monotonic()
            last = (sim_log.read_text(errors="replace").splitlines() or ["starting"])[-1]
            behind = "; ".join(f"{lag.kind} {lag.sample()}" for lag in lags)
            log(f"{last}; {behind}; incidents so far: {sorted(f'{k} {list(r)[:4]}' for k, r in named) or 'none'}")
        time.sleep(1.0)
    for lag in lags:
        lag.sample()
    return client.query(FIRST_WRITTEN_SQL, {"run": run_id}).to_pylist()  # type: ignore[attr-defined]


class Lag:
    """How far behind the collector was with one payload kind, interval by interval: the mean seconds
    from the agents' send to the receipt (``rankscope_delivery_seconds``) and from the receipt to the
    store (``rankscope_store_seconds``) of the batches stored since the last sample."""

    def __init__(self, metrics_url: str, kind: str):
        self.url, self.kind = metrics_url, kind
        self._last = {"delivery": (0.0, 0.0), "store": (0.0, 0.0)}
        self.samples: list[tuple[float, float, int]] = []  # (delivery mean s, store mean s, batches) per interval

    def sample(self) -> str:
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.url, timeout=30).read().decode()
        now: dict[str, tuple[float, float]] = {}
        for family in text_string_to_metric_families(text):
            stage = {"rankscope_delivery_seconds": "delivery", "rankscope_store_seconds": "store"}.get(family.name)
            if stage:
                mine = {x.name.rsplit("_", 1)[1]: x.value for x in family.samples if x.labels.get("kind") == self.kind and "le" not in x.labels}
                now[stage] = (mine.get("sum", 0.0), mine.get("count", 0.0))
        means = {}
        for stage, (total, count) in now.items():
            was_total, was_count = self._last[stage]
            means[stage] = (total - was_total) / (count - was_count) if count > was_count else float("nan")
        batches = int(now.get("store", (0, 0))[1] - self._last["store"][1])
        self._last.update(now)
        self.samples.append((means.get("delivery", float("nan")), means.get("store", float("nan")), batches))
        if not batches:
            return "none stored"
        return f"{batches} batches, {means.get('delivery', float('nan')):.1f} s on the way + {means.get('store', float('nan')):.1f} s to the store"

    def row(self) -> str:
        """The samples as one table row: delivery + store seconds of each interval."""
        series = ", ".join(f"{d:.1f}+{st:.1f}" for d, st, n in self.samples if n)
        return f"| the collector's lag with the {self.kind}, every 15 s (mean s from the send to the receipt + to the store) | {series or 'none'} |"


def scale_table(args: argparse.Namespace, work: Path, log: Callable[[str], None]) -> list[str]:
    """(b): one simulated run with a straggler and a hang, then each detector's pass over it; with
    ``--baseline``, the same run against the baseline tree's collector first, side by side."""
    from rankscope.harness.simulate.plan import Cadence

    run_id = f"bench-{args.tp * args.pp * args.dp}"
    silent_after = 3 * Cadence.for_world(args.tp * args.pp * args.dp, args.batches_per_s).heartbeat_s
    store = work / "store"
    if args.via == "both":  # the same run direct first, then through relays (whose store the passes below read)
        direct = _live_rows(args, work / "direct" / "store", work / "direct", log, via="direct")
        rows = _side_by_side(direct, _live_rows(args, store, work, log, via="relay"), "direct", "through relays")
    else:
        rows = _live_rows(args, store, work, log, via=args.via)
    if args.baseline is not None:
        base = _live_rows(args, work / "baseline" / "store", work / "baseline", log, tree=args.baseline)
        rows = _side_by_side(base, rows, f"baseline ({args.baseline})")
    offline: list[str] = []
    # Each detector over the stored run, nothing else running: the collector again, without diagnosis.
    # Without the query limits: the live diagnosis reads the store directly, this client reads a
    # million rows and more at 100,000 ranks (the straggler's window).
    collector, address = start_collector(store, work / "collector-2.log", "--no-diagnosis", "--nice", "0",
                                         "--query-max-rows", str(10**10), "--query-max-bytes", str(2**40))  # fmt: skip
    try:
        offline += _pass_rows(address, run_id, silent_after, args.repeats)
    finally:
        stop(collector, 60)
    collector, address = start_collector(store, work / "collector-3.log", "--no-diagnosis", "--nice", "0")  # its default read limits
    try:
        offline.append(_postmortem_row(address, run_id, silent_after))
    finally:
        stop(collector, 60)
    if args.baseline is not None:  # the offline passes are this tree's code over this tree's run
        offline = [row.replace(" | ", " | - | ", 1) for row in offline]
    return rows + offline


def _live_rows(args: argparse.Namespace, store: Path, work: Path, log: Callable[[str], None], tree: Path | None = None,
               via: str = "direct") -> list[str]:  # fmt: skip
    """The simulated run (its ranks sending ``via`` direct or relay) against a collector on ``store`` (of the
    source tree ``tree``, else this one) with its live diagnosis: what it took in and named, the collector's
    CPU, and how long its passes took (a table with its header)."""
    from rankscope.collector.client import Client
    from rankscope.harness.simulate.plan import Cadence

    world = args.tp * args.pp * args.dp
    cadence = Cadence.for_world(world, args.batches_per_s)
    # A rank's data arrives once per flush interval: the hang comes after the straggler's first flush.
    hang_step = int(cadence.flush_s / args.step_time) + 15
    silent_after = 3 * cadence.heartbeat_s
    run_id = f"bench-{world}"
    # The cadence the published numbers were measured with (the defaults were 1 s and 2 s then), and
    # full priority: the simulator stands in for a cluster, the collector for a machine of its own.
    metrics_port = free_port()
    with _collector_from(tree):
        collector, address = start_collector(store, work / "collector.log", "--hang-after", str(HANG_AFTER_S),
                                             "--silent-after", f"{silent_after:.0f}", "--flush-interval", "1",
                                             "--diagnose-every", "2", "--nice", "0", "--metrics-port", str(metrics_port))  # fmt: skip
    inject = f"straggler:rank={STRAGGLER[0]},factor={STRAGGLER[1]},from_step={STRAGGLER[2]};hang:rank={HANG_RANK},step={hang_step}"
    sim_log = work / "simulate.log"
    cpu_before, wall_before = _tree_cpu_s(collector.pid), time.monotonic()
    sim = start([*CLI, "simulate", "--tp", str(args.tp), "--pp", str(args.pp), "--dp", str(args.dp), "--steps", str(hang_step + 20),
                 "--step-time", str(args.step_time), "--sample-every", str(args.sample_every), "--inject", inject, "--collector", address, "--run-id", run_id,
                 "--batches-per-s", str(args.batches_per_s), "--hold", "900", "--via", via], sim_log, os.environ)  # fmt: skip
    log(f"(b) simulating {world:,} ranks via {via}, {inject}; collector {address}, hang after {HANG_AFTER_S:g} s, silent after {silent_after:.0f} s")
    client = Client(address, timeout_s=300)
    lags = [Lag(f"http://127.0.0.1:{metrics_port}/metrics", kind) for kind in ("heartbeats", "spans")]
    try:
        found = wait_for_incidents(client, run_id, hang_step * args.step_time + 600, sim, sim_log, lags, log)
        cpu_per_s = (_tree_cpu_s(collector.pid) - cpu_before) / (time.monotonic() - wall_before)
        sim_cpu_per_s = _tree_cpu_s(sim.pid) / (time.monotonic() - wall_before)
        straggler_start = client.query(FAULT_START_SQL, {"run": run_id, "step": STRAGGLER[2]}).to_pylist()[0]["ns"]
        live_passes = _live_passes(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        client.close()
        stop(sim, 30)  # SIGTERM: the workers stop and print their totals
        stop(collector, 60)
    log(sim_log.read_text(errors="replace").splitlines()[-1])
    rows = ["| measure | value |", "|---|---|"]
    rows += _ingest_rows(sim_log.read_text(errors="replace"), world, cadence)
    rows += _incident_rows(found, straggler_start)
    rows += live_passes
    rows.append(f"| the collector's CPU seconds per second of the run, until both incidents were written | {cpu_per_s:.2f} |")
    # the cluster it stands for, on the same cores: through relays, a call per host and kind to a relay
    rows.append(f"| the simulator's CPU seconds per second meanwhile (its workers, and its relays) | {sim_cpu_per_s:.2f} |")
    return rows + [lag.row() for lag in lags]


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and the processes below it (their reaped children included), from /proc."""
    stats = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(path.parent.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))  # ppid; utime stime cutime cstime
    tree: set[int] = {pid}
    for _ in range(8):  # a few levels: the collector and whatever it starts
        tree |= {p for p, (ppid, _) in stats.items() if ppid in tree}
    return sum(stats[p][1] for p in tree if p in stats) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _collector_from(tree: Path | None) -> Iterator[None]:
    """Processes started inside run the code of the source tree ``tree`` (``git archive COMMIT | tar -x -C
    tree``) by their PYTHONPATH; None: this tree's."""
    before = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = str(tree.resolve())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def _side_by_side(base: list[str], this: list[str], base_name: str, this_name: str = "this tree") -> list[str]:
    """Two "| measure | value |" tables as one, a column each, measures in the order they first appear."""
    values: dict[str, list[str]] = {}
    for column, table in enumerate((base, this)):
        for row in table[2:]:
            measure, value = row.strip("| ").split(" | ", 1)
            values.setdefault(measure, ["-", "-"])[column] = value
    return [f"| measure | {base_name} | {this_name} |", "|---|---|---|", *(f"| {m} | {b} | {t} |" for m, (b, t) in values.items())]


def _postmortem_row(address: str, run_id: str, silent_after: float) -> str:
    """`rankscope diagnose --format json` over the stored run through a collector with its default read
    limits (a million rows a read): its time, and what it said beside the live incidents."""
    started = time.perf_counter()
    found = postmortem(address, run_id, "--hang-after", str(HANG_AFTER_S), "--silent-after", f"{silent_after:.0f}")
    seconds = time.perf_counter() - started
    said = "; ".join(f"{i['kind']} {i['ranks'][:4]} {i['status']} ({i['seen']})" for i in found.incidents) or found.error or "no incident"
    return f"| rankscope diagnose --format json after the run, through a collector with its default read limits | {seconds:.0f} s: {said} |"


def _live_passes(metrics_url: str) -> list[str]:
    """How many live passes the collector made and how long they took (mean, and the bucket of the
    slowest), the whole pass and each detector in it: a table row each."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    rows = []
    for family, label, what in (("rankscope_diagnosis_pass_seconds", "lane", "live diagnosis passes of the {} lane while it ran"),
                                ("rankscope_detector_seconds", "detector", "live: {} in those passes"),
                                ("rankscope_store_seconds", "kind", "acknowledgement of the {} batches: from their receipt to their ack, once stored")):  # fmt: skip
        samples = families[family].samples
        for name in sorted({x.labels[label] for x in samples if label in x.labels}):
            mine = [x for x in samples if x.labels.get(label) == name]
            rows.append(f"| {what.format(name)} ({family}) | {_histogram(mine)} |")
    return rows


def _histogram(samples: list) -> str:
    values = {(x.name.rsplit("_", 1)[-1], x.labels.get("le")): x.value for x in samples}
    count = values[("count", None)]
    if not count:
        return "none"
    slowest = min(float(le) for (part, le), n in values.items() if part == "bucket" and n >= count)
    return f"{count:.0f}, {values[('sum', None)] / count:.2f} s on average, the slowest under {slowest:g} s"


def _ingest_rows(sim_output: str, world: int, cadence: object) -> list[str]:
    registered = re.search(r"registered ([\d,]+) ranks in ([\d.]+) s", sim_output)
    done = re.search(r"done: (\d+) steps in ([\d.]+) s; ([\d,]+) batches acknowledged.*events (\{.*\}) \(([\d,]+)/s\)", sim_output)
    rows = [f"| simulated ranks (hosts of 8) | {world:,} |",
            f"| heartbeat / data flush per rank (s) | {cadence.heartbeat_s:.0f} / {cadence.flush_s:.0f} |"]  # type: ignore[attr-defined]  # fmt: skip
    if registered:
        rows.append(f"| registration of every rank | {registered.group(2)} s |")
    if done:
        seconds = float(done.group(2))
        acked = int(done.group(3).replace(",", ""))
        rows.append(f"| batches acknowledged | {acked:,} in {seconds:.0f} s ({acked / seconds:,.0f}/s) |")
        rows.append(f"| events sent (rows, heartbeats) | {done.group(4)}, {done.group(5)}/s over the run |")
    return rows


def _incident_rows(found: list[dict], straggler_start: int | None) -> list[str]:
    rows = []
    for kind, rank in (("straggler", STRAGGLER[0]), ("hang", HANG_RANK)):
        hits = [i for i in found if i["kind"] == kind]
        named = ", ".join(f"ranks {i['ranks']} hosts {i['hosts']}" for i in hits) or "nothing"
        right = [i for i in hits if i["ranks"] == [rank]]
        rows.append(f"| {kind} injected at rank {rank} (node-{rank // 8}): named | {named} |")
        if not right:
            continue
        if kind == "straggler" and straggler_start:
            rows.append(f"| straggler: written after the fault began | {(right[0]['written_ns'] - straggler_start) / 1e9:.0f} s |")
        if kind == "hang":
            threshold = right[0]["first_seen_ns"] + HANG_AFTER_S * 1e9
            rows.append(f"| hang: root written after the {HANG_AFTER_S:g} s threshold | {(right[0]['written_ns'] - threshold) / 1e9:.1f} s |")
    others = [f"{i['kind']} {i['ranks'][:4]}" for i in found if i["kind"] not in ("straggler", "hang")]
    rows.append(f"| other incidents | {', '.join(others) or 'none'} |")
    return rows


def _pass_rows(address: str, run_id: str, silent_after: float, repeats: int) -> list[str]:
    from rankscope.collector.client import Client
    from rankscope.collector.diagnosis import engine, registry
    from rankscope.collector.diagnosis.context import RunContext
    from rankscope.collector.diagnosis.detector import Scan
    from rankscope.common.settings import Settings

    settings = Settings(hang_after_s=HANG_AFTER_S, silent_after_s=silent_after)
    with Client(address, timeout_s=300) as client:
        query = lambda sql, params: client.query(sql, params)  # noqa: E731
        ctx = RunContext.load(run_id, query, settings)
        now_ns = int(ctx.query(engine.LAST_DATA_SQL, {"run": run_id}).to_pylist()[0]["ns"])  # ctx.query binds the attempt
        passes: dict[str, Callable[[], object]] = {
            "run context (ranks, hosts, groups)": lambda: RunContext.load(run_id, query, settings),
            # every registered detector alone, handed nothing heeded (the crash detector then sees no hang)
            **{f"{d.name}.detect": functools.partial(d.detect, Scan(ctx, None, (), lambda: now_ns)) for d in registry.registered()},
            # on the context kept between passes, as the live loop does (a fresh one reads the windows again)
            "diagnose() (all of the above)": lambda: engine.diagnose(run_id, query, settings, now_ns=now_ns, ctx=ctx),
        }
        rows = []
        for name, call in passes.items():
            seconds = []
            for _ in range(repeats):
                started = time.perf_counter()
                call()
                seconds.append(time.perf_counter() - started)
            rows.append(f"| pass over the stored run: {name} | {statistics.median(seconds):.2f} s (median of {repeats}) |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-scenarios", action="store_true", help="only part (b)")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--dp", type=int, default=96)
    parser.add_argument("--batches-per-s", type=float, default=300.0, help="the simulator's budget (default: 300)")
    parser.add_argument("--step-time", type=float, default=2.0, help="the simulated step's seconds (default: 2)")
    parser.add_argument("--sample-every", type=int, default=10, help="every N-th step is sent in full (default: 10)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="(b) also against the collector of the source tree DIR (git archive COMMIT | tar -x -C DIR), side by side")
    parser.add_argument("--via", choices=("direct", "relay", "both"), default="direct",
                        help="(b)'s simulated ranks send directly, through relays (a relay per simulator worker, a host's"
                             " ranks to a batch), or both, one run after the other, side by side (default: direct)")  # fmt: skip
    args = parser.parse_args()
    if args.via == "both" and args.baseline is not None:
        parser.error("--via both compares two runs of this tree: leave out --baseline")
    log = lambda line: print(f"  {line}", file=sys.stderr, flush=True)  # noqa: E731
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every process started is stopped
    work = Path(tempfile.mkdtemp(prefix="rankscope-bench-diagnosis-"))
    started = time.monotonic()
    try:
        tables = [] if args.skip_scenarios else [["(a) 8 real ranks, built-in scenarios", *scenarios_table(log)]]
        tables.append([f"(b) {args.tp * args.pp * args.dp:,} simulated ranks (tp {args.tp} x pp {args.pp} x dp {args.dp})",
                       *scale_table(args, work, log)])  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for title, *rows in tables:
        print(f"\n{title}\n")
        print("\n".join(rows))
    print(f"\n(total {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
