"""The straggler's arrival signal judged on collectives written by hand into a real store.

Four ranks on two hosts (node-0: ranks 0 and 1), steps 1..20, one collective a step in each group; the ranks arrive a few ms apart in an
order that changes every step (a busy machine's scheduler), unless a rank is made late.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from rankscope.collector.diagnosis import arrivals
from rankscope.collector.diagnosis.context import RunContext
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.migrations import migrate
from rankscope.common.settings import Settings
from test_diagnosis_state import rows

MS = 1_000_000
STEP_NS = 100 * MS
STEPS = range(1, 21)
T0 = 1_800_000_000_000_000_000


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStore]:
    store = EmbeddedStore(tmp_path_factory.mktemp("arrivals") / "store")
    migrate(store, store.database, None)
    yield store
    store.close()


def write(store: EmbeddedStore, run: str, groups: dict[str, list[int]], late: dict[int, tuple[int, int]],
          held: Callable[[str, int], bool] = lambda group, step: True, spread_ms: int = 3) -> RunContext:  # fmt: skip
    """Each group's collective of each step (those ``held`` only); ``late``: rank -> (from step, ms) it arrives
    later by, and the ranks waiting for it in one of their groups carry that wait into their others;
    ``spread_ms``: how far apart the others arrive (a busy machine's scheduler)."""
    cols: dict[str, list[int | str]] = {"rank": [], "group_name": [], "seq": [], "step": [], "issue_time": []}
    for step in STEPS:
        for g, (name, members) in enumerate(sorted(groups.items())):
            if not held(name, step):
                continue
            for i, rank in enumerate(members):
                jitter = ((rank * 7 + step * 3 + g) % 4) * spread_ms * MS // 3  # who comes last changes from step to step
                delay = sum(ms for r, (since, ms) in late.items() if step >= since and (r == rank or (g > 0 and r in groups_of(groups, rank, g))))
                for key, value in (("rank", rank), ("group_name", name), ("seq", step), ("step", step),
                                   ("issue_time", T0 + step * STEP_NS + jitter + delay * MS)):  # fmt: skip
                    cols[key].append(value)
    store.insert_arrow("collectives", rows("collectives", len(cols["rank"]), run_id=run, peer=-1, op="all_reduce", **cols))
    ranks = sorted({r for members in groups.values() for r in members})
    return RunContext(run, lambda sql, params: store.query_arrow(sql, {"attempt": 0, **params}), Settings(),
                      host={r: f"node-{r // 2}" for r in ranks}, stage={r: 0 for r in ranks}, groups=groups,
                      ranks_of_host={f"node-{h}": [r for r in ranks if r // 2 == h] for h in {r // 2 for r in ranks}})  # fmt: skip


def groups_of(groups: dict[str, list[int]], rank: int, g: int) -> set[int]:
    """The ranks ``rank`` waited for in the groups sorted before the ``g``-th (a rank's first group comes first)."""
    return {r for name, members in sorted(groups.items())[:g] if rank in members for r in members}


def test_a_rank_the_others_wait_for_is_named_from_when_it_began(store: EmbeddedStore) -> None:
    ctx = write(store, "one-late", {"default_pg": [0, 1, 2, 3]}, {2: (8, 40)})
    found = arrivals.late_ranks(ctx, 3, 19, STEP_NS / 1e9)
    assert list(found) == [2]
    assert (found[2]["since_step"], found[2]["groups"]) == (8, ["default_pg"])
    assert found[2]["text"].startswith("arrives last at default_pg's collectives, ")
    assert all(37 <= p["late_ms"] <= 43 for p in found[2]["steps"])  # 40 ms, give or take the jitter (up to 3 ms)


def test_a_clean_run_and_a_late_rank_below_the_bar_name_nobody(store: EmbeddedStore) -> None:
    assert arrivals.late_ranks(write(store, "clean", {"default_pg": [0, 1, 2, 3]}, {}), 3, 19, STEP_NS / 1e9) == {}
    # 5 ms late is 5% of the step: what it costs is below straggler_excess
    assert arrivals.late_ranks(write(store, "slightly", {"default_pg": [0, 1, 2, 3]}, {1: (3, 5)}), 3, 19, STEP_NS / 1e9) == {}


def test_a_rank_that_waited_in_one_group_is_not_named_for_arriving_late_in_another(store: EmbeddedStore) -> None:
    """tp groups {0, 1} and {2, 3}, dp groups {0, 2} and {1, 3}: rank 1 is slow, so rank 0 waits for it
    in tp[0] and reaches dp[0] as late as rank 1 reaches dp[1]; rank 0 was never last in tp[0]."""
    groups = {"a_tp[0]": [0, 1], "a_tp[1]": [2, 3], "b_dp[0]": [0, 2], "b_dp[1]": [1, 3]}  # the tp all-reduce first
    found = arrivals.late_ranks(write(store, "tp-dp", groups, {1: (5, 40)}), 3, 19, STEP_NS / 1e9)
    assert list(found) == [1]
    assert found[1]["groups"] == ["a_tp[0]", "b_dp[1]"]


def test_two_late_ranks_of_a_host_taking_turns_at_last_are_named_with_their_host(store: EmbeddedStore) -> None:
    """Ranks 0 and 1 (node-0, both starved) 40 ms late from step 6: each arrives last at about half the
    collectives, so neither is late alone; node-0 arrives after node-1 at every one (issue 29)."""
    ctx = write(store, "host-late", {"default_pg": [0, 1, 2, 3]}, {0: (6, 40), 1: (6, 40)})
    found = arrivals.late_ranks(ctx, 3, 19, STEP_NS / 1e9)
    assert sorted(found) == [0, 1]
    assert found[0]["since_step"] == 6 and found[0]["text"].startswith("with every rank of node-0, arrives last at default_pg's collectives")
    assert all(37 <= p["late_ms"] <= 43 for p in found[0]["steps"])
    # one late rank of a host is that rank, not its host: its host-mate arrives with the others
    assert sorted(arrivals.late_ranks(write(store, "rank-of-host", {"default_pg": [0, 1, 2, 3]}, {1: (6, 40)}), 3, 19, STEP_NS / 1e9)) == [1]


def test_a_rank_is_judged_once_the_rows_of_all_its_groups_are_in(store: EmbeddedStore) -> None:
    """A 2 x 2 mesh (FSDP2 with DTensor), rank 2 late from step 5: its tensor-parallel rows come from the
    flight recorder, read every few seconds, and are in up to step 4 only. Late in the data-parallel groups
    alone so far, rank 2 and rank 3 (which waited for it in a_tp[1]) are named by nobody (campaign seed
    1716390287: for one flush cycle, a rank named live that no later pass named); rank 2 is, once they come."""
    groups = {"a_tp[0]": [0, 1], "a_tp[1]": [2, 3], "b_dp[0]": [0, 2], "b_dp[1]": [1, 3]}
    in_first = lambda group, step: group.startswith("b_dp") or step <= 4  # noqa: E731
    ctx = write(store, "tp-behind", groups, {2: (5, 40)}, held=in_first)
    assert arrivals.late_ranks(ctx, 3, 19, STEP_NS / 1e9) == {}
    write(store, "tp-behind", groups, {2: (5, 40)}, held=lambda group, step: not in_first(group, step))
    found = arrivals.late_ranks(ctx, 3, 19, STEP_NS / 1e9)
    assert list(found) == [2] and found[2]["groups"] == ["a_tp[1]", "b_dp[0]"], found


def test_a_host_last_at_every_step_is_named_though_the_others_spread_as_wide(store: EmbeddedStore) -> None:
    """Eight ranks, two a host; node-0 (both ranks throttled) arrives last at every collective from step 6,
    by 40-80 ms, while the other hosts' ranks spread over 60 ms: at most steps its wait is within their
    spread, and it is late all the same (campaign seed 615622931: node1 throttled beside a CPU hog, last
    at every all-reduce of steps 5-19 by 47-134 ms, the others spread over 62-72 ms, named by no pass).
    Last at every step by less than the others' spread, as a rule: nobody."""
    ranks = list(range(8))
    ctx = write(store, "wide-spread", {"default_pg": ranks}, {0: (6, 100), 1: (6, 100)}, spread_ms=60)
    found = arrivals.late_ranks(ctx, 3, 19, STEP_NS / 1e9)
    assert sorted(found) == [0, 1] and found[0]["since_step"] == 6, found
    assert sum(p["late_ms"] < 60 for p in found[0]["steps"]) > 2, found[0]["steps"]
    assert arrivals.late_ranks(write(store, "wide-spread-less", {"default_pg": ranks}, {0: (6, 80), 1: (6, 80)}, spread_ms=60),
                               3, 19, STEP_NS / 1e9) == {}  # fmt: skip


def test_the_window_is_as_long_as_being_last_by_chance_is_unlikely(store: EmbeddedStore) -> None:
    """One of two is last at all but one of 6 steps by chance once in nine windows; one of four once in
    two hundred. A rank of a pair (FSDP2's 2 x 2 mesh) is judged over 12 steps, a host of four over 6
    (campaign seed 2047607687: node0 of four throttled, last at the job's last 11 steps by 58-215 ms,
    named by no pass; its rank 1 alone was named, by its compute)."""
    assert [arrivals.steps_needed(Settings(), m) for m in (2, 3, 4, 8)] == [12, 8, 6, 6]
    groups = {"a_tp[0]": [0, 1], "a_tp[1]": [2, 3], "b_dp[0]": [0, 2], "b_dp[1]": [1, 3]}
    assert arrivals.late_ranks(write(store, "pair-late-8", groups, {2: (12, 40)}), 3, 19, STEP_NS / 1e9) == {}
    ranks = list(range(8))
    found = arrivals.late_ranks(write(store, "host-of-four-late-7", {"default_pg": ranks}, {0: (13, 40), 1: (13, 40)}), 3, 19, STEP_NS / 1e9)
    assert sorted(found) == [0, 1] and found[0]["since_step"] == 13, found


def compute(store: EmbeddedStore, run: str, cpu_ms: dict[int, float], wall_ms: float = 80) -> None:
    """Each rank's optimizer segment of each step: ``wall_ms`` long, ``cpu_ms[rank]`` of it on the CPU
    (within a couple of percent, as on a quiet machine), and the steps ``STEP_NS`` apart."""
    cols: dict[str, list] = {"rank": [], "step": [], "start_time": [], "end_time": [], "cpu_ns": []}
    for step in STEPS:
        for rank, ms in cpu_ms.items():
            start = T0 + step * STEP_NS
            for key, value in (("rank", rank), ("step", step), ("start_time", start), ("end_time", start + int(wall_ms * MS)),
                               ("cpu_ns", int(ms * (1 + 0.02 * ((rank + step) % 3)) * MS))):  # fmt: skip
                cols[key].append(value)
    store.insert_arrow("spans", rows("spans", len(cols["rank"]), run_id=run, name="optimizer", kind="optimizer", **cols))
    store.insert_arrow("step_metrics", rows("step_metrics", len(STEPS), run_id=run, rank=0, step=list(STEPS), name="step_time_s",
                                            value=STEP_NS / 1e9, time=T0))  # fmt: skip


def test_a_rank_slower_in_cpu_time_is_a_straggler_only_if_its_groups_wait_for_it(store: EmbeddedStore) -> None:
    """Rank 0 spends 50% more CPU time a step than its peers from step 1 (a clean DDP job under the suite:
    ranks 0 and 2 at 65 ms against 44, their vCPU stolen), its wall time the others'. Arriving at the
    all-reduces in turn with them, a few ms apart, it is nobody's straggler; 25 ms late at each from
    step 1, as long as it is slower, its groups wait for it: named, with what they waited."""
    from rankscope.collector.diagnosis import straggler

    ranks = [0, 1, 2, 3]
    for run, late in (("cpu-only", {}), ("cpu-and-late", {0: (1, 25)})):
        ctx = write(store, run, {"default_pg": ranks}, late)
        compute(store, run, {0: 66, 1: 44, 2: 44, 3: 44})
        waited = arrivals.held_back(ctx, [0], 1, 19)
        assert sorted(waited[0]) == list(range(1, 20))
        found = straggler.detect(ctx)
        if not late:
            assert sum(waited[0].values()) / 19 < 3 * MS, waited
            assert found == [], [f.summary for f in found]
        else:
            assert all(21 * MS <= w <= 29 * MS for w in waited[0].values()), waited
            assert [(f.ranks, f.evidence["measure"]) for f in found] == [((0,), "CPU time")], [f.summary for f in found]
            assert 21 <= found[0].evidence["groups_waited_for_it_ms_per_step"] <= 29


def test_a_rank_slower_in_cpu_time_is_not_named_before_its_collectives_of_the_steps_are_in(store: EmbeddedStore) -> None:
    """The same rank 0, 50% more CPU time a step and nobody waiting for it, its all-reduces of steps 3 on
    not stored yet (DDP's come from the flight recorder, seconds late): not named while nothing tells
    whether its groups waited for it (CI of dd7abd5: two ranks raised live that no later pass named),
    nor once they are in and show that nobody did."""
    from rankscope.collector.diagnosis import straggler

    ranks = [0, 1, 2, 3]
    ctx = write(store, "cpu-rows-behind", {"default_pg": ranks}, {}, held=lambda group, step: step <= 2)
    compute(store, "cpu-rows-behind", {0: 66, 1: 44, 2: 44, 3: 44})
    assert arrivals.held_back(ctx, [0], 3, 19) == {0: {}}  # it holds collectives: nothing known of these steps yet
    assert straggler.detect(ctx) == []
    write(store, "cpu-rows-behind", {"default_pg": ranks}, {}, held=lambda group, step: step > 2)
    assert straggler.detect(ctx) == []
