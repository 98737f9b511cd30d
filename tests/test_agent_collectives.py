"""Collectives recorded in real multi-process runs on gloo, read back from a real collector.

The scripts under tests/scripts/ know nothing about rankscope: the agent starts through its
start-up hook because ``RANKSCOPE_ENABLE=1`` is set, records through the ProcessGroup wrappers
and the flight recorder, and sends through its Transport to a ``rankscope collector`` process
on an embedded store. One collector serves the module; each script is one run.

"Lined up" means what the hang and straggler diagnosis needs: every (group, seq) of a
collective is present on every member of the group with the same op, and every point-to-point
(group, sender, receiver, seq) has its send on the sender and its receive on the receiver.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, SCRIPTS, Proc, ProcRunner, Running, free_port, start_collector
from rankscope.collector.client import Client
from rankscope.collector.diagnosis.crash import TIMEOUT_WORDS

pytestmark = pytest.mark.slow

NOT_LAUNCHED = {"RANK": "", "WORLD_SIZE": "", "LOCAL_RANK": "", "TORCHELASTIC_RUN_ID": ""}


@pytest.fixture(scope="module")
def collector(module_runner: ProcRunner, tmp_path_factory: pytest.TempPathFactory) -> Running:
    """``rankscope collector --store DIR`` on a free port, once it listens."""
    return start_collector(module_runner, tmp_path_factory.mktemp("agent-store") / "data", "--flush-interval", "0.2")


@pytest.fixture(scope="module")
def client(collector: Running) -> Iterator[Client]:
    with Client(collector.target) as c:
        yield c


def agent_env(collector: Running, spool: Path, **extra: str) -> dict[str, str]:
    """The agent on, pointed at the test's collector; nothing else."""
    return {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": collector.target, "RANKSCOPE_SPOOL_DIR": str(spool), **extra}


def query(client: Client, sql: str, run: str, **params: object) -> list[dict[str, Any]]:
    return client.query(sql, {"run": run, **params}).to_pylist()


def run_of(client: Client, script: str) -> str:
    """The run id the ranks of ``script`` agreed on (found through their registration)."""
    found = client.query("SELECT DISTINCT run_id FROM runs WHERE config LIKE {p:String}", {"p": f"%{script}%"}).to_pylist()
    assert len(found) == 1, found
    return found[0]["run_id"]


def exits(client: Client, run: str, world: int, spool: Path, timeout_s: float = 30.0) -> dict[int, dict[str, Any]]:
    """Every rank's EndOfRank, once all of them are stored (the collector writes in batches). A rank whose
    collector was too busy to take its last rows before it exited spooled them in ``spool`` (CI of 20bd185:
    2 of 4 exits stored): replayed with the command a user would run."""
    if spool.is_dir() and any(spool.rglob("*.seg")):
        subprocess.run([*CLI, "spool", "replay", str(spool), "--collector", client.target], check=True, capture_output=True, timeout=120)
    deadline = time.monotonic() + timeout_s
    while True:
        rows = query(client, "SELECT rank, reason, exit_code, signal, message FROM exits WHERE run_id = {run:String}", run)
        if len(rows) >= world or time.monotonic() > deadline:
            return {r["rank"]: r for r in rows}
        time.sleep(0.3)


def collectives(client: Client, run: str) -> list[dict[str, Any]]:
    return query(
        client,
        "SELECT rank, group_name AS g, seq, op, peer, nbytes, state, step, toUnixTimestamp64Nano(issue_time) AS issue,"
        " toUnixTimestamp64Nano(end_time) AS end FROM collectives WHERE run_id = {run:String}",
        run,
    )


def members(client: Client, run: str, rows: list[dict[str, Any]], timeout_s: float = 10.0) -> dict[str, list[int]]:
    """Group name -> member ranks, as the ranks registered them (one member list per name), once
    every group the collective ``rows`` name is stored: a rank's last registration, sent with its
    end, may be written a flush after the end."""
    used = {r["g"] for r in rows}
    deadline = time.monotonic() + timeout_s
    while True:
        named: dict[str, set[tuple[int, ...]]] = collections.defaultdict(set)
        for g in query(client, "SELECT name, ranks FROM groups WHERE run_id = {run:String}", run):
            named[g["name"]].add(tuple(g["ranks"]))
        if used <= named.keys() or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert all(len(v) == 1 for v in named.values()), f"a group name stands for different members: {dict(named)}"
    return {name: list(next(iter(v))) for name, v in named.items()}


def assert_lined_up(rows: list[dict[str, Any]], groups: dict[str, list[int]]) -> None:
    by_key: dict[tuple[str, int], dict[int, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    pairs: dict[tuple[str, int, int, int], list[tuple[str, int]]] = collections.defaultdict(list)
    for r in rows:
        if r["peer"] < 0:
            by_key[(r["g"], r["seq"])][r["rank"]].append(r["op"])
        else:
            sender, receiver = (r["rank"], r["peer"]) if r["op"] == "send" else (r["peer"], r["rank"])
            pairs[(r["g"], sender, receiver, r["seq"])].append((r["op"], r["nbytes"]))
    for (group, seq), ops in by_key.items():
        assert sorted(ops) == sorted(groups[group]), f"{group} #{seq} is missing on some members: {dict(ops)}"
        assert len({tuple(v) for v in ops.values()}) == 1, f"{group} #{seq} differs between members: {dict(ops)}"
    for key, ends in pairs.items():
        assert sorted(op for op, _ in ends) == ["recv", "send"] and ends[0][1] == ends[1][1], (key, ends)
    assert by_key, "no collectives recorded"


def test_a_plain_ddp_script_with_only_the_switch_on(
    torchrun: Callable[..., Proc], collector: Running, client: Client, tmp_path: Path
) -> None:
    proc = torchrun([str(SCRIPTS / "ddp_plain.py"), "--steps", "4"], 4, env=agent_env(collector, tmp_path))
    assert proc.wait(180) == 0, proc.output()
    run = run_of(client, 'ddp_plain.py", "--steps", "4"]')  # the argv as registered: not the --by-hand run
    assert {r: e["reason"] for r, e in exits(client, run, 4, tmp_path).items()} == {r: "normal" for r in range(4)}
    # The forked data-loader workers stayed quiet: one process and one exit per rank.
    assert query(client, "SELECT uniqExact(rank, pid) AS n FROM ranks WHERE run_id = {run:String}", run) == [{"n": 4}]
    assert query(client, "SELECT count() AS n FROM exits WHERE run_id = {run:String}", run) == [{"n": 4}]

    rows = collectives(client, run)
    assert_lined_up(rows, members(client, run, rows))
    reduces = [r for r in rows if r["op"] == "all_reduce"]  # DDP's C++ reducer: seen through the flight recorder
    assert {(r["rank"], r["step"]) for r in reduces} == {(rank, step) for rank in range(4) for step in range(1, 5)}
    assert {(r["g"], r["nbytes"], r["state"]) for r in reduces} == {("default_pg", (32 * 64 + 64 + 64 * 8 + 8) * 4, "completed")}
    spans = query(client, "SELECT rank, name, kind, step, toUnixTimestamp64Nano(end_time) AS end FROM spans WHERE run_id = {run:String}", run)
    names = ("forward", "backward", "grad_sync", "optimizer")
    assert {(s["rank"], s["name"], s["step"]) for s in spans} == {(rank, name, step) for rank in range(4) for name in names for step in range(1, 5)}
    assert {s["name"]: s["kind"] for s in spans} == {"forward": "compute", "backward": "compute", "grad_sync": "comm", "optimizer": "optimizer"}
    # gloo's flight recorder has no times: each ends when DDP's end-of-backward wait for it did (its grad_sync span)
    synced = {(s["rank"], s["step"]): s["end"] for s in spans if s["name"] == "grad_sync"}
    # (the two times are read one after the other: 10 ms allows a loaded host's preemption between them)
    late = [(r["rank"], r["step"], r["seq"], r["end"] - synced[(r["rank"], r["step"])]) for r in reduces
            if not r["issue"] <= r["end"] <= synced[(r["rank"], r["step"])] + 10_000_000]  # fmt: skip
    assert not late, late
    times = query(client, "SELECT rank, step FROM step_metrics WHERE run_id = {run:String} AND name = 'step_time_s'", run)
    assert {(t["rank"], t["step"]) for t in times} == {(rank, step) for rank in range(4) for step in range(1, 5)}


def test_a_script_without_an_optimizer_gets_a_step_per_forward_and_backward(
    torchrun: Callable[..., Proc], collector: Running, client: Client, tmp_path: Path
) -> None:
    run = "by-hand"
    proc = torchrun([str(SCRIPTS / "ddp_plain.py"), "--steps", "4", "--by-hand"], 2, env=agent_env(collector, tmp_path, RANKSCOPE_RUN_ID=run))
    assert proc.wait(180) == 0, proc.output()
    assert len(exits(client, run, 2, tmp_path)) == 2
    spans = query(client, "SELECT rank, name, step FROM spans WHERE run_id = {run:String}", run)
    assert sorted((s["rank"], s["name"], s["step"]) for s in spans) == sorted(
        (rank, name, step) for rank in range(2) for name in ("forward", "backward", "grad_sync") for step in range(1, 5)
    )
    # DDP's reducer issues them in C++: found in the flight recorder, the last ones when the script
    # destroys its process group (about a second after the run began, long before a regular look)
    reduces = [r for r in collectives(client, run) if r["op"] == "all_reduce"]
    assert sorted((r["rank"], r["step"]) for r in reduces) == [(rank, step) for rank in range(2) for step in range(1, 5)]
    times = query(client, "SELECT rank, step FROM step_metrics WHERE run_id = {run:String} AND name = 'step_time_s'", run)
    assert sorted((t["rank"], t["step"]) for t in times) == [(rank, step) for rank in range(2) for step in range(1, 4)]


def test_every_operation_lines_up_and_plain_processes_agree_on_a_run_id(
    proc_runner: ProcRunner, collector: Running, client: Client, tmp_path: Path
) -> None:
    port = free_port()
    procs = [
        proc_runner.start(
            [sys.executable, str(SCRIPTS / "collectives_tour.py"), "--rank", str(r), "--world", "2", "--port", str(port)],
            env={**agent_env(collector, tmp_path), **NOT_LAUNCHED, "OMP_NUM_THREADS": "1"}, name=f"tour-{r}",
        )
        for r in range(2)
    ]  # fmt: skip
    for r, proc in enumerate(procs):
        assert proc.wait(120) == 0 and f"tour ok {r}" in proc.stdout, proc.output()
    run = run_of(client, "collectives_tour.py")  # no launcher named the run: the store did
    assert sorted(exits(client, run, 2, tmp_path)) == [0, 1]

    rows = collectives(client, run)
    assert_lined_up(rows, members(client, run, rows))
    ops = {rank: collections.Counter((r["g"], r["op"]) for r in rows if r["rank"] == rank) for rank in range(2)}
    assert ops[0] == ops[1] == {
        ("default_pg", "all_reduce"): 2, ("default_pg", "all_gather"): 3,  # all_gather_object: sizes, then data
        ("default_pg", "all_gather_into_tensor"): 1, ("default_pg", "reduce_scatter_tensor"): 1,
        ("default_pg", "broadcast"): 1, ("default_pg", "reduce"): 1, ("default_pg", "gather"): 1,
        ("default_pg", "scatter"): 1, ("default_pg", "all_to_all_single"): 1, ("default_pg", "barrier"): 1,
        ("default_pg", "send"): 2, ("default_pg", "recv"): 2, ("pair", "all_reduce"): 1,
    }  # fmt: skip
    world = sorted((r["seq"], r["op"]) for r in rows if r["rank"] == 0 and r["g"] == "default_pg" and r["peer"] < 0)
    assert [seq for seq, _ in world] == list(range(1, 14))  # the failed call issued nothing and took no number
    sends = sorted((r["seq"], r["peer"], r["nbytes"]) for r in rows if r["rank"] == 0 and r["op"] == "send")
    assert sends == [(1, 1, 12), (2, 1, 20)]  # batch_isend_irecv's, then send's: counted per (sender, receiver)
    assert all(r["state"] == "completed" and r["end"] >= r["issue"] > 0 for r in rows)
    first = min((r for r in rows if r["rank"] == 0 and r["peer"] < 0), key=lambda r: r["seq"])
    assert (first["op"], first["nbytes"]) == ("all_reduce", 16)


@pytest.mark.timeout(480)
def test_ranks_of_mp_spawn_with_accumulation_and_a_crash(
    proc_runner: ProcRunner, collector: Running, client: Client, tmp_path: Path
) -> None:
    """torch.multiprocessing.spawn catches the worker's exception and exits 1, then stops the other
    ranks with SIGTERM: the crashed rank's exception is still what its end reports, and every rank's
    end arrives."""
    script = [sys.executable, str(SCRIPTS / "spawn_accumulate.py"), "--world", "2", "--port", str(free_port())]
    proc = proc_runner.start([*script, "--crash-rank", "1", "--crash-step", "3"],
                             env={**agent_env(collector, tmp_path), **NOT_LAUNCHED, "OMP_NUM_THREADS": "1"}, name="spawn")  # fmt: skip
    # 25 s alone; still running after 120 s in a starved background lane (3 s of CPU in 147 s)
    assert proc.wait(360) != 0 and "spawned rank 1 failed at step 3" in proc.output(None)
    run = run_of(client, "spawn_accumulate.py")  # the spawned processes agreed on one run
    ended = exits(client, run, 2, tmp_path)
    assert (ended[1]["reason"], ended[1]["exit_code"], ended[1]["message"]) == ("exception", 1, "RuntimeError: spawned rank 1 failed at step 3")
    # Rank 0 ends either way: by the launcher's SIGTERM, or first by its collective failing with
    # the peer gone; the two often race, and whichever comes second must not cut the first's report.
    assert ended[0]["reason"] == "signal" and ended[0]["signal"] == 15 or any(w in ended[0]["message"].lower() for w in TIMEOUT_WORDS), ended[0]
    # Steps come from the optimizer, not from forward calls: two microbatches per step.
    spans = query(client, "SELECT rank, step, countIf(name = 'forward') AS forwards FROM spans WHERE run_id = {run:String} "
                          "AND step <= 2 GROUP BY rank, step", run)  # fmt: skip
    assert sorted((s["rank"], s["step"], s["forwards"]) for s in spans) == [(r, s, 2) for r in range(2) for s in (1, 2)]
    reduces = [r for r in collectives(client, run) if r["op"] == "all_reduce" and r["g"] == "default_pg" and r["step"] <= 2]
    assert sorted((r["rank"], r["step"]) for r in reduces) == [(r, s) for r in range(2) for s in (1, 2)]  # one per step, not per microbatch


@pytest.mark.timeout(480)
def test_dtensor_tensor_parallel_inside_fsdp2_lines_up(
    torchrun: Callable[..., Proc], collector: Running, client: Client, tmp_path: Path
) -> None:
    proc = torchrun([str(SCRIPTS / "dtensor_fsdp.py"), "--steps", "3"], 4, env=agent_env(collector, tmp_path))
    assert proc.wait(360) == 0, proc.output()  # 24 s alone; over 180 s once in a starved background lane (CI of 11134ce)
    run = run_of(client, "dtensor_fsdp.py")
    assert len(exits(client, run, 4, tmp_path)) == 4
    rows = collectives(client, run)
    groups = members(client, run, rows)
    assert_lined_up(rows, groups)
    kinds = {(r["g"].split(":")[0], r["op"]) for r in rows}
    # FSDP2 shards over the dp dimension; DTensor's functional all-reduce (C++ only) over tp.
    assert {("mesh_dp", "all_gather_into_tensor"), ("mesh_dp", "reduce_scatter_tensor"), ("mesh_tp", "all_reduce")} <= kinds
    tp_groups = sorted(tuple(ranks) for name, ranks in groups.items() if name.startswith("mesh_tp"))
    assert tp_groups == [(0, 1), (2, 3)]  # DeviceMesh gives both the same description; the names differ
    steps = {r["step"] for r in rows if r["op"] == "reduce_scatter_tensor"}
    assert steps == {1, 2, 3}


def test_a_job_torchrun_restarts_is_one_run_in_two_attempts(
    torchrun: Callable[..., Proc], collector: Running, client: Client, tmp_path: Path
) -> None:
    """torchrun --max-restarts restarts every worker when rank 1 raises: the same run id, the steps
    run again from the start, and each process's rows carry the attempt of the round it ran in.
    A fresh worker store each round: torch 2.13's shared one keeps the first round's gloo addresses,
    and the second round's connectFullMesh then fails now and then (as ``rankscope launch`` runs it)."""
    run = "restarted"
    proc = torchrun(["--max-restarts", "1", str(SCRIPTS / "ddp_plain.py"), "--steps", "3", "--crash-first-attempt-step", "2"], 2,
                    env=agent_env(collector, tmp_path, RANKSCOPE_RUN_ID=run, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))  # fmt: skip
    assert proc.wait(240) == 0, proc.output()
    ranks = query(client, "SELECT rank, attempt FROM ranks WHERE run_id = {run:String}", run)
    assert {(r["rank"], r["attempt"]) for r in ranks} >= {(0, 0), (1, 0), (0, 1), (1, 1)}  # who each rank was in either round
    spans = query(client, "SELECT DISTINCT attempt, rank, step FROM spans WHERE run_id = {run:String} AND name = 'forward'", run)
    first = {(s["rank"], s["step"]) for s in spans if s["attempt"] == 0}
    assert {(0, 1), (1, 1)} <= first and {(s["rank"], s["step"]) for s in spans if s["attempt"] == 1} == {
        (rank, step) for rank in range(2) for step in range(1, 4)
    }
    status = query(client, "SELECT argMax(status, updated) AS status FROM runs WHERE run_id = {run:String}", run)
    assert status == [{"status": "finished"}]
