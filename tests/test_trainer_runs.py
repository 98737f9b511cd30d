"""Real multi-process training runs (torchrun, gloo on CPU): parity across layouts, checkpoints, faults.

Models are tiny and steps few: 8 ranks on 2 cores take about 7 s just to start.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

import pytest

from conftest import Proc, ProcRunner

pytestmark = pytest.mark.slow

TINY = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "256",
        "--micro-batch", "2", "--global-batch", "8", "--steps", "5", "--timeout", "60"]  # fmt: skip
VARIANT = ["--parallel-block", "--window", "8"]
SP_DO = ["--sequence-parallel", "--distributed-optimizer"]


def layout(tp: int, pp: int, dp: int) -> list[str]:
    return ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp)]


def start(
    runner: ProcRunner, name: str, flags: list[str], metrics: Path, env: dict[str, str] | None = None, nproc: int | None = None
) -> Proc:
    """Run the trainer under torchrun on ``nproc`` ranks (default: tp*pp*dp from the flags)."""
    nproc = nproc or math.prod(int(flags[flags.index(f"--{k}") + 1]) for k in ("tp", "pp", "dp"))
    return runner.torchrun(["-m", "rankscope.trainer", *flags, "--metrics-json", str(metrics)], nproc, env=env, name=name)


def records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def train(runner: ProcRunner, name: str, flags: list[str], timeout: float = 240) -> list[dict]:
    """Run to completion and return the metrics lines; fails with the output if the run fails."""
    metrics = runner.log_dir / f"{name}.jsonl"
    proc = start(runner, name, flags, metrics)
    assert proc.wait(timeout) == 0, proc.output()
    return records(metrics)


def losses(lines: list[dict]) -> list[float]:
    return [line["loss"] for line in lines]


@pytest.fixture(scope="module")
def reference(module_runner: ProcRunner) -> dict[str, list[float]]:
    """Losses of the single-process model, plain and with the block/attention variant."""
    return {
        "plain": losses(train(module_runner, "ref-plain", [*layout(1, 1, 1), *TINY])),
        "variant": losses(train(module_runner, "ref-variant", [*layout(1, 1, 1), *TINY, *VARIANT])),
    }


#: the plain TP2xPP2xDP2 layout is checked against the single-process model by tests/test_agent_runs.py,
#: whose run with the agent off it is (one 8-rank run fewer); here it runs with SP, ZeRO-1 and the variant
@pytest.mark.parametrize(
    ("name", "flags", "variant"),
    [
        ("tp2", layout(2, 1, 1), "plain"),
        ("pp4", layout(1, 4, 1), "plain"),
        ("dp2-zero1", [*layout(1, 1, 2), "--distributed-optimizer"], "plain"),
        ("tp2pp2dp2-sp-zero1-variant", [*layout(2, 2, 2), *SP_DO, *VARIANT], "variant"),
    ],
)
def test_parallel_layouts_match_the_single_process_model(
    module_runner: ProcRunner, reference: dict[str, list[float]], name: str, flags: list[str], variant: str
) -> None:
    extra = VARIANT if variant == "variant" else []
    lines = train(module_runner, name, [*flags, *TINY, *extra])
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert losses(lines) == pytest.approx(reference[variant], abs=1e-5)
    assert reference["plain"][-1] < reference["plain"][0]  # it learns
    assert_measured(lines)


def assert_measured(lines: list[dict]) -> None:
    """Each step line has its time and throughput (8 sequences of 32 tokens a step), and no MFU on CPU."""
    for line in lines:
        assert line["mfu"] is None and line["step_time_s"] > 0
        assert line["tokens_per_s"] == pytest.approx(8 * 32 / line["step_time_s"])


def test_rankscope_train_launches_torchrun(proc_runner: ProcRunner, tmp_path: Path) -> None:
    exe = str(Path(sys.executable).parent / "rankscope")
    metrics = tmp_path / "m.jsonl"
    proc = proc_runner.start([exe, "train", *layout(1, 1, 2), *TINY, "--steps", "2", "--metrics-json", str(metrics)])
    assert proc.wait(120) == 0, proc.output()
    assert "step     2/2 | loss" in proc.stdout
    assert [line["step"] for line in records(metrics)] == [1, 2]


@pytest.mark.timeout(120)
def test_rankscope_train_takes_nproc(proc_runner: ProcRunner) -> None:
    """Regression: --nproc reached torchrun, whose parser refused it as an ambiguous --nproc-per-node."""
    exe = str(Path(sys.executable).parent / "rankscope")
    tiny = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--micro-batch", "1", "--global-batch", "2"]
    proc = proc_runner.start([exe, "train", "--nproc", "2", "--tp", "1", "--pp", "1", "--dp", "2", "--steps", "1", *tiny])
    assert proc.wait(100) == 0, proc.output()
    assert "step     1/1 | loss" in proc.stdout, proc.output()


def test_rankscope_train_refuses_bad_sizes_before_starting(proc_runner: ProcRunner) -> None:
    exe = str(Path(sys.executable).parent / "rankscope")
    started = time.monotonic()
    proc = proc_runner.start([exe, "train", "--heads", "6", "--tp", "4", "--inject", "hang:rank=1"])
    assert proc.wait(30) == 2
    assert "--heads 6 is not divisible by --tp 4" in proc.stderr
    assert "hang: missing step" in proc.stderr and "the grammar is in rankscope train --help" in proc.stderr
    assert "torch.distributed.run" not in proc.stdout + proc.stderr
    assert time.monotonic() - started < 20


def test_checkpoint_resume_reproduces_the_losses(module_runner: ProcRunner, reference: dict[str, list[float]], tmp_path: Path) -> None:
    """TP2 x PP2 x DP2 with sequence parallelism and ZeRO-1: its losses are the single-process model's (the
    layouts' parity, as the test above), and a run resumed from a checkpoint reproduces them bit for bit."""
    flags = [*layout(2, 2, 2), *SP_DO, *TINY, "--steps", "6", "--ckpt-dir", str(tmp_path / "ckpt")]
    straight_metrics = tmp_path / "straight.jsonl"
    proc = start(module_runner, "ckpt-straight", [*flags, "--ckpt-every", "3"], straight_metrics)
    assert proc.wait(240) == 0, proc.output()
    straight = records(straight_metrics)
    assert losses(straight)[:5] == pytest.approx(reference["plain"], abs=1e-5)
    assert_measured(straight)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000003", "step-00000006"]
    # Pretend the run died after step 4: the last complete checkpoint is step 3.
    shutil.rmtree(tmp_path / "ckpt" / "step-00000006")
    resumed_metrics = tmp_path / "resumed.jsonl"
    resumed_metrics.write_text("".join(json.dumps(line) + "\n" for line in straight[:4]))
    proc = start(module_runner, "ckpt-resumed", [*flags, "--resume"], resumed_metrics)
    assert proc.wait(240) == 0, proc.output()
    assert "resuming from step 3" in proc.stdout
    resumed = records(resumed_metrics)
    assert [line["step"] for line in resumed] == [1, 2, 3, 4, 5, 6]  # steps 1-3 kept, 4-6 trained again
    assert losses(resumed) == losses(straight)  # bit for bit on CPU


def test_a_job_restarted_on_fewer_hosts_resumes_at_a_smaller_dp(module_runner: ProcRunner, tmp_path: Path) -> None:
    """torchrun's elastic agent restarts a job on fewer hosts with the same command line: --dp 0 re-plans dp from
    WORLD_SIZE while tp x pp stay, and the run goes on from the last complete checkpoint, saved at the old dp."""
    ckpt = tmp_path / "ckpt"
    flags = [*layout(1, 2, 0), *TINY, "--layers", "2", "--steps", "8", "--ckpt-dir", str(ckpt), "--resume"]
    # Four ranks (dp 2) run all 8 steps: the uninterrupted reference, and the checkpoints of steps 2, 4, 6 and 8.
    full_metrics = tmp_path / "dp2.jsonl"
    proc = start(module_runner, "elastic-dp2", [*flags, "--ckpt-every", "2"], full_metrics, nproc=4)
    assert proc.wait(240) == 0, proc.output()
    assert "resuming from scratch" in proc.stdout and "(tp 1 x pp 2 x dp 2," in proc.stdout, proc.output()
    full = records(full_metrics)
    # Hosts left while step 8's checkpoint was being written: without DCP's .metadata it is incomplete, step 6 is the last.
    (ckpt / "step-00000008" / ".metadata").unlink()
    resumed_metrics = tmp_path / "dp1.jsonl"
    proc = start(module_runner, "elastic-dp1", flags, resumed_metrics, nproc=2)
    assert proc.wait(240) == 0, proc.output()
    assert f"resuming from step 6 at dp 1 (was dp 2) in {ckpt}" in proc.stdout, proc.output()
    resumed = records(resumed_metrics)
    assert [line["step"] for line in resumed] == [7, 8]
    # Step 7 runs the loaded weights forward: only the order of the loss reduction differs between dp 2 and dp 1
    # (equal to the bit on CPU when measured); step 8 follows one AdamW update from the loaded state (5e-7 apart).
    assert resumed[0]["loss"] == pytest.approx(full[6]["loss"], abs=1e-5)
    assert resumed[1]["loss"] == pytest.approx(full[7]["loss"], abs=1e-4)
    assert full[0]["loss"] - resumed[0]["loss"] > 0.03  # continued, not restarted: 5.557 at step 1, 5.481 at step 7


def test_crash_exits_non_zero_at_its_step(module_runner: ProcRunner, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    proc = start(module_runner, "crash", [*layout(1, 2, 2), *TINY, "--inject", "crash:rank=3,step=3"], metrics)
    assert proc.wait(120) != 0
    assert "rankscope injected crash: rank 3 at step 3" in proc.output(None)
    assert [line["step"] for line in records(metrics)] == [1, 2]


def test_hang_blocks_until_the_run_timeout(module_runner: ProcRunner, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    flags = [*layout(1, 2, 2), *TINY, "--timeout", "8", "--inject", "hang:rank=3,step=2"]
    started = time.monotonic()
    proc = start(module_runner, "hang", flags, metrics)
    assert proc.wait(180) != 0
    output = proc.output(None)
    assert "injected hang: rank 3 stops at step 2" in output
    assert "Timed out" in output  # the peers gave up after --timeout, not before
    assert time.monotonic() - started > 8
    assert [line["step"] for line in records(metrics)] == [1]


def test_nan_and_slow_link(module_runner: ProcRunner, tmp_path: Path) -> None:
    """NaN injected into a first-stage rank's activations reaches the loss at that step; a slow link delays every step.
    Two stages of one rank each: what the faults need (the layouts' parity is the test above's)."""
    metrics = tmp_path / "m.jsonl"
    spec = "nan:rank=0,step=3;slow_link:src=0,dst=1,delay_ms=150"
    proc = start(module_runner, "nan-link", [*layout(1, 2, 1), *TINY, "--steps", "4", "--inject", spec], metrics)
    assert proc.wait(180) == 0, proc.output()
    lines = records(metrics)
    assert [math.isfinite(line["loss"]) for line in lines] == [True, True, False, False]
    # Rank 0 sends its four micro-batches' activations to rank 1 every step: 4 x 150 ms at least. Not
    # in the first step's time: the ranks enter it at different moments (one 0.294 s was seen).
    assert all(line["step_time_s"] >= 0.3 for line in lines[1:]), lines


@pytest.mark.foreground
def test_straggler_compute_really_slows(module_runner: ProcRunner, tmp_path: Path) -> None:
    """Two ranks on two cores (nothing masks the sleep): the dp all-reduce waits for the straggler."""
    metrics = tmp_path / "m.jsonl"
    flags = [*layout(1, 1, 2), "--layers", "2", "--hidden", "128", "--heads", "4", "--seq", "128", "--vocab", "512",
             "--micro-batch", "4", "--global-batch", "16", "--steps", "10",
             "--inject", "straggler:rank=1,factor=4,from_step=6"]  # fmt: skip
    proc = start(module_runner, "straggler", flags, metrics)
    assert proc.wait(180) == 0, proc.output()
    times = [line["step_time_s"] for line in records(metrics)]
    # Steps 2-5 against 7-10 (step 1 pays for start-up, step 6 for the switch). Factor 4 on the
    # compute; other processes on a busy machine dilute it, so "measurably" is 1.5x here.
    before, after = statistics.median(times[1:5]), statistics.median(times[6:10])
    assert after > 1.5 * before, times


def test_forked_ranks_are_found_as_ranks_by_the_fleets(module_runner: ProcRunner, tmp_path: Path) -> None:
    """The trainer's ranks are forks of torchrun's agent (rankscope.trainer.torchrun_launcher), whose /proc environment
    is the agent's: the fleets that pause and fence a node's workers find each by its name, with its RANK and LOCAL_RANK,
    and nothing else of the job (the agent, its children) as a rank."""
    from rankscope.common.processes import process_tree
    from rankscope.healing import node_workers

    flags = [*layout(1, 1, 2), *TINY, "--timeout", "60", "--inject", "hang:rank=1,step=2"]  # both ranks stay, waiting
    proc = start(module_runner, "forked", flags, tmp_path / "m.jsonl")
    deadline = time.monotonic() + 90
    while len(found := {pid: r for pid, r in node_workers.ranks().items() if pid in process_tree(proc.pid)}) < 2:
        assert time.monotonic() < deadline and proc.popen.poll() is None, f"ranks found: {found}\n{proc.output()}"
        time.sleep(0.2)
    assert sorted(found.values()) == [(0, 0), (1, 1)], found
    for pid, (rank, local) in found.items():
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not any(item.startswith(b"RANK=") for item in environ), "a fresh interpreter, not a fork of the agent"
        assert Path(f"/proc/{pid}/comm").read_text().strip() == f"rank{rank}:{local}"
    parents = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in found}
    assert len(parents) == 1 and not parents & set(node_workers.ranks()), parents  # one agent, itself no rank
    proc.popen.terminate()  # torchrun's agent stops its ranks
    assert proc.wait(60) != 0
