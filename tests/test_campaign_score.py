"""The fault campaign's scoring (rankscope/harness/campaign_score.py): truth against incidents, pure.

The campaign itself (benchmarks/accuracy.py) runs real jobs for minutes and stays out of the suite;
what its tables say rests on these counts.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from rankscope.harness.campaign_score import Tally, Truth, judge


def incident(kind: str, ranks: list[int], hosts: list[str]) -> dict:
    return {"kind": kind, "ranks": ranks, "hosts": hosts, "summary": f"{kind} {ranks}"}


@pytest.mark.timeout(10)
def test_a_trial_is_scored_on_kind_ranks_and_hosts() -> None:
    straggler = Truth("straggler", (5,), ("node-2",))
    right = incident("straggler", [5], ["node-2"])
    # named exactly (ranks in any order): a true positive; anything else raised beside it: false positives
    link = Truth("slow_link", (1, 5), ("node-0", "node-2"))
    assert judge(link, [incident("slow_link", [5, 1], ["node-2", "node-0"])]).outcome == "TP"
    assert (judge(straggler, [right]).tp, judge(straggler, [right]).fp) == (1, 0)
    both = judge(straggler, [incident("slow_link", [1, 5], ["node-0", "node-2"]), right])
    assert (both.tp, both.fn, both.fp, both.wrong_culprit, both.outcome) == (1, 0, 1, 0, "TP+1FP")
    # the right kind naming someone else: a wrong culprit, the fault missed, the incident a false positive
    wrong = judge(straggler, [incident("straggler", [3], ["node-1"])])
    assert (wrong.tp, wrong.fn, wrong.fp, wrong.wrong_culprit, wrong.outcome) == (0, 1, 1, 1, "wrong-culprit")
    # the right rank on the wrong host is not the right culprit either; nothing raised is a plain miss
    assert judge(straggler, [incident("straggler", [5], ["node-3"])]).wrong_culprit == 1
    assert judge(straggler, []).outcome == "FN"
    # a clean trial: every incident is a false alarm
    assert judge(Truth(None), []).outcome == "clean"
    assert judge(Truth(None), [right, right]).fp == 2

    tally = Tally()
    tally.add(judge(straggler, [right]), True, 4.0)
    tally.add(both, True, 10.0)
    tally.add(wrong, True, None)
    tally.add(judge(Truth(None), [right]), False)
    tally.add(judge(Truth(None), []), False)
    # 2 TP, 1 FN, 3 FP (the extra slow link, the wrong straggler, the clean run's alarm)
    assert (tally.precision, tally.recall) == (2 / 5, 2 / 3)
    assert tally.f1 == pytest.approx(2 * 0.4 * (2 / 3) / (0.4 + 2 / 3))
    assert (tally.wrong_culprit_rate, tally.false_alarm_rate) == (1 / 3, 1 / 2)
    assert (tally.percentile(0.5), tally.percentile(0.9)) == (7.0, 10.0)
    assert Tally().precision is None and Tally().percentile(0.5) is None


@pytest.mark.timeout(30)
def test_a_campaign_resumed_keeps_its_played_trials_and_replays_the_unplayed(tmp_path: Path) -> None:
    """``--resume``: the trials in trials.jsonl are kept in the campaign's order; one not played (its
    error) or cut short by a kill is played again; a file of another campaign is refused."""
    spec = importlib.util.spec_from_file_location("accuracy", Path(__file__).parents[1] / "benchmarks" / "accuracy.py")
    accuracy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(accuracy)
    record = {"fault": "none", "truth": {"kind": None, "ranks": [], "hosts": []}, "live_incidents": [], "offline_incidents": [],
              "disagreements": [], "offline_error": "", "error": ""}  # fmt: skip
    jsonl = tmp_path / "trials.jsonl"
    assert accuracy.played(jsonl, [1, 2, 3]) == []
    lines = [{**record, "seed": 3}, {**record, "seed": 1, "error": "TestbedError: no ip"}, {**record, "seed": 2}]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"seed": 4, "fau')  # the last cut short by a kill
    kept = accuracy.played(jsonl, [1, 2, 3, 4])
    assert [r["seed"] for r in kept] == [2, 3] and [json.loads(line)["seed"] for line in jsonl.read_text().splitlines()] == [2, 3]
    with pytest.raises(SystemExit, match="holds trials this campaign does not draw"):
        accuracy.played(jsonl, [7, 8])
