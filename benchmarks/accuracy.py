"""Diagnosis accuracy over a randomized fault campaign, counted the way Minder, Holmes and Greyhound count.

    python benchmarks/accuracy.py [--trials 16] [--seed 29] [--kinds straggler,hang,...] [--jobs lightning,ddp,...]
                                  [--max-ranks 8] [--replay SEED ...] [--out test-artifacts/accuracy] [--resume]
                                  [--report JSONL]

Each trial (rankscope/harness/campaign.py) is drawn from a seed that reproduces it (``--replay SEED``):
the fault, its rank or host, step and size, the job and the background load; a quarter have no
fault. It runs a real collector and a real job, scores the live diagnosis's stored incidents (open
or closed) and ``rankscope diagnose --run RUN --format json`` afterwards against the truth, and
prints one line per trial. At the end: one table per fault kind, per framework and overall, live
and offline, beside the published figures; the trials as JSONL and a Plotly plot (HTML) in ``--out``.
Ctrl-C stops it and prints the tables of the trials played; ``--resume`` later plays the rest of the
same campaign, keeping the trials already in ``--out`` (a 200-trial campaign takes hours: it can be
played in pieces, each record saying the commit it ran on). ``make accuracy`` installs the Lightning
and Accelerate jobs' packages first (the campaign extra); without them those jobs are left out, said
once. The external faults need root (a test bed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rankscope.common.cmdline import Parser
from rankscope.harness import campaign
from rankscope.harness.campaign_score import PUBLISHED, Tally, Truth, judge, names, table, verdict_of

#: trials of the default campaign: about 20 minutes on 2 busy cores
DEFAULT_TRIALS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help="how many trials to draw and play")
    parser.add_argument("--seed", type=int, default=29, help="the campaign's seed: which trials are drawn")
    parser.add_argument("--kinds", default="", help=f"comma-separated faults to keep, of: {', '.join(campaign.KINDS)} (default: all)")
    parser.add_argument("--jobs", default="", help="comma-separated jobs or frameworks to keep, matched as substrings of "
                        f"the job's name or framework: {', '.join(campaign.JOBS)} (default: all)")  # fmt: skip
    parser.add_argument("--max-ranks", type=int, default=8, help="the largest job (16 adds the 16-rank trainer shapes)")
    parser.add_argument("--replay", type=int, nargs="+", default=[], metavar="SEED", help="play exactly these trial seeds")
    parser.add_argument("--report", type=Path, metavar="JSONL", help="print the tables of trials played before (their trials.jsonl), play none")
    parser.add_argument("--out", type=Path, default=Path("test-artifacts/accuracy"), help="where trials.jsonl and accuracy.html go")
    parser.add_argument("--resume", action="store_true", help="keep the trials played before in --out's trials.jsonl and play only "
                        "the campaign's others (otherwise that file is started afresh)")  # fmt: skip
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := [k for k in kinds if k not in campaign.KINDS]:
        parser.error(f"--kinds: no fault {', '.join(unknown)} (faults: {', '.join(campaign.KINDS)})")
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    args.kinds = kinds
    args.jobs = [j.strip().lower() for j in args.jobs.split(",") if j.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        records = [rescored(json.loads(line)) for line in args.report.read_text().splitlines() if line.strip()]
        print("\n".join(report(records)))
        plot(records, args.report.with_name("accuracy.html"))
        return 0
    missing = campaign.missing_packages()
    if missing:
        print(f"left out: the {', '.join(sorted(missing))} jobs (pip install -e '.[campaign]', or make accuracy)")
    bed = os.geteuid() == 0 and shutil.which("ip") is not None
    if not bed:
        print("left out: the faults from outside (a test bed needs root and iproute2)")

    def allowed(trial: campaign.Trial) -> bool:
        job = campaign.JOBS[trial.job]
        return (
            (not args.kinds or trial.fault in args.kinds) and job.world <= args.max_ranks and job.needs not in missing
            and (not args.jobs or any(j in job.name or j in job.framework.lower() for j in args.jobs))
            and (bed or job.program == "local")
        )  # fmt: skip

    try:
        seeds = args.replay or campaign.seeds(args.seed, args.trials, allowed)
    except ValueError as e:
        print(f"accuracy: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "trials.jsonl"
    records = played(jsonl, seeds) if args.resume else []
    done = {r["seed"] for r in records}
    print(f"{len(seeds)} trials (campaign seed {args.seed}), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; trials in {jsonl}"
          + (f"; {len(done)} played before, kept" if args.resume else ""))  # fmt: skip
    commit = _commit()
    began = time.monotonic()
    # Ctrl-C or SIGTERM (also where a background shell ignores SIGINT) ends the trial in play, its
    # processes and test bed stopped, and prints the tables of the trials played so far
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with jsonl.open("a" if args.resume else "w") as out, contextlib.suppress(KeyboardInterrupt):
        for n, seed in enumerate(seeds, 1):
            if seed in done:
                continue
            trial = campaign.draw(seed)
            print(f"[{n}/{len(seeds)}] seed {seed}: {trial.describe()}", flush=True)
            with tempfile.TemporaryDirectory(prefix=f"rankscope-campaign-{seed}-") as work:
                record = rescored({**campaign.play(trial, Path(work), log=lambda line: print(f"    {line}", flush=True)), "commit": commit})
                if record["error"] or verdict_of(record["live"]).outcome not in ("TP", "clean") or disagreements(record):
                    keep_evidence(Path(work), args.out / "logs" / str(seed))
            records.append(record)
            out.write(json.dumps(record, default=str) + "\n")
            out.flush()
            print(f"    {outcome(record)} ({record['wall_s']:.0f} s, load {record['load_before']:.1f})", flush=True)
    print(f"\n{len(records)} trials ({len(records) - len(done)} in {time.monotonic() - began:.0f} s); load average now {os.getloadavg()[0]:.1f}\n")
    print("\n".join(report(records)))
    plot(records, args.out / "accuracy.html")
    print(f"\ntrials: {jsonl}\nplot: {args.out / 'accuracy.html'} (and .png where Chromium is installed)")
    return 0


def played(jsonl: Path, seeds: list[int]) -> list[dict[str, Any]]:
    """The trials of this campaign already in ``jsonl``, in the campaign's order, the file rewritten
    to hold just them: a trial that could not be played, or whose line a kill cut short, is played again."""
    if not jsonl.exists():
        return []
    records = {}
    for line in jsonl.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill: that trial is played again
            if not (record := json.loads(line))["error"]:
                records[record["seed"]] = record
    if stray := sorted(set(records) - set(seeds)):
        raise SystemExit(f"accuracy: {jsonl} holds trials this campaign does not draw (seeds {stray[:3]}...): give the same "
                         "--seed and filters and at least as many --trials, or another --out")  # fmt: skip
    kept = [rescored(records[s]) for s in seeds if s in records]
    jsonl.write_text("".join(json.dumps(r, default=str) + "\n" for r in kept))
    return kept


def _commit() -> str:
    """The commit the trials run on (with ``+`` when the tree has changes), or "" outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+" if dirty else "")


def keep_evidence(work: Path, into: Path) -> None:
    """A trial's logs (collector, launchers, ranks) and its store, kept when it missed, alarmed,
    disagreed or failed: the store is what the live and offline diagnoses read (a collector started
    on the copy serves it: ``rankscope collector --no-diagnosis --store DIR``)."""
    for log in work.rglob("*.log"):
        target = into / log.relative_to(work)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)
    for store in work.rglob("store"):
        if store.is_dir():  # its databases and tables are relative links into store/: kept as links, or it opens no more
            shutil.copytree(store, into / store.relative_to(work), symlinks=True, dirs_exist_ok=True)


def outcome(record: dict[str, Any]) -> str:
    """A trial's result in one line: live and offline verdicts, the time to incident, disagreements."""
    if record["error"]:
        return f"NOT PLAYED: {record['error']}"
    live, offline = verdict_of(record["live"]), verdict_of(record["offline"])
    seconds = f" in {record['seconds']:.1f} s" if record["seconds"] is not None and live.tp else ""
    found = "; ".join(f"{i['kind']} {i['ranks']} {i['hosts']}" for i in record["live_incidents"]) or "nothing"
    differ = "; ".join(f"{side} only: {kind} {list(ranks)} {list(hosts)}" for side, (kind, ranks, hosts) in disagreements(record))
    agree = f"DISAGREE: {record['offline_error'] or differ}" if record["offline_error"] or differ else "agree"
    truth = record["truth"]
    expected = f"{truth['kind']} {truth['ranks']} {truth['hosts']}" if truth["kind"] else "nothing"
    return f"live {live.outcome}{seconds}, offline {offline.outcome}, {agree}; expected {expected}, live found {found}"


def rescored(record: dict[str, Any]) -> dict[str, Any]:
    """The record with its live side as the collector's incidents table held it at the end of the
    trial: what the scorer saw while it watched, and what ``rankscope diagnose`` read from the table
    afterwards (``seen`` live), which a loaded collector may have stored after the scorer stopped
    watching (its time to incident stays unknown)."""
    if record["error"]:
        return record
    stored = [i for i in record["offline_incidents"] + record["disagreements"] if i.get("seen") in ("live and offline", "live only")]
    live = list({names(i): i for i in record["live_incidents"] + stored}.values())
    truth = Truth(record["truth"]["kind"], tuple(record["truth"]["ranks"]), tuple(record["truth"]["hosts"]))
    return {**record, "live_incidents": live, "live": dataclasses.asdict(judge(truth, live))}


def disagreements(record: dict[str, Any]) -> list[tuple[str, tuple[str, tuple[int, ...], tuple[str, ...]]]]:
    """What the live incidents (open or closed) and ``rankscope diagnose``'s offline ones do not both name."""
    live, offline = ({names(i) for i in record[side]} for side in ("live_incidents", "offline_incidents"))
    return [("live", n) for n in sorted(live - offline)] + [("offline", n) for n in sorted(offline - live)]


def tallies(records: Iterable[dict[str, Any]], side: str, key: Callable[[dict[str, Any]], str]) -> dict[str, Tally]:
    """The scored trials' verdicts on one side (live, offline), added up per ``key``."""
    out: dict[str, Tally] = {}
    for r in records:
        if r["error"]:
            continue
        out.setdefault(key(r), Tally()).add(verdict_of(r[side]), r["fault"] != "none", r["seconds"] if side == "live" else None)
    return out


def report(records: list[dict[str, Any]]) -> list[str]:
    """The tables: per fault kind, per framework, overall, live then offline; the published figures;
    the trials not played and the disagreements."""
    scored = [r for r in records if not r["error"]]
    lines = ["live: the collector's stored incidents, open or closed; offline: rankscope diagnose after the run", ""]
    for by, key in (("fault", lambda r: r["fault"]), ("framework", lambda r: r["framework"]), ("overall", lambda r: "all")):
        lines += [*table(by, {side: tallies(scored, side, key) for side in ("live", "offline")}), ""]
    lines += ["| system | published figure |", "|---|---|", *(f"| {name} | {figure} |" for name, figure in PUBLISHED)]
    disagree = [r for r in scored if disagreements(r) or r["offline_error"]]
    lines += ["", f"live and offline disagree on {len(disagree)} of {len(scored)} trials: "
              + (", ".join(str(r["seed"]) for r in disagree) or "none")]  # fmt: skip
    for side in ("live", "offline"):
        missed = [r for r in scored if verdict_of(r[side]).outcome not in ("TP", "clean")]
        lines += [f"{side} misses and false alarms ({len(missed)}): "
                  + (", ".join(f"{r['seed']} ({r['fault']}, {r['job']}: {verdict_of(r[side]).outcome}{_effect(r)})" for r in missed) or "none")]  # fmt: skip
    if not_played := [r for r in records if r["error"]]:
        lines += [f"not played ({len(not_played)}): " + "; ".join(f"{r['seed']}: {r['error']}" for r in not_played)]
    return lines


def _effect(record: dict[str, Any]) -> str:
    """Where a fault set from outside landed, and what a slowdown did to its job's step time, where the
    trial measured them (``fault_effect``)."""
    landed = record.get("landed_step")
    where = "" if landed is None or landed == record["step"] else f", landed in step {landed}"
    return where + ("" if record.get("slowdown") is None else f", step time x{record['slowdown']:g}")


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Recall and precision per fault kind, live and offline, and each true positive's time to incident (Plotly, HTML)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    scored = [r for r in records if not r["error"]]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("per fault: recall (clean: 1 - false alarms)", "time from fault to live incident (s)"))
    for side in ("live", "offline"):
        kinds = tallies(scored, side, lambda r: r["fault"])
        names = sorted(kinds)
        values = [(1 - (kinds[k].false_alarm_rate or 0)) if k == "none" else (kinds[k].recall or 0) for k in names]
        fig.add_trace(go.Bar(x=names, y=values, name=f"{side}"), row=1, col=1)
    hits = [r for r in scored if r["seconds"] is not None and r["live"]["tp"]]
    fig.add_trace(go.Box(x=[r["fault"] for r in hits], y=[r["seconds"] for r in hits], boxpoints="all", name="seconds",
                         text=[f"seed {r['seed']}: {r['job']}" for r in hits]), row=1, col=2)  # fmt: skip
    fig.update_layout(title=f"rankscope diagnosis over {len(scored)} randomized trials", barmode="group", height=450, width=1100)
    fig.write_html(path, include_plotlyjs="cdn")
    screenshot(fig, path.with_suffix(".png"))


def screenshot(fig: Any, png: Path) -> None:
    """The figure as a PNG too, through headless Chromium where there is one (Plotly's own static
    export needs kaleido, which rankscope does not install); without one, the HTML alone."""
    browser = shutil.which("chromium") or shutil.which("google-chrome")
    if browser is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "plot.html"
        fig.write_html(page, include_plotlyjs=True, config={"staticPlot": True})
        size = f"--window-size={fig.layout.width},{fig.layout.height + 10}"
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", size, f"--screenshot={png.resolve()}",
                        page.as_uri()], capture_output=True, timeout=120, check=False)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
