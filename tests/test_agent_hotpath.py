"""The hot path of collectives and spans: raw tuples appended on the caller's thread, rows made by
the background thread, nothing recorded lost.

Each collective test runs in a child process with a 1-rank gloo group (a default process group
must not outlive a test in the pytest process), with the agent's Collectives installed by hand
and no background thread: the test calls ``poll`` and ``drain`` where that thread would.
"""

from __future__ import annotations

import gc
import json
import sys
import textwrap

import numpy as np
import pytest

from conftest import ProcRunner
from rankscope.agent.recorder import Recorder
from rankscope.agent.state import RankState
from rankscope.agent.timing import CpuClock
from rankscope.protos.v1 import telemetry_pb2 as pb

SETUP = """
    import gc, json, tempfile, time
    import numpy as np, torch, torch.distributed as dist
    from rankscope.agent import collective_patches as P, collective_tracker as T
    from rankscope.agent.process_groups import Groups
    from rankscope.agent.recorder import Recorder
    from rankscope.agent.state import RankState
    from rankscope.agent.timing import CpuClock
    from rankscope.protos.v1 import telemetry_pb2 as pb

    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    import atexit; atexit.register(dist.destroy_process_group)  # gloo's threads left to the exit abort it now and then
    rec = Recorder(CpuClock(), RankState())
    c = T.Collectives(rec, Groups())
    P.install(c)

    def rows():
        c.poll()
        out = []
        for batch in rec.drain():
            if isinstance(batch, pb.CollectiveBatch):
                s = list(batch.strings)
                cols = {f: np.frombuffer(getattr(batch, f), t) for f, t in (("group", "<i4"), ("seq", "<i8"), ("op", "<i4"),
                        ("nbytes", "<i8"), ("dtype", "<i4"), ("peer", "<i4"), ("issue_ns", "<i8"), ("start_ns", "<i8"),
                        ("end_ns", "<i8"), ("state", "u1"), ("step", "<i4"))}
                for i in range(batch.count):
                    r = {k: int(v[i]) for k, v in cols.items()}
                    r["group"], r["op"], r["dtype"] = s[r["group"]], s[r["op"]], s[r["dtype"]] if r["dtype"] >= 0 else ""
                    out.append(r)
        return sorted(out, key=lambda r: (r["group"], r["seq"]))
"""


def run_child(proc_runner: ProcRunner, body: str, name: str) -> str:
    code = textwrap.dedent(SETUP) + textwrap.dedent(body)
    proc = proc_runner.start([sys.executable, "-c", code], env={"RANKSCOPE_ENABLE": "", "RANK": "", "WORLD_SIZE": ""}, name=name)
    assert proc.wait(120) == 0, proc.output()
    return proc.stdout


@pytest.mark.slow
def test_every_collective_keeps_what_it_recorded(proc_runner: ProcRunner) -> None:
    """Synchronous and asynchronous calls: group, sequence number, op, bytes, dtype, peer, times,
    state and step, all derived off the caller's thread from what the wrappers queued."""
    out = run_child(
        proc_runner,
        """
        before = time.time_ns()
        rec.set_step(3)
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4, dtype=torch.float64))
        rec.set_step(4)
        work = dist.all_reduce(torch.ones(2, dtype=torch.int64), async_op=True)  # completes in a callback
        work.wait()
        dist.broadcast(torch.ones(3, dtype=torch.bfloat16), 0)
        dist.all_gather([torch.zeros(5)], torch.ones(5))
        gc.collect()  # what the hot path queued holds plain values only: the collector lets go of it
        print(json.dumps({"queued": len(c.issued), "tracked": sum(gc.is_tracked(r) for r in c.issued)}))
        after = time.time_ns()
        got = rows()
        assert all(before <= r["issue_ns"] <= r["start_ns"] <= r["end_ns"] <= after for r in got), got
        print(json.dumps([(r["group"], r["seq"], r["op"], r["nbytes"], r["dtype"], r["peer"], r["state"], r["step"]) for r in got]))
        """,
        "hotpath-rows",
    )
    queued, recorded = (__import__("json").loads(line) for line in out.splitlines())
    assert queued == {"queued": 5, "tracked": 0}
    done = pb.COLLECTIVE_STATE_COMPLETED
    assert [tuple(r) for r in recorded] == [
        ("default_pg", 1, "all_reduce", 16, "float32", -1, done, 3),
        ("default_pg", 2, "all_reduce", 32, "float64", -1, done, 3),
        ("default_pg", 3, "all_reduce", 16, "int64", -1, done, 4),
        ("default_pg", 4, "broadcast", 6, "bfloat16", -1, done, 4),
        ("default_pg", 5, "all_gather", 20, "float32", -1, done, 4),
    ]


@pytest.mark.slow
def test_an_operation_in_flight_shows_until_it_completes_and_one_left_at_exit_is_pending(proc_runner: ProcRunner) -> None:
    """A Work that has not completed (its future unset) enters the heartbeat's list, is marked
    waited for once a thread waits in it, leaves when it completes; one still open at exit
    becomes a PENDING row."""
    out = run_child(
        proc_runner,
        """
        T.FLIGHT_AFTER_S = 0.0
        group = dist.new_group([0], group_desc="dp[0]")
        futures = [torch.futures.Future() for _ in range(2)]
        works = [torch._C._distributed_c10d._create_work_from_future(f) for f in futures]
        opts = dist.AllreduceOptions()  # asyncOp: true
        def issuing(work):  # torch's all-reduce runs (the group's counter moves), the caller gets ``work``
            return lambda pg, *args: (P._originals["allreduce"](pg, *args).wait(), work)[1]
        for work in works:
            P._method_wrapper(issuing(work), P.METHODS["allreduce"])(group, [torch.ones(2)], opts)
        c.poll()
        print(json.dumps([(o.group, o.seq, o.op, o.waiting) for o in rec.state.in_flight()]))
        P._wait_wrapper(lambda work, *args: True)(works[0])  # a thread waits in the first one
        c.poll()
        print(json.dumps([(o.group, o.seq, o.waiting) for o in rec.state.in_flight()]))
        futures[0].set_result([torch.ones(2)])  # completes: its callback takes it out of the list at once
        print(json.dumps([o.seq for o in rec.state.in_flight()]))
        got = rows()
        print(json.dumps([(r["group"], r["seq"], r["state"]) for r in got]), json.dumps([o.seq for o in rec.state.in_flight()]))
        c.finish_all()
        print(json.dumps([(r["group"], r["seq"], r["state"], r["end_ns"]) for r in rows()]))
        """,
        "hotpath-flight",
    )
    lines = out.splitlines()
    assert lines[0] == '[["dp[0]", 1, "all_reduce", false], ["dp[0]", 2, "all_reduce", false]]'
    assert lines[1] == '[["dp[0]", 1, true], ["dp[0]", 2, false]]'
    assert lines[2] == "[2]"  # before any poll
    assert lines[3] == f'[["dp[0]", 1, {pb.COLLECTIVE_STATE_COMPLETED}]] [2]'
    assert lines[4] == f'[["dp[0]", 2, {pb.COLLECTIVE_STATE_PENDING}, 0]]'


@pytest.mark.slow
def test_collectives_issued_behind_the_wrappers_back_are_gaps_not_rows(proc_runner: ProcRunner) -> None:
    """Sequence numbers come from the backend's counter: operations the wrappers did not see leave
    numbers unclaimed (gaps, for the flight recorder), and later calls keep their true numbers."""
    out = run_child(
        proc_runner,
        """
        c.fr_interval_s = 1e9  # no flight-recorder look here: the gaps stay as found
        t = torch.ones(1)
        dist.all_reduce(t)
        P.uninstall()
        dist.all_reduce(t)
        dist.all_reduce(t)
        P.install(c)
        dist.all_reduce(t)
        got = rows()
        print(json.dumps([r["seq"] for r in got]), json.dumps(sorted(seq for _, seq in c._gaps)))
        """,
        "hotpath-gaps",
    )
    assert out.split() == ["[1,", "4]", "[2,", "3]"]


@pytest.mark.slow
def test_a_call_that_leaves_the_counter_alone_has_the_counters_number(proc_runner: ProcRunner) -> None:
    """NCCL numbers the collectives of a coalesced block when the block begins, so the calls inside
    it do not move the group's counter: each has the number the counter holds, as in torch's
    flight recorder, and no gap opens."""
    out = run_child(
        proc_runner,
        """
        c.fr_interval_s = 1e9
        world = dist.group.WORLD
        c.channel(world).reread = world._get_sequence_number_for_group  # as on NCCL (gloo has no coalesced blocks)
        t = torch.ones(1)
        dist.all_reduce(t)
        inside = lambda pg, *args: None  # a call inside a coalesced block: the counter stays at 1
        for _ in range(2):
            P._method_wrapper(inside, P.METHODS["allreduce"])(dist.group.WORLD, [t], dist.AllreduceOptions())
        dist.all_reduce(t)
        print(json.dumps([r["seq"] for r in rows()]), json.dumps(sorted(seq for _, seq in c._gaps)))
        """,
        "hotpath-coalesced",
    )
    assert out.split() == ["[1,", "1,", "1,", "2]", "[]"]


@pytest.mark.slow
def test_every_gloo_collective_moves_the_counter_by_one(proc_runner: ProcRunner) -> None:
    """Why the wrappers read a gloo group's counter only before the call (``Channel.reread``):
    every collective method moves it by exactly one, and gloo has no coalesced blocks."""
    out = run_child(
        proc_runner,
        """
        P.uninstall()
        moved = {}
        PG = torch._C._distributed_c10d.ProcessGroup
        def checking(name, original):
            def call(pg, *args, **kwargs):
                before = pg._get_sequence_number_for_group()
                work = original(pg, *args, **kwargs)
                moved.setdefault(name, set()).add(pg._get_sequence_number_for_group() - before)
                return work
            return call
        for name, (_, _, kind) in P.METHODS.items():
            if kind == "c" and hasattr(PG, name):
                setattr(PG, name, checking(name, getattr(PG, name)))
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)])
        dist.all_gather([torch.empty(4)], t)
        dist.all_gather_into_tensor(torch.empty(4), t)
        dist.reduce_scatter_tensor(torch.empty(4), t)
        dist.broadcast(t, 0)
        dist.reduce(t, 0)
        dist.gather(t, [torch.empty(4)], 0)
        dist.scatter(t, [torch.ones(4)], 0)
        dist.all_to_all_single(torch.empty(4), t)
        dist.all_gather_object([None], {"a": 1})
        dist.barrier()
        refused = ""
        try:
            with dist._coalescing_manager(device=torch.device("cpu")):
                dist.all_reduce(t)
        except RuntimeError as e:
            refused = str(e)
        print(json.dumps({"coalescing": refused}))
        print(json.dumps({name: sorted(steps) for name, steps in moved.items()}))
        """,
        "hotpath-gloo-counter",
    )
    coalescing, moved = (json.loads(line) for line in out.splitlines())
    assert "does not implement startCoalescing" in coalescing["coalescing"]
    assert len(moved) >= 10 and all(steps == [1] for steps in moved.values()), moved


@pytest.mark.slow
def test_waiting_in_an_operation_without_a_future_splits_the_spans_and_shows(proc_runner: ProcRunner) -> None:
    """A Work without a future completes when its wait returns; the wait still ends the open
    compute piece and marks the operation waited for in the heartbeat's list."""
    out = run_child(
        proc_runner,
        """
        T.FLIGHT_AFTER_S = 0.0
        class NoFuture:
            def get_future(self):
                raise RuntimeError("no future")
        work = NoFuture()
        with rec.span("forward", "compute", 1, None, {}):
            # torch's all-reduce runs (its own wait: no split here), the caller gets ``work``
            issuing = lambda pg, *args: (P._originals["wait"](P._originals["allreduce"](pg, *args)), work)[1]
            P._method_wrapper(issuing, P.METHODS["allreduce"])(dist.group.WORLD, [torch.ones(1)], dist.AllreduceOptions())
            c.poll()
            seen = [(o.seq, o.waiting) for o in rec.state.in_flight()]
            P._wait_wrapper(lambda w, *args: c.poll() or seen.extend((o.seq, o.waiting) for o in rec.state.in_flight()))(work)
        c.poll()
        spans = sum(b.count for b in rec.drain() if isinstance(b, pb.SpanBatch))
        print(json.dumps({"seen": seen, "after": len(rec.state.in_flight()), "pieces": spans}))
        """,
        "hotpath-no-future",
    )
    assert json.loads(out) == {"seen": [[1, False], [1, True]], "after": 0, "pieces": 2}


def test_a_value_a_column_cannot_hold_drops_its_row_alone() -> None:
    """Rows are checked when the background thread makes columns of them, not on the hot path."""
    rec = Recorder(CpuClock(), RankState())
    name = rec.strings.id("s")
    rec.add_span(name, 0, 1, -1, 1, 2, -1)
    rec.add_span(name, 0, 2**40, -1, 1, 2, -1)  # a step beyond int32
    rec.add_span(name, 0, 3, -1, 1, 2, -1)
    (batch,) = list(rec.drain())
    assert np.frombuffer(batch.step, "<i4").tolist() == [1, 3] and rec.state.dropped == 1


def test_span_rows_are_plain_tuples_the_garbage_collector_lets_go_of() -> None:
    rec = Recorder(CpuClock(), RankState())
    for _ in range(3):
        with rec.span("forward", "compute", 1, 0, {}):
            pass
    gc.collect()
    assert len(rec._span_rows) == 3 and not any(gc.is_tracked(r) for r in rec._span_rows)
