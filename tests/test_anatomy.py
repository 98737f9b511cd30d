"""Step anatomy: the breakdown SQL, the critical path and its costs, the waterfall, ``rankscope anatomy``.

Fast tests read one embedded store (shared by the module) holding a run written by hand, whose
every number is worked out below, and a run of the scale simulator with an injected straggler,
whose truth is known (the same seed without the straggler gives the step's length without it).
The slow tests run the real trainer with a slow link, and a clean run against a straggler run.
"""

from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pyarrow as pa
import pytest

from rankscope.cli.main import main
from rankscope.collector.anatomy import CATEGORIES, breakdown, categories, critical_path, waterfall
from rankscope.harness.simulate import anatomy_rows
from rankscope.collector.anatomy.categories import Split
from rankscope.collector.anatomy.path import Item, _kept_path, _Shifts, incident_cost
from rankscope.collector.store.base import arrow_schema
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.migrations import migrate
from rankscope.collector.store.schema import BY_NAME

T0 = 1_767_225_600_000_000_000
MS = 1_000_000
SIM = {"tp": 2, "pp": 2, "dp": 2, "microbatches": 4, "straggler": (5, 3, 1.5), "steps": range(1, 5)}


def _insert(store: EmbeddedStore, table: str, rows: list[dict]) -> None:
    schema = arrow_schema(BY_NAME[table])
    columns = {f.name: [r.get(f.name) for r in rows] for f in schema}
    arrays = {name: pa.array(values, pa.int64() if pa.types.is_timestamp(schema.field(name).type) else None)
              for name, values in columns.items()}  # fmt: skip
    store.insert_arrow(table, pa.table({n: a.cast(schema.field(n).type) for n, a in arrays.items()}, schema=schema))


def span(rank: int, step: int, name: str, kind: str, start_ms: float, end_ms: float, attempt: int = 0, run_id: str = "hand") -> dict:
    return {"run_id": run_id, "rank": rank, "step": step, "name": name, "kind": kind, "start_time": T0 + int(start_ms * MS),
            "end_time": T0 + int(end_ms * MS), "microbatch": -1, "attributes": "", "cpu_ns": -1, "attempt": attempt}  # fmt: skip


def op(rank: int, step: int, group: str, seq: int, name: str, peer: int, issue_ms: float, end_ms: float, attempt: int = 0,
       run_id: str = "hand") -> dict:  # fmt: skip
    return {"run_id": run_id, "rank": rank, "group_name": group, "seq": seq, "op": name, "nbytes": 1024, "dtype": "float32",
            "peer": peer, "issue_time": T0 + int(issue_ms * MS), "start_time": T0 + int(issue_ms * MS), "end_time": T0 + int(end_ms * MS),
            "state": "completed", "step": step, "attempt": attempt}  # fmt: skip


def _hand_run(store: EmbeddedStore) -> None:
    """Run ``hand``, two ranks (stage 0 and 1 of one pipeline); times in ms from T0.

    Step 1 ran twice: attempt 0 (rank 0 with a 100 ms forward) was cut short by a restart; attempt 1
    counts. Step 2 (attempt 0 only) counts too. Step 3: a pipeline transfer the receiver waits for.
    """
    spans = [
        span(0, 1, "forward", "compute", 0, 100, attempt=0),  # superseded by attempt 1
        # step 1, attempt 1, rank 0: data 2, compute 8, optimizer 8, p2p 8 (bubble); exposed communication:
        # the all-reduce outside compute [10, 20], grad_sync to 22 and send_forward's [30, 31]: 13
        span(0, 1, "data", "data", 0, 2, 1), span(0, 1, "forward", "compute", 2, 10, 1),
        span(0, 1, "grad_sync", "comm", 10, 22, 1), span(0, 1, "send_forward", "comm", 21, 31, 1),
        span(0, 1, "optimizer", "optimizer", 32, 40, 1),
        # rank 1: compute 30, then waits 5 for its neighbour
        span(1, 1, "forward", "compute", 0, 30, 1), span(1, 1, "recv_forward", "comm", 30, 35, 1),
        # step 2: rank 1 arrives late at the all-reduce: rank 0 waits for it
        span(0, 2, "forward", "compute", 100, 110), span(0, 2, "optimizer", "optimizer", 120, 125),
        span(1, 2, "forward", "compute", 100, 118), span(1, 2, "optimizer", "optimizer", 120, 123),
        # step 3: rank 1 waits for rank 0's activation
        span(0, 3, "forward", "compute", 200, 210), span(1, 3, "forward", "compute", 212, 220),
    ]
    ops = [
        op(0, 1, "dp[0]", 1, "all_reduce", -1, 8, 20, 1),
        op(0, 1, "pp[0]", 1, "send", 1, 22, 30, 1), op(1, 1, "pp[0]", 1, "recv", 0, 30, 35, 1),
        op(0, 2, "dp[0]", 2, "all_reduce", -1, 112, 120), op(1, 2, "dp[0]", 2, "all_reduce", -1, 118, 120),
        op(0, 3, "pp[0]", 2, "send", 1, 210, 212), op(1, 3, "pp[0]", 2, "recv", 0, 200, 212),
    ]
    _insert(store, "spans", spans)
    _insert(store, "collectives", ops)
    _insert(store, "step_metrics", [{"run_id": "hand", "rank": 0, "step": 1, "name": "step_time_s", "value": 0.045,
                                     "time": T0 + 45 * MS, "attempt": 1},
                                    {"run_id": "hand", "rank": 0, "step": 2, "name": "mfu", "value": 0.3, "time": T0, "attempt": 0}])  # fmt: skip
    _two_stages(store, "hand", "finished", attempt=1)


def _two_stages(store: EmbeddedStore, run_id: str, status: str, attempt: int) -> None:
    """The ``runs`` and ``ranks`` rows of a run of two ranks, pipeline stages 0 and 1 on hosts node-0 and node-1."""
    _insert(store, "runs", [{"run_id": run_id, "name": "", "start_time": T0, "end_time": 0, "world_size": 2, "tp": 1, "pp": 2, "dp": 1,
                             "config": "{}", "status": status, "updated": T0}])  # fmt: skip
    _insert(store, "ranks", [{"run_id": run_id, "rank": r, "host": f"node-{r}", "pid": 1, "local_rank": 0, "device": "cpu", "tp_rank": 0,
                              "pp_rank": r, "dp_rank": 0, "clock_offset_ns": 0, "agent_version": "", "registered": T0, "attempt": attempt,
                              "world": ""} for r in (0, 1)])  # fmt: skip


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedStore, list]]:
    """One store: run ``hand`` and run ``sim`` (with the simulator's steps, and the same steps without the straggler)."""
    from rankscope.harness.simulate import topology

    path = tmp_path_factory.mktemp("anatomy") / "store"
    s = EmbeddedStore(path)
    migrate(s, s.database, None)
    _hand_run(s)
    topo = topology.build(SIM["tp"], SIM["pp"], SIM["dp"])
    model = anatomy_rows.model(topo, microbatches=SIM["microbatches"], stragglers=[SIM["straggler"]])
    steps = anatomy_rows.write_run(s, topo, model, SIM["steps"], run_id="sim")
    clean = anatomy_rows.model(topo, microbatches=SIM["microbatches"])
    truth = [(step, clean.step(step.number, step.start_ns)) for step in steps]
    yield s, truth
    s.close()


def q(store: EmbeddedStore):
    return lambda sql, params: store.query_arrow(sql, params)


# --- the breakdown ------------------------------------------------------------------------------


def test_each_moment_counts_once_for_the_first_category_that_covers_it(store) -> None:
    s, _ = store
    b = breakdown(q(s), "hand", 1, 1)
    r0, r1 = b.by_rank[0], b.by_rank[1]
    assert {c: r0.ns[c] / MS for c in CATEGORIES} == pytest.approx(
        {"compute": 8, "optimizer": 8, "data": 2, "bubble": 8, "exposed_comm": 13, "unexplained": 6})
    assert r0.wall_ns == 45 * MS  # its own step_time_s: longer than its 40 ms of recorded timeline
    assert {c: r1.ns[c] / MS for c in CATEGORIES} == pytest.approx(
        {"compute": 30, "optimizer": 0, "data": 0, "bubble": 5, "exposed_comm": 0, "unexplained": 0})
    assert b.by_step[1].wall_ns == pytest.approx(40 * MS) and b.by_step[1].max_wall_ns == 45 * MS
    assert b.total is not None and b.total.rank_steps == 2


def test_a_step_run_again_after_a_restart_counts_with_its_latest_attempt_only(store) -> None:
    s, _ = store
    b = breakdown(q(s), "hand", 1, 3)
    assert b.by_step[1].ns["compute"] == pytest.approx((8 + 30) / 2 * MS)  # not attempt 0's 100 ms forward
    assert b.by_step[2].ns["compute"] == pytest.approx((10 + 18) / 2 * MS)  # step 2 only ran once (attempt 0)
    assert sorted(b.by_step) == [1, 2, 3] and b.total is not None and b.total.rank_steps == 6
    assert b.by_step[2].mfu == pytest.approx(0.3) and b.by_step[1].mfu is None


def test_categories_add_up_to_every_ranks_wall_time_at_scale(store) -> None:
    s, _ = store
    b = breakdown(q(s), "sim", 1, 4)
    assert len(b.by_rank) == 8 and len(b.by_step) == 4
    for split in [*b.by_rank.values(), *b.by_step.values(), b.total]:
        assert sum(split.ns.values()) == pytest.approx(split.wall_ns)
        assert all(v >= 0 for v in split.ns.values())
    # the straggler (rank 5, 1.5x from step 3) computes longer than its stage peers; its peers wait
    assert b.by_rank[5].ns["compute"] > 1.2 * statistics.median(b.by_rank[r].ns["compute"] for r in (4, 6, 7))


def test_a_long_range_is_read_in_pieces_with_the_same_result(store, monkeypatch: pytest.MonkeyPatch) -> None:
    s, _ = store
    whole = breakdown(q(s), "sim", 1, 4)
    monkeypatch.setattr(categories, "CHUNK_RANK_STEPS", 8)  # one step per statement
    pieces = breakdown(q(s), "sim", 1, 4)
    assert pieces.by_step == whole.by_step
    assert pieces.total is not None and whole.total is not None
    assert pieces.total.ns == pytest.approx(whole.total.ns) and pieces.by_rank[5].ns == pytest.approx(whole.by_rank[5].ns)


# --- the critical path --------------------------------------------------------------------------


def _rows(path) -> list[tuple]:
    return [(link.rank, link.kind, (link.start_ns - T0) / MS, (link.end_ns - T0) / MS, link.waited_on) for link in path.links]


def test_the_path_goes_to_the_rank_that_arrived_last_at_a_collective(store) -> None:
    s, _ = store
    path = critical_path(q(s), "hand", 2)
    assert _rows(path) == [(1, "compute", 100, 118, None), (0, "collective", 118, 120, 1), (0, "optimizer", 120, 125, None)]
    assert path.step_ns == 25 * MS


def test_the_path_goes_to_the_sender_a_receiver_waited_for(store) -> None:
    s, _ = store
    path = critical_path(q(s), "hand", 3)
    assert _rows(path) == [(0, "compute", 200, 210, None), (1, "p2p", 210, 212, 0), (1, "compute", 212, 220, None)]
    assert path.links[1].what == "recv pp[0]#2 from rank 0"


def test_a_kept_path_is_walked_again_when_late_spans_of_its_step_arrive(store) -> None:
    """The live diagnosis keeps each step's path between passes; a span that arrives later inside the step's
    bounds (a rank's flush behind the others') must not leave the path walked on part of the step."""
    s, _ = store
    _two_stages(s, "late", "running", attempt=0)
    _insert(s, "spans", [span(0, 1, "forward", "compute", 0, 3, run_id="late"), span(0, 1, "loss", "compute", 7, 10, run_id="late"),
                         span(1, 1, "forward", "compute", 12, 20, run_id="late")])  # fmt: skip
    _insert(s, "collectives", [op(0, 1, "pp[0]", 1, "send", 1, 10, 12, run_id="late"), op(1, 1, "pp[0]", 1, "recv", 0, 0, 12, run_id="late")])
    assert incident_cost(q(s), "late", [1], [0]) is not None  # walked and kept: rank 0's 3-7 ms untracked
    _insert(s, "spans", [span(0, 1, "backward", "compute", 3, 7, run_id="late")])  # arrives a pass later, inside rank 0's bounds
    kept = _kept_path(q(s), "late", 1, None, None)
    assert kept is not None and [(link.rank, link.what) for link in kept.links][:3] == [(0, "forward"), (0, "backward"), (0, "loss")], kept.links


@pytest.mark.timeout(60)
def test_a_step_still_arriving_keeps_its_path_until_every_rank_is_in(store) -> None:
    """At scale a step's rows arrive over a flush interval (20 s at 100,000 ranks): its path, walked on part of
    the step, is kept while more of it arrives (a walk each pass was most of the straggler's pass), and walked
    again once every rank of the world is in it."""
    s, _ = store
    _two_stages(s, "arriving", "running", attempt=0)
    _insert(s, "spans", [span(0, 1, "forward", "compute", 0, 3, run_id="arriving"), span(0, 1, "loss", "compute", 7, 10, run_id="arriving")])
    assert incident_cost(q(s), "arriving", [1], [0], world=2) is not None  # one rank of two: walked on what is there
    _insert(s, "spans", [span(0, 1, "backward", "compute", 3, 7, run_id="arriving")])
    part = _kept_path(q(s), "arriving", 1, None, None, world=2)
    assert part is not None and "backward" not in [link.what for link in part.links]  # still one rank of two: kept
    _insert(s, "spans", [span(1, 1, "forward", "compute", 12, 20, run_id="arriving")])
    _insert(s, "collectives", [op(0, 1, "pp[0]", 1, "send", 1, 10, 12, run_id="arriving"), op(1, 1, "pp[0]", 1, "recv", 0, 0, 12, run_id="arriving")])
    whole = _kept_path(q(s), "arriving", 1, None, None, world=2)
    assert whole is not None and [(link.rank, link.what) for link in whole.links][:3] == [(0, "forward"), (0, "backward"), (0, "loss")], whole.links


def test_a_shift_followed_back_to_a_short_send_that_began_when_its_partner_waited_for_it() -> None:
    """Off the path, a rank is followed back to the partner it waited for, from the moment the partner issued the
    transfer; a short transfer (within EPS_NS) that began then is not before it (it was taken for the last
    operation before, again and again, and the shift was lost)."""
    items = {
        0: [Item(0, "compute", "forward", 0, 19 * MS), Item(0, "p2p", "send", 19 * MS, 19 * MS + 50_000, "pp[0]", 1, peer=1, other=1,
                                                            other_issue=10 * MS)],  # fmt: skip
        1: [Item(1, "p2p", "recv", 10 * MS, 20 * MS, "pp[0]", 1, peer=0, other=0, other_issue=19 * MS)],
    }
    shifts = _Shifts(items, {(0, "forward"): 0.5})  # half of rank 0's forward is its excess
    assert shifts.at(1, 20 * MS) == pytest.approx(0.5 * 19 * MS)


def test_a_straggler_is_on_the_path_and_its_cost_is_what_it_added_to_the_step(store) -> None:
    s, truth = store
    straggler, from_step, _ = SIM["straggler"]
    for step, clean in truth:
        path = critical_path(q(s), "sim", step.number)
        assert path is not None and path.step_ns == step.duration_ns  # from the first rank's start to the last one's end
        assert all(a.end_ns == b.start_ns for a, b in zip(path.links, path.links[1:]))  # one unbroken chain
        added = step.duration_ns - clean.duration_ns
        if step.number < from_step:
            assert added == 0 and path.cost_of([straggler]) < 0.01 * step.duration_ns
            continue
        assert {(link.rank, link.what) for link in path.links} >= {(straggler, "forward"), (straggler, "backward")}
        assert path.slowest is not None and path.slowest[0] == straggler
        assert path.cost_of([straggler]) == pytest.approx(added, rel=0.10)
        assert path.without_slowest_ns == pytest.approx(clean.duration_ns, rel=0.05)
        assert path.describe_cost(straggler).startswith(f"rank {straggler} costs ")


def test_incidents_cite_what_the_rank_costs_the_step(store) -> None:
    s, truth = store
    cost = incident_cost(q(s), "sim", [3, 4], [5])
    added = statistics.median((step.duration_ns - clean.duration_ns) / step.duration_ns for step, clean in truth[2:])
    assert cost is not None and cost["steps"] == [3, 4] and cost["share"] == pytest.approx(added, rel=0.05)
    assert cost["text"] == f"costs {100 * cost['share']:.0f}% of step time (critical path of steps 3-4)"
    assert [p["step"] for p in cost["per_step"]] == [3, 4] and cost["per_step"][0]["links"][0]["rank"] == 5
    assert incident_cost(q(s), "sim", [4], [4])["text"] == "costs 0% of step time (critical path of step 4)"  # type: ignore[index]
    assert incident_cost(q(s), "sim", [99], [5]) is None  # no such step
    assert incident_cost(lambda sql, params: 1 / 0, "sim", [3], [5]) is None  # a failed read loses the figure, not the incident


# --- the waterfall ------------------------------------------------------------------------------


def test_mfu_waterfall_falls_from_the_peak_to_what_was_achieved() -> None:
    ns = {"compute": 60.0, "optimizer": 5.0, "data": 5.0, "bubble": 20.0, "exposed_comm": 8.0, "unexplained": 2.0}
    bars = waterfall(Split(wall_ns=100.0, max_wall_ns=100.0, ns=ns, rank_steps=1, mfu=0.3, mfu_points=1))
    assert bars[0].label == "peak" and bars[-1].label == "achieved" and bars[-1].value == 0.3
    assert 1.0 - sum(b.value for b in bars[1:-1]) == pytest.approx(0.3)
    assert bars[1].label == "compute below peak" and bars[1].value == pytest.approx(1 - 0.3 * 100 / 60)
    assert [b.label for b in bars[2:-1]] == ["bubble", "exposed_comm", "optimizer", "data", "unexplained"]


def test_without_mfu_the_waterfall_is_the_step_time_largest_first() -> None:
    ns = {"compute": 60.0, "optimizer": 5.0, "data": 1.0, "bubble": 20.0, "exposed_comm": 8.0, "unexplained": 6.0}
    bars = waterfall(Split(wall_ns=100e6, max_wall_ns=100e6, ns={k: v * 1e6 for k, v in ns.items()}, rank_steps=1))
    assert [(b.label, b.value) for b in bars] == [("step", 100.0), ("compute", 60.0), ("bubble", 20.0), ("exposed_comm", 8.0),
                                                   ("unexplained", 6.0), ("optimizer", 5.0), ("data", 1.0)]  # fmt: skip


# --- rankscope anatomy --------------------------------------------------------------------------


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(["anatomy", *args])
        except SystemExit as e:  # argparse's refusals
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_cli_prints_the_breakdown_the_median_steps_path_and_the_waterfall(store) -> None:
    s, _ = store
    code, out, err = cli("--store", str(s.path), "--run", "sim", "--steps", "2-4")
    assert code == 0 and not err, err
    assert "run sim (finished), steps 2-4: 8 ranks" in out
    assert "critical path of step 4 (the median step)" in out and "slowest link: 5 (node-0) costs" in out
    assert "time waterfall" in out and "exposed_comm" in out
    code, out, err = cli("--store", str(s.path), "--run", "sim", "--step", "3", "--format", "json")
    found = json.loads(out)
    assert code == 0 and found["first_step"] == found["last_step"] == 3 and len(found["by_rank"]) == 8
    assert found["critical_path"]["step"] == 3 and found["critical_path"]["slowest"]["rank"] == 5
    assert found["waterfall"][0]["label"] == "step"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--run", "nope"], "no run 'nope' in the store"),
        (["--run", "sim", "--steps", "50-60"], "has steps 1-4 recorded, none of 50-60"),
        (["--run", "sim", "--steps", "4-2"], "expected steps A-B with 1 <= A <= B"),
        (["--run", "sim", "--step", "0"], "steps are numbered from 1"),
    ],
)
def test_cli_refuses_in_one_line(store, args: list[str], message: str) -> None:
    s, _ = store
    code, out, err = cli("--store", str(s.path), *args)
    assert code == 2 and not out and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_says_in_one_line_when_the_data_cannot_be_reached(tmp_path: Path) -> None:
    code, out, err = cli("--collector", "127.0.0.1:1", "--run", "x")
    assert code == 1 and not out and err.startswith("rankscope anatomy: ") and len(err.strip().splitlines()) == 1, err


# --- real runs: the trainer with a slow link; a clean run against a straggler run ---------------

#: a small model on few ranks: 8 ranks on the two shared cores would make a noisy yardstick
SMALL = ["--layers", "2", "--hidden", "128", "--heads", "4", "--seq", "64", "--vocab", "512", "--micro-batch", "4",
         "--global-batch", "16", "--timeout", "120"]  # fmt: skip
SLOW_LINK = (1, 3, 100.0)  # src, dst, delay_ms: stage 0 -> stage 1 of the second replica
# rank, factor, from step. A large factor: this machine's two cores differ by up to 20% for minutes,
# so one rank of a clean run computes some 35 ms a step longer than the other. The cost counts that
# as the straggler's too when it is on the slower core (it is slower than its peer by that much
# more), while the clean run's step, set by its slower rank, holds it: at a factor of 3 that was
# 15-30% of the time added, at 5 it is under 10%.
STRAGGLER = (1, 5.0, 6)
STRAGGLER_STEPS = 14


def _collect(runner, tmp: Path, runs: list[tuple[str, list[str], int, int]], incident: str | None = None) -> Path:  # noqa: ANN001
    """One collector on a new store, the training runs (run id, flags, ranks, steps) one after the other, each
    ``rankscope train`` with the agent on, each waited for until the collector stored its last step and every
    rank's end (a loaded machine delays them), and the last run until its diagnosis found an ``incident`` of
    that kind (if given); the collector stopped. Returns the store."""
    from conftest import start_collector

    from rankscope.collector.client import Client
    from rankscope.harness.orchestration import CLI, agent_env

    collector = start_collector(runner, tmp / "store", "--diagnose-every", "1", "--flush-interval", "0.5", name=f"collector-{tmp.name}")
    with Client(collector.target) as client:
        for run_id, flags, ranks, steps in runs:
            train = runner.start([*CLI, "train", *flags], env=agent_env(collector.target, run_id, tmp / f"spool-{run_id}"), name=run_id)
            assert train.wait(300) == 0, train.output()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                stored = client.query(STORED_SQL, {"run": run_id}).to_pylist()[0]
                if stored["steps"] >= steps and stored["ended"] >= ranks:
                    break
                time.sleep(0.5)
            assert stored["steps"] >= steps and stored["ended"] >= ranks, f"{run_id}: stored {stored} of {steps} steps, {ranks} ranks"
        deadline = time.monotonic() + (60 if incident else 2)  # the last diagnosis passes
        while time.monotonic() < deadline:
            found = client.query("SELECT kind FROM incidents FINAL WHERE run_id = {run:String}", {"run": runs[-1][0]}).to_pylist()
            if incident and any(i["kind"] == incident for i in found):
                time.sleep(3)  # a few more passes over the whole run: its evidence as the diagnosis leaves it
                break
            time.sleep(0.5)
    collector.proc.kill()
    return tmp / "store"


STORED_SQL = (
    "SELECT (SELECT max(step) FROM step_segments WHERE run_id = {run:String}) AS steps, "
    "(SELECT uniqExact(rank) FROM exits WHERE run_id = {run:String}) AS ended"
)


def _json(*args: str) -> object:
    done = subprocess.run([sys.executable, "-m", "rankscope.cli.main", *args], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def slow_link_run(module_runner, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    src, dst, delay_ms = SLOW_LINK
    flags = ["--tp", "1", "--pp", "2", "--dp", "2", "--steps", "8", *SMALL, "--inject", f"slow_link:src={src},dst={dst},delay_ms={delay_ms:g}"]
    store = _collect(module_runner, tmp_path_factory.mktemp("slow-link"), [("slow-link", flags, 4, 8)], incident="slow_link")
    return store, "slow-link"


@pytest.mark.slow
@pytest.mark.foreground
@pytest.mark.timeout(420)
def test_a_slow_link_is_the_pairs_bubble_and_on_the_critical_path_delay_by_delay(slow_link_run) -> None:
    store, run_id = slow_link_run
    src, dst, delay_ms = SLOW_LINK
    found = _json("anatomy", "--store", str(store), "--run", run_id, "--steps", "3-7", "--format", "json")
    per_rank = {r["rank"]: r for r in found["by_rank"]}
    microbatches = 2  # global batch 16 / (micro-batch 4 x dp 2): each step sends two activations over the link
    # the receiver waits for each late activation: the pair's bubble, against the other replica's same stage
    extra_bubble = per_rank[dst]["bubble_ms"] - per_rank[dst - 1]["bubble_ms"]
    assert extra_bubble == pytest.approx(microbatches * delay_ms, rel=0.3), per_rank
    # on the critical path: the sender's delayed sends, each about the delay, and the receiver waiting on it
    path = found["critical_path"]["path"]
    late = [link for link in path if link["rank"] == src and link["kind"] == "comm" and link["duration_ms"] > delay_ms / 2]
    assert late and all(delay_ms * 0.9 < link["duration_ms"] < delay_ms * 1.5 for link in late), path
    assert any(link["rank"] == dst and link["kind"] == "p2p" and link["waited_on"] == src for link in path), path
    # their excess over the sender's stage peers: about the delay each (a busy machine may make another rank slowest)
    excess = sum(c["cost_ms"] for c in found["critical_path"]["costs"] if c["rank"] == src and c["kind"] == "comm")
    assert excess == pytest.approx(sum(link["duration_ms"] for link in late), rel=0.1), found["critical_path"]["costs"]
    # the incident cites what the link costs
    incidents = _json("sql", "--store", str(store), "--format", "json", "--param", f"run={run_id}",
                      "SELECT kind, ranks, summary, evidence FROM incidents FINAL WHERE run_id = {run:String}")  # fmt: skip
    slow = [i for i in incidents if i["kind"] == "slow_link"]
    assert slow and "of step time (critical path of step" in slow[0]["summary"], incidents
    assert json.loads(slow[0]["evidence"])["critical_path_cost"]["share"] > 0.2


@pytest.fixture(scope="module")
def straggler_runs(module_runner, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    rank, factor, from_step = STRAGGLER
    flags = ["--tp", "1", "--pp", "1", "--dp", "2", "--steps", str(STRAGGLER_STEPS), *SMALL, "--hidden", "256", "--seq", "128"]
    inject = ["--inject", f"straggler:rank={rank},factor={factor:g},from_step={from_step}"]
    runs = [("clean", flags, 2, STRAGGLER_STEPS), ("straggler", [*flags, *inject], 2, STRAGGLER_STEPS)]
    store = _collect(module_runner, tmp_path_factory.mktemp("straggler"), runs)
    return store, "clean", "straggler"


def _step_times(store: Path, run_id: str) -> dict[int, float]:
    rows = _json("sql", "--store", str(store), "--format", "json", "--param", f"run={run_id}",
                 "SELECT step, max(value) AS s FROM step_metrics WHERE run_id = {run:String} AND name = 'step_time_s' GROUP BY step")  # fmt: skip
    return {int(r["step"]): float(r["s"]) * 1e3 for r in rows}  # type: ignore[union-attr]


def _compute_times(store: Path, run_id: str, rank: int) -> dict[int, float]:
    """A rank's forward and backward time per step, in ms."""
    rows = _json("sql", "--store", str(store), "--format", "json", "--param", f"run={run_id}", "--param", f"rank={rank}",
                 "SELECT step, sum(total_ns) AS ns FROM step_segments WHERE run_id = {run:String} AND rank = {rank:UInt32} "
                 "AND name IN ('forward', 'backward') GROUP BY step")  # fmt: skip
    return {int(r["step"]): float(r["ns"]) / 1e6 for r in rows}  # type: ignore[union-attr]


#: each step's critical path in one process (``rankscope anatomy --step`` is one process per step)
PATHS_SCRIPT = """
import json, sys
from pathlib import Path
from rankscope.collector.anatomy import critical_path
from rankscope.collector.client import open_reader
reader = open_reader(store=Path(sys.argv[1]))
out = {}
for step in map(int, sys.argv[3:]):
    path = critical_path(lambda sql, params: reader.query(sql, params), sys.argv[2], step)
    out[step] = {"step_ms": path.step_ns / 1e6, "cost_ms": {str(r): ns / 1e6 for r, ns in path.rank_costs()},
                 "on_path": sorted({(link.rank, link.what) for link in path.links})}
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.foreground
@pytest.mark.timeout(420)
def test_a_stragglers_cost_is_what_it_adds_to_the_step_against_a_clean_run(straggler_runs) -> None:
    """The straggler's cost on the critical path of each slow step against the step time it added over a clean run.

    The two runs follow each other on a machine shared with other work, whose load moves step times
    by a factor of two within a minute, and the straggler's own extra work slows its peer's compute
    (they share two cores): the clean run's steps are scaled by how much slower the peer computed in
    the same steps of the straggler run (the machine's load then, as the peer felt it). Each slow
    step's time less its cost is what the step would have taken had the straggler been as fast as its
    peer; their median is compared with the scaled clean run's. The tolerance is 10% of the time
    added, or three standard errors of the comparison (from how the steps of each window vary) where
    that is more.
    """
    store, clean_id, straggler_id = straggler_runs
    rank, _, from_step = STRAGGLER
    after = range(from_step, STRAGGLER_STEPS)  # the last step shuts down
    done = subprocess.run([sys.executable, "-c", PATHS_SCRIPT, str(store), straggler_id, *map(str, after)],
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    paths = {int(k): v for k, v in json.loads(done.stdout).items()}
    # on the path of (nearly) every slow step: a step where the shared machine slowed its peer more is the exception
    on_path = [step for step, path in paths.items() if {(rank, "forward"), (rank, "backward")} <= {tuple(x) for x in path["on_path"]}]
    assert len(on_path) >= 0.75 * len(paths), paths
    costs = {step: path["cost_ms"].get(str(rank), 0.0) for step, path in paths.items()}
    clean, slow = _step_times(store, clean_id), _step_times(store, straggler_id)
    peer = 1 - rank
    peer_slow, peer_clean = _compute_times(store, straggler_id, peer), _compute_times(store, clean_id, peer)
    (sp, se_sp), (cp, se_cp) = _median_se(peer_slow[s] for s in after), _median_se(peer_clean[s] for s in after)
    (ca, se_ca) = _median_se(clean[s] for s in after)
    (without, se_without) = _median_se(slow[s] - costs[s] for s in after)  # each slow step less its straggler's cost
    load = sp / cp  # how much slower the peer computed beside the straggler than in the clean run
    expected = load * ca  # the clean run's step under the straggler run's load
    added = statistics.median(slow[s] for s in after) - expected
    se = (se_without**2 + (load * se_ca) ** 2 + (expected * ((se_sp / sp) ** 2 + (se_cp / cp) ** 2) ** 0.5) ** 2) ** 0.5
    tolerance = max(0.10 * added, 3 * se)
    detail = (f"slow steps less the straggler's cost: {without:.1f} ms against the clean run's {ca:.1f} x {load:.2f} (load) = "
              f"{expected:.1f} ms: off by {without - expected:+.1f} ms of the {added:.1f} ms added ({(without - expected) / added:+.0%}); "
              f"tolerance {tolerance:.1f} ms (3 standard errors: {3 * se:.1f}); costs {[round(costs[s]) for s in after]} ms; "
              f"step times: clean {[round(clean[s]) for s in sorted(clean)]}, straggler {[round(slow[s]) for s in sorted(slow)]} ms")  # fmt: skip
    print(detail)
    assert added > 0 and abs(without - expected) <= tolerance, detail


def _median_se(values) -> tuple[float, float]:
    """The median and its standard error (1.253 sigma / sqrt(n), sigma from the median absolute deviation)."""
    values = list(values)
    mid = statistics.median(values)
    mad = statistics.median(abs(v - mid) for v in values)
    return mid, 1.253 * 1.4826 * mad / len(values) ** 0.5
