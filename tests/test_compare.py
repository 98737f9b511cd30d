"""``rankscope compare``: which segments, ranks and groups make one run (or one range of steps) slower.

Fast tests: hand-made runs written straight into an embedded store, whose answers are known to the
millisecond (a straggler, a segment slower on every rank, a larger world matched by coordinates, CPU
time, restarts, the command line's refusals). Slow tests: a clean and a straggler run of the bundled
trainer, recorded for real through a collector, compared with the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator

import pyarrow as pa
import pytest

from conftest import ProcRunner, Running, start_collector

from rankscope.cli import compare as compare_cli
from rankscope.cli import source
from rankscope.cli.main import build_parser
from rankscope.collector.client import StoreReader
from rankscope.collector.compare import CompareError, Side, compare, parse_steps
from rankscope.harness.fault_effect import landed_step, slowdown
from rankscope.harness.orchestration import CLI
from rankscope.collector.store.base import arrow_schema
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.migrations import migrate
from rankscope.collector.store.schema import BY_NAME

S = 10**9
MS = 10**6
T0 = 1_800_000_000 * S
STEPS = 8


def _insert(store: EmbeddedStore, table: str, columns: dict[str, list]) -> None:
    """Rows of ``table``; a column not given holds its type's zero (``attempt`` 0)."""
    schema = arrow_schema(BY_NAME[table])
    rows = len(next(iter(columns.values())))

    def zeros(kind: pa.DataType) -> list:
        if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_dictionary(kind):
            return [""] * rows
        return [[]] * rows if pa.types.is_list(kind) else [0] * rows

    arrays = [pa.array(columns.get(f.name, zeros(f.type)), pa.int64() if pa.types.is_timestamp(f.type) else f.type).cast(f.type)
              for f in schema]  # fmt: skip
    store.insert_arrow(table, pa.Table.from_arrays(arrays, schema=schema))


def write_run(
    store: EmbeddedStore,
    run_id: str,
    *,
    dp: int = 2,
    pp: int = 2,
    steps: range = range(1, STEPS + 1),
    start: int = T0,
    attempt: int = 0,
    compute: Callable[[int, int, str], float] = lambda rank, step, name: {"forward": 100, "backward": 200}[name],
    late: Callable[[int, int], float] = lambda rank, step: 0,
    link: Callable[[int], float] = lambda sender: 5,
    cpu: float | None = None,
) -> None:
    """A run of ``pp`` x ``dp`` ranks (tp 1, Megatron's order: rank = dp_rank + pp_rank * dp) whose every step is:
    forward and backward (``compute(rank, step, name)`` ms), then grad_sync (kind comm) around the data-parallel
    all-reduce of the rank's stage, then 10 ms of optimizer. The all-reduce ends for every member 20 ms after the
    last member issued it: a rank that finishes its compute earlier waits in it. ``late(rank, step)`` ms more of
    untimed work before the all-reduce (none by default). The step time is the slowest rank's, plus 10 ms.
    Each rank of stage 0 sends its activations to its stage-1 peer (group pp[dp rank]) after its forward; the peer
    posted the receive at the step's start, and the transfer takes ``link(sender)`` ms (the pipeline is drawn, not
    simulated: it does not move the step's other times).
    ``cpu``: the CPU time of compute and optimizer pieces as this share of their wall time (None: not measured)."""
    world = pp * dp
    if attempt == 0:
        _insert(store, "runs", {"run_id": [run_id], "name": [run_id], "start_time": [start], "end_time": [start + 3600 * S],
                                "world_size": [world], "tp": [1], "pp": [pp], "dp": [dp], "config": ["{}"], "status": ["finished"],
                                "updated": [start]})  # fmt: skip
    _insert(store, "ranks", {
        "run_id": [run_id] * world, "rank": list(range(world)), "host": [f"node-{r // 2}" for r in range(world)],
        "pid": [100 + r for r in range(world)], "local_rank": [r % 2 for r in range(world)], "device": ["cpu"] * world,
        "tp_rank": [0] * world, "pp_rank": [r // dp for r in range(world)], "dp_rank": [r % dp for r in range(world)],
        "clock_offset_ns": [0] * world, "agent_version": ["test"] * world, "registered": [start + attempt] * world,
        "attempt": [attempt] * world,
    })  # fmt: skip
    spans: dict[str, list] = {k: [] for k in ("rank", "step", "name", "kind", "start_time", "end_time", "cpu_ns")}
    ops: dict[str, list] = {k: [] for k in ("rank", "group_name", "seq", "op", "peer", "issue_time", "start_time", "end_time", "step")}
    metrics: dict[str, list] = {k: [] for k in ("rank", "step", "value", "time")}
    t = start
    for step in steps:
        ready = {r: t + int((compute(r, step, "forward") + compute(r, step, "backward") + late(r, step)) * MS) for r in range(world)}
        done = {}
        for stage in range(pp):
            members = [r for r in range(world) if r // dp == stage]
            end = max(ready[r] for r in members) + 20 * MS
            for r in members:
                done[r] = end
                _op(ops, r, f"dp[{stage}]", step, "all_reduce", -1, ready[r], end, step)
        for src in range(dp if pp > 1 else 0):  # stage 0 -> stage 1
            dst, sent = src + dp, t + int(compute(src, step, "forward") * MS)
            arrived = sent + int(link(src) * MS)
            _op(ops, src, f"pp[{src}]", step, "send", dst, sent, arrived, step)
            _op(ops, dst, f"pp[{src}]", step, "recv", src, t, arrived, step)
        step_end = max(done.values()) + 10 * MS
        for r in range(world):
            f, b = int(compute(r, step, "forward") * MS), int(compute(r, step, "backward") * MS)
            pieces = [("forward", "compute", t, t + f), ("backward", "compute", t + f, t + f + b), ("grad_sync", "comm", ready[r], done[r]),
                      ("optimizer", "optimizer", done[r], done[r] + 10 * MS)]  # fmt: skip
            for name, kind, s, e in pieces:
                spans["rank"].append(r), spans["step"].append(step), spans["name"].append(name), spans["kind"].append(kind)
                spans["start_time"].append(s), spans["end_time"].append(e)
                spans["cpu_ns"].append(int((e - s) * cpu) if cpu is not None and kind != "comm" else -1)
            metrics["rank"].append(r), metrics["step"].append(step), metrics["value"].append((step_end - t) / S), metrics["time"].append(step_end)
        t = step_end + 5 * MS
    n, m, k = len(spans["rank"]), len(ops["rank"]), len(metrics["rank"])
    _insert(store, "spans", {**spans, "run_id": [run_id] * n, "microbatch": [0] * n, "attributes": [""] * n, "attempt": [attempt] * n})
    _insert(store, "collectives", {**ops, "run_id": [run_id] * m, "nbytes": [4096] * m, "dtype": ["float32"] * m,
                                   "state": ["completed"] * m, "attempt": [attempt] * m})  # fmt: skip
    _insert(store, "step_metrics", {**metrics, "run_id": [run_id] * k, "name": ["step_time_s"] * k, "attempt": [attempt] * k})


def _op(ops: dict[str, list], rank: int, group: str, seq: int, op: str, peer: int, issue: int, end: int, step: int) -> None:
    for key, value in zip(("rank", "group_name", "seq", "op", "peer", "issue_time", "start_time", "end_time", "step"),
                          (rank, group, seq, op, peer, issue, issue, end, step)):  # fmt: skip
        ops[key].append(value)


def straggler(slow_rank: int, from_step: int = 3, extra_ms: float = 100) -> Callable[[int, int, str], float]:
    """Every rank: forward 100 ms, backward 200 ms; ``slow_rank``'s backward ``extra_ms`` longer from ``from_step``."""
    return lambda rank, step, name: {"forward": 100, "backward": 200}[name] + (extra_ms if name == "backward" and rank == slow_rank and step >= from_step else 0)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStore]:
    opened = EmbeddedStore(tmp_path_factory.mktemp("compare-store") / "store")
    migrate(opened, "rankscope", None)
    write_run(opened, "base")
    write_run(opened, "slow", compute=straggler(3))
    # the same straggler set "at step 3" from outside, landed in step 7
    write_run(opened, "landed-late", compute=straggler(3, from_step=7))
    # every rank's backward 50 ms longer: a slower kernel, not a straggler
    write_run(opened, "kernel", compute=lambda rank, step, name: {"forward": 100, "backward": 250}[name])
    # twice the data-parallel replicas: rank 5 has rank 3's coordinates (tp 0, pp 1, dp 1)
    write_run(opened, "wide", dp=4, compute=straggler(5))
    # CPU time measured (90% of wall); in "cpu-slow" rank 1 waits 100 ms for the CPU before its all-reduce
    write_run(opened, "cpu-base", cpu=0.9)
    write_run(opened, "cpu-slow", cpu=0.9, late=lambda rank, step: 100 if rank == 1 else 0)
    # the pipeline link from rank 1 to rank 3 takes 50 ms instead of 5
    write_run(opened, "slow-link", link=lambda sender: 50 if sender == 1 else 5)
    # restarted after step 6: steps 5-8 run again by attempt 1, whose rank 0 is slow (attempt 0's steps 5-6 are not)
    write_run(opened, "restarted", steps=range(1, 7))
    write_run(opened, "restarted", steps=range(5, STEPS + 1), start=T0 + 600 * S, attempt=1, compute=straggler(0, from_step=5, extra_ms=60))
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def query(store: EmbeddedStore):
    reader = StoreReader(store)  # never closed: closing it would close the fixture's store
    return lambda sql, params: reader.query(sql, params)


def test_a_straggler_is_named_first_with_its_segment_and_its_share(query):
    result = compare(query, Side("base"), Side("slow"))
    assert (result.a.first_step, result.a.last_step, result.b.steps) == (3, 8, 6)  # the first two steps are warm-up
    assert result.a.step_time_s == pytest.approx(0.33) and result.diff_s == pytest.approx(0.1)
    assert result.headline() == "step time +100 ms (+30%): rank 3 backward +100 ms (100% of the difference)"
    top = result.contributions[0]
    assert (top.level, top.segment, top.rank, top.rank_a, top.host, top.stage, top.measure) == ("rank", "backward", 3, 3, "node-1", 1, "wall")
    assert (top.a_s, top.b_s, top.diff_s, top.share) == pytest.approx((0.2, 0.3, 0.1, 1.0))
    assert all(abs(c.diff_s) < 1e-9 for c in result.contributions[1:])
    assert result.matching.how == "rank" and "ranks matched by number (both sides: 4 ranks)" == result.matching.note
    # the rank's stage peer waited for it: an effect, listed apart, with whom it waited for
    waits = {w.label: w for w in result.waits if w.diff_s > 1e-9}
    assert set(waits) == {"dp[1] all_reduce arrival skew, last to arrive: rank 3", "time in grad_sync (waits included)"}
    assert waits["dp[1] all_reduce arrival skew, last to arrive: rank 3"].diff_s == pytest.approx(0.1)
    segments = {s["segment"]: s for s in result.segments}
    assert segments["backward"]["diff_s"] == pytest.approx(0.1) and segments["backward"]["pace_rank_b"] == 3
    assert segments["grad_sync"]["a_s"] == pytest.approx(0.02) and segments["grad_sync"]["diff_s"] == pytest.approx(0.1)  # rank 2 waits
    groups = {g["group"]: g for g in result.groups}
    assert groups["dp[1]"]["transfer_diff_s"] == pytest.approx(0) and groups["dp[1]"]["skew_diff_s"] == pytest.approx(0.1)
    assert groups["dp[1]"]["last_to_arrive_b"] == 3 and groups["dp[0]"]["skew_diff_s"] == pytest.approx(0)
    # each send matched with its receive: 5 ms of transfer after the sender's 100 ms forward, which the receiver waited for
    pipe = {(g["group"], g["op"]): g for g in result.groups}[("pp[1]", "send/recv")]
    assert (pipe["transfer_a_s"], pipe["skew_a_s"], pipe["transfer_diff_s"], pipe["last_to_arrive_b"]) == pytest.approx((0.005, 0.1, 0, 1))
    # every (segment, rank) as measured, waits included: rank 2 waited in grad_sync as long as rank 3 was late
    assert {(r["segment"], r["rank"]) for r in result.ranks if r["diff_s"] > 1e-9} == {("backward", 3), ("grad_sync", 2)}


def test_the_table_and_the_json_say_the_same(query):
    result = compare(query, Side("base"), Side("slow"))
    text = result.table()
    lines = text.splitlines()
    assert lines[0] == "A: run base steps 3-8 (6 completed), after 2 warm-up steps: step time 330.0 ms"
    assert lines[2] == "ranks matched by number (both sides: 4 ranks)"
    assert result.headline() in lines
    first = lines[lines.index(next(line for line in lines if line.startswith("What accounts for it"))) + 2]
    assert first.split() == ["rank", "3", "backward", "200", "300", "+100", "100%"]
    assert "dp[1] all_reduce arrival skew, last to arrive: rank 3" in text
    data = json.loads(json.dumps(result.as_json()))
    assert data["summary"] == result.headline() and data["step_time"]["diff_s"] == pytest.approx(0.1)
    assert data["contributions"][0] == {
        "level": "rank", "label": "rank 3 backward", "a_s": pytest.approx(0.2), "b_s": pytest.approx(0.3), "diff_s": pytest.approx(0.1),
        "share": pytest.approx(1.0), "segment": "backward", "kind": "compute", "measure": "wall", "rank": 3, "rank_a": 3, "host": "node-1",
        "stage": 1,
    }  # fmt: skip
    assert data["a"]["run"] == "base" and data["b"]["first_step"] == 3 and data["matching"]["how"] == "rank"


def test_a_segment_slower_on_every_rank_is_the_segment_not_each_rank(query):
    result = compare(query, Side("base"), Side("kernel"))
    top = result.contributions[:2]
    assert sorted(c.label for c in top) == ["backward on every rank of stage 0", "backward on every rank of stage 1"]
    assert [c.diff_s for c in top] == pytest.approx([0.05, 0.05]) and all(c.level == "stage" for c in top)
    assert all(abs(c.diff_s) < 1e-9 for c in result.contributions if c.level == "rank")
    assert result.headline().startswith("step time +50 ms (+15%): backward on every rank of stage ")


def test_two_ranges_of_one_run(query):
    """Steps 1-2 of "slow" are as fast as "base" (the straggler begins at step 3); explicit ranges keep the warm-up."""
    result = compare(query, Side("slow", 1, 2), Side("slow", 4, 8))
    assert (result.a.first_step, result.a.last_step, result.b.first_step, result.b.last_step) == (1, 2, 4, 8)
    assert result.headline() == "step time +100 ms (+30%): rank 3 backward +100 ms (100% of the difference)"
    # and the other way round: faster, the largest decrease first
    back = compare(query, Side("slow", 4, 8), Side("slow", 1, 2))
    assert back.headline() == "step time -100 ms (-23%): rank 3 backward -100 ms (100% of the difference)"


def test_a_larger_world_is_matched_by_coordinates(query):
    result = compare(query, Side("base"), Side("wide"))
    assert result.matching.how == "coordinates"
    assert result.matching.note == ("ranks matched by their (tp, pp, dp) coordinates: the world sizes differ (4 against 8 ranks); "
                                    "without a counterpart: 0 rank(s) of A, 4 of B")  # fmt: skip
    assert result.matching.pairs == {0: 0, 1: 1, 4: 2, 5: 3} and result.matching.unmatched_b == (2, 3, 6, 7)
    top = result.contributions[0]
    assert (top.label, top.rank, top.rank_a) == ("rank 5 (A: rank 3) backward", 5, 3)
    assert top.diff_s == pytest.approx(0.1)
    assert "matched by their (tp, pp, dp) coordinates" in result.table()


def test_cpu_time_is_compared_where_it_was_measured_and_waits_stay_wall_time(query):
    """Rank 1 waits 100 ms for the CPU in "cpu-slow" (untimed: no segment grows): no rank's own work changed, its
    stage peer waited for it, and the step time rose by those 100 ms."""
    result = compare(query, Side("cpu-base"), Side("cpu-slow"))
    assert result.diff_s == pytest.approx(0.1)
    backward = next(c for c in result.contributions if c.label == "rank 1 backward")
    assert backward.measure == "cpu" and backward.a_s == pytest.approx(0.18) and backward.diff_s == pytest.approx(0)
    assert all(abs(c.diff_s) < 1e-9 for c in result.contributions)
    assert result.headline() == "step time +100 ms (+30%): no segment, rank or group stands out"
    waits = [w for w in result.waits if w.diff_s > 1e-9]
    assert sorted(w.label for w in waits) == ["dp[0] all_reduce arrival skew, last to arrive: rank 1", "time in grad_sync (waits included)"]
    assert all(w.measure == "wall" for w in result.waits)
    segments = {s["segment"]: s for s in result.segments}
    assert segments["backward"]["measure"] == "cpu" and segments["grad_sync"]["measure"] == "wall"


def test_a_slower_pipeline_link_is_its_group_s_transfers(query):
    """The step time stays (the synthetic pipeline does not move it): the link is listed first, without a share."""
    result = compare(query, Side("base"), Side("slow-link"))
    top = result.contributions[0]
    assert (top.level, top.label, top.group, top.op, top.share) == ("group", "pp[1] send/recv", "pp[1]", "send/recv", None)
    assert (top.a_s, top.diff_s) == pytest.approx((0.005, 0.045))
    assert result.headline() == "step time +0.0 ms (+0%): pp[1] send/recv +45 ms"


def test_a_step_run_again_counts_as_its_latest_attempt_ran_it(query):
    """Attempt 1 ran steps 5-8 again, rank 0's backward 60 ms slower; attempt 0's steps 5-6 are not counted."""
    result = compare(query, Side("restarted", 3, 4), Side("restarted", 5, 8))
    assert (result.a.attempt, result.b.attempt, result.b.steps) == (0, 1, 4)
    assert result.contributions[0].label == "rank 0 backward" and result.contributions[0].diff_s == pytest.approx(0.06)
    assert result.diff_s == pytest.approx(0.06)


def test_unknown_runs_and_empty_ranges_are_refused(query):
    with pytest.raises(CompareError, match=r"no run 'nosuch' in the store"):
        compare(query, Side("base"), Side("nosuch"))
    with pytest.raises(CompareError, match=r"run 'base' has no completed step in steps 50-60"):
        compare(query, Side("base", 50, 60), Side("slow"))


def test_a_slowdown_s_effect_is_the_step_time_after_it_over_before_it(query):
    """The campaign's measure of whether an injected slowdown slowed anything (``fault_effect``)."""
    # rank 3's backward 300 -> 400 ms from step 3: a step of 330 ms (the slowest compute, the all-reduce's
    # 20, the optimizer's 10) becomes 430 ms
    assert slowdown(query, "slow", 3) == pytest.approx(430 / 330, abs=1e-3)
    assert slowdown(query, "base", 3) == 1.0
    assert slowdown(query, "slow", 2) is None  # no step before it but the warm-up
    assert slowdown(query, "nosuch", 3) is None
    # a fault set from outside lands in the first step begun after it was set, counted from there
    began = query("SELECT toUnixTimestamp64Nano(min(start_time)) AS ns FROM spans WHERE run_id = 'slow' AND step = 5", {}).to_pylist()[0]["ns"]
    assert landed_step(query, "slow", began) == 5 and landed_step(query, "slow", began + 1) == 6
    assert landed_step(query, "slow", began + 3600 * S) is None  # after the job
    # landed in step 7: steps 5-6 (what the guess of two steps counts from) were not slowed
    assert slowdown(query, "landed-late", 3) == pytest.approx(380 / 330, abs=1e-3)
    assert slowdown(query, "landed-late", 3, landed=7) == pytest.approx(430 / 330, abs=1e-3)


def test_step_ranges_parse_or_say_why_not():
    assert parse_steps("100-200") == (100, 200) and parse_steps("7") == (7, 7)
    for text, why in (("5-3", "ends before it begins"), ("0-3", "numbered from 1"), ("a-b", "expected a step range"), ("1-2-3", "expected")):
        with pytest.raises(ValueError, match=why):
            parse_steps(text)


def _cli(monkeypatch, query, capsys, *argv: str) -> tuple[int, str, str]:
    """``rankscope compare ARGV`` in this process, reading the fixture's store."""

    class Reader:
        def query(self, sql, params=None, max_rows=0):
            return query(sql, params)

        def close(self):
            pass

    monkeypatch.setattr(source, "open_reader", lambda args: Reader())
    try:
        args = build_parser().parse_args(["compare", *argv])
    except SystemExit as e:
        captured = capsys.readouterr()
        return int(e.code), captured.out, captured.err
    code = compare_cli.run(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_prints_a_table_or_one_json_object(monkeypatch, query, capsys):
    code, out, err = _cli(monkeypatch, query, capsys, "base", "slow")
    assert code == 0 and not err
    assert "step time +100 ms (+30%): rank 3 backward +100 ms (100% of the difference)" in out.splitlines()
    code, out, err = _cli(monkeypatch, query, capsys, "slow", "--steps", "1-2", "--against", "4-8", "--format", "json")
    data = json.loads(out)
    assert code == 0 and (data["a"]["run"], data["a"]["last_step"], data["b"]["run"], data["b"]["first_step"]) == ("slow", 2, "slow", 4)
    # --steps alone applies to both runs
    code, out, _ = _cli(monkeypatch, query, capsys, "base", "slow", "--steps", "5-8", "--format", "json")
    data = json.loads(out)
    assert (data["a"]["first_step"], data["b"]["first_step"], data["b"]["last_step"]) == (5, 5, 8)


@pytest.mark.parametrize(("argv", "message"), [
    (["base", "nosuch"], "rankscope compare: no run 'nosuch' in the store"),
    (["base"], "rankscope compare: give a second run"),
    (["base", "--steps", "3-4", "--against", "3-4"], "rankscope compare: both sides are run base over the same steps"),
    (["base", "slow", "--steps", "40-50"], "rankscope compare: run 'base' has no completed step in steps 40-50"),
    (["base", "slow", "--steps", "9-3"], "rankscope compare: error: argument --steps: the range '9-3' ends before it begins"),
])  # fmt: skip
def test_the_command_refuses_bad_input_in_one_line_with_status_2(monkeypatch, query, capsys, argv, message):
    code, out, err = _cli(monkeypatch, query, capsys, *argv)
    assert code == 2 and not out
    assert err.startswith(message) and err.count("\n") == 1, err


# --- real runs ----------------------------------------------------------------------------------

#: the straggler: rank 3 (stage 1) computes 1.5x slower from step 3 on
SLOW_RANK = 3
#: the steps compared; the clean run goes on for CLEAN_EXTRA steps more, so that it still runs (and loads
#: the cores the same) while the slower straggler run does its last compared steps
COMPARED = (3, 12)
CLEAN_EXTRA = 6
LAYOUT = ["--nproc", "4", "--tp", "1", "--pp", "2", "--dp", "2", "--timeout", "120"]


@pytest.fixture(scope="module")
def recorded(module_runner: ProcRunner, tmp_path_factory: pytest.TempPathFactory) -> tuple[Running, str, str]:
    """A collector, and a clean run and a straggler run of the bundled trainer (4 ranks: TP 1 x PP 2 x DP 2), recorded
    at the same time: a shared 2-core machine's load changes from one minute to the next, and both runs see the same."""
    work = tmp_path_factory.mktemp("compare-runs")
    collector = start_collector(module_runner, work / "store", "--flush-interval", "0.5")
    runs = {}
    last = COMPARED[1]
    for name, flags in (("clean", ["--steps", str(last + CLEAN_EXTRA)]),
                        ("straggler", ["--steps", str(last), "--inject", f"straggler:rank={SLOW_RANK},factor=1.5,from_step={COMPARED[0]}"])):
        run_id = f"{name}-{uuid.uuid4().hex[:8]}"
        env = {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": collector.target, "RANKSCOPE_RUN_ID": run_id, "RANKSCOPE_FLUSH_S": "1",
               "RANKSCOPE_SPOOL_DIR": str(work / f"spool-{name}"), "OMP_NUM_THREADS": "1"}  # fmt: skip
        runs[name] = (run_id, module_runner.start([*CLI, "train", *LAYOUT, *flags], env=env, name=name))
    for name, (_, proc) in runs.items():
        assert proc.wait(360) == 0, proc.output()
        spool = work / f"spool-{name}"
        if spool.is_dir():  # what a busy collector did not take in time: the command a user would run
            subprocess.run([*CLI, "spool", "replay", str(spool), "--collector", collector.target], check=True, capture_output=True, timeout=120)
    _wait_for_steps(collector.target, [run_id for run_id, _ in runs.values()])
    return collector, runs["clean"][0], runs["straggler"][0]


def _wait_for_steps(target: str, run_ids: list[str], timeout_s: float = 60) -> None:
    """Until every rank's step times of the compared steps of every run are stored (the collector writes every half second)."""
    from rankscope.collector.client import Client

    sql = ("SELECT uniqExact(rank, step) AS cells FROM step_metrics WHERE run_id = {run:String} AND name = 'step_time_s' "
           "AND step <= {last:UInt32}")  # fmt: skip
    with Client(target) as client:
        deadline = time.monotonic() + timeout_s
        while any(client.query(sql, {"run": r, "last": COMPARED[1]}).to_pylist()[0]["cells"] < 4 * COMPARED[1] for r in run_ids):
            assert time.monotonic() < deadline, "the runs' step times did not all arrive"
            time.sleep(0.5)
        time.sleep(1.5)  # the spans of the last steps come with or after their step time


def _run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "compare", *argv], capture_output=True, text=True, timeout=180, env={**os.environ, "RANKSCOPE_ENABLE": ""})


@pytest.mark.slow
@pytest.mark.foreground
@pytest.mark.timeout(600)
def test_compare_names_the_straggler_segment_and_rank_first_on_real_runs(recorded):
    collector, clean, slow = recorded
    steps = f"{COMPARED[0]}-{COMPARED[1]}"
    done = _run_cli(clean, slow, "--steps", steps, "--collector", collector.target, "--format", "json")
    assert done.returncode == 0 and not done.stderr, done.stderr
    data = json.loads(done.stdout)
    top = data["contributions"][0]
    assert (top["level"], top.get("segment"), top.get("rank")) == ("rank", "backward", SLOW_RANK), (data["summary"], data["contributions"][:5])
    assert data["step_time"]["diff_s"] > 0 and data["matching"]["how"] == "rank"
    assert data["summary"].startswith("step time +") and f": rank {SLOW_RANK} backward +" in data["summary"], data["summary"]
    # its stage's data-parallel peer waited for it
    group_waits = [w for w in data["waits"] if w.get("group") == "dp[1]"]
    assert group_waits and group_waits[0]["waited_for"] == SLOW_RANK, data["waits"]
    done = _run_cli(clean, slow, "--steps", steps, "--collector", collector.target)
    assert done.returncode == 0 and data["summary"] in done.stdout.splitlines(), done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.foreground  # the recorded runs' module fixture is made in one lane
@pytest.mark.timeout(600)
def test_compare_refuses_an_unknown_run_in_one_line(recorded):
    collector, clean, _ = recorded
    done = _run_cli(clean, "nosuch-run", "--collector", collector.target)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.startswith("rankscope compare: no run 'nosuch-run' in the store") and done.stderr.count("\n") == 1, done.stderr
