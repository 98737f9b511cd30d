"""benchmarks/gpu_check.py (``make gpu-check``): its refusal without a GPU, its pure helpers, and on a
machine with a CUDA GPU the CUDA parts themselves (marked ``gpu``, skipped elsewhere)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
# Loaded from its file: benchmarks/ is no package, and putting it on sys.path would let its
# agent.py, trainer.py, ... shadow other imports for the rest of the session.
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
assert _spec is not None and _spec.loader is not None
g = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = g  # dataclasses look their module up while the class is made
_spec.loader.exec_module(g)

CUDA = torch.cuda.is_available()


# --- the command ---------------------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="this machine has a CUDA GPU: the check runs instead of refusing")
def test_refuses_without_a_gpu_in_exactly_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == g.REFUSAL + "\n"
    assert g.REFUSAL == "make gpu-check needs a CUDA GPU: torch.cuda.is_available() is False on this machine"


def test_help_works_anywhere() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--parts" in done.stdout and "MFU" in done.stdout


def test_runs_from_a_checkout_without_the_package_installed(tmp_path: Path) -> None:
    """As on the lent GPU machine: no installed rankscope (-S: no site-packages, so no editable install);
    the script puts the checkout on sys.path itself."""
    code = (
        "import runpy, sys; ns = runpy.run_path(sys.argv[1]); print(ns['bootstrap']());"
        "import rankscope.trainer.injector as f, rankscope.common.cmdline as c; print(f.__file__); print(c.__file__)"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code, str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    origin, faults, cmdline = done.stdout.split()
    assert origin == "checkout"
    assert Path(faults) == ROOT / "rankscope" / "trainer" / "injector.py"
    assert Path(cmdline) == ROOT / "rankscope" / "common" / "cmdline.py"


def test_installed_package_is_used_when_present() -> None:
    assert g.bootstrap() == "installed"  # the test suite runs in the project's venv


def test_the_make_target_runs_the_script_after_install_and_bench_leaves_it_out() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "gpu-check: install\n\t$(PY) benchmarks/gpu_check.py\n" in makefile
    assert "make gpu-check" in makefile.split("\n\n")[0]  # the header lists it
    assert "filter-out benchmarks/gpu_check.py" in makefile  # `make bench` must not fail on a machine without a GPU


# --- the table -----------------------------------------------------------------------------------


ROWS = [
    g.Row("1", "matmul timed by the agent", "1.402", "ms", True, "direct 1.404 ms"),
    g.Row("3", "step time, agent off", "80.00", "ms", None, "a | b"),
    g.failure("2", "part 2", "exit 1: RuntimeError: NCCL error"),
]


def test_rows_round_trip_through_a_childs_output() -> None:
    output = "\n".join(["noise before", ROWS[0].line(), "[rank0]: warning", ROWS[1].line(), g.ROW_MARK + "{not json",
                        g.ROW_MARK + json.dumps({"part": "1"}), ROWS[2].line(), ""])  # fmt: skip
    assert g.parse_rows(output) == ROWS
    assert g.parse_rows("") == []


def test_table_has_one_header_and_a_line_per_row() -> None:
    lines = g.format_table(ROWS).splitlines()
    assert lines[0] == "| part | check | value | unit | sanity | note |"
    assert lines[1] == "|---|---|---|---|---|---|"
    assert lines[2] == "| 1 CUDA timing | matmul timed by the agent | 1.402 | ms | pass | direct 1.404 ms |"
    assert lines[3] == "| 3 agent cost | step time, agent off | 80.00 | ms | - | a / b |"  # a pipe would split the cell
    assert lines[4] == "| 2 NCCL | part 2 | - | - | FAIL | exit 1: RuntimeError: NCCL error |"
    assert len(lines) == 5
    assert all(line.count("|") == 7 for line in lines)


def test_exit_status_fails_on_any_failed_row_or_none() -> None:
    assert g.exit_status(ROWS[:2]) == 0
    assert g.exit_status(ROWS) == 1
    assert g.exit_status([]) == 1


def test_last_error_finds_the_exception_line() -> None:
    traceback = "\n".join([
        "step     1/8 | loss 10.4",
        "Traceback (most recent call last):",
        '  File "x.py", line 3, in <module>',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "[W1125 rank0] ProcessGroupNCCL destroyed",
        ROWS[0].line(),
    ])  # fmt: skip
    assert g.last_error(traceback) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    refused = "python -m rankscope.trainer: error: --heads 5 is not divisible by --tp 2"
    assert g.last_error(f"[rankscope] starting\n{refused}\n[W1125] shutting down") == refused
    assert g.last_error("just a line\nthe last one\n") == "the last one"
    assert g.last_error(ROWS[0].line()) == "no output"


def test_relative() -> None:
    assert g.relative(1.01, 1.0) == pytest.approx(0.01)
    assert g.relative(0.97, 1.0) == pytest.approx(0.03)
    assert g.relative(1.0, 0.0) == float("inf")


# --- trainer runs: configurations, metrics, the agent's cost -------------------------------------------


def test_the_mfu_model_is_about_1b_parameters_by_the_trainers_count() -> None:
    from rankscope.trainer import flops
    from rankscope.trainer.model import count_parameters

    args = g.model_args(g.MFU_MODEL)
    assert 1.0e9 < count_parameters(args) < 1.1e9
    assert flops.flops_per_token(args) == pytest.approx(6 * count_parameters(args) + 12 * 18 * 16 * 128 * 2048)
    assert flops.peak_flops("NVIDIA H100 80GB HBM3") == 989e12


@pytest.mark.parametrize("model", [g.MFU_MODEL, g.OVERHEAD_MODEL], ids=["mfu", "overhead"])
def test_the_models_are_valid_one_gpu_trainer_configurations(model: dict) -> None:
    from rankscope.trainer.train_config import parse_args

    cfg = parse_args([*g.trainer_flags(model), "--steps=3"]).resolved(1)
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.world_size) == (1, 1, 1, 1)
    assert (cfg.layers, cfg.hidden, cfg.seq, cfg.vocab) == (model["layers"], model["hidden"], model["seq"], model["vocab"])
    assert cfg.num_microbatches == model["global_batch"] // model["micro_batch"]


def test_step_stats_leave_out_the_warm_up() -> None:
    lines = [{"step": s, "step_time_s": t, "tokens_per_s": 1000 / t, "mfu": 0.1 / t} for s, t in
             [(1, 5.0), (2, 1.0), (3, 2.0), (4, 4.0)]]  # fmt: skip
    stats = g.step_stats(lines, warmup=1)
    assert stats.steps == 3 and stats.step_s == [1.0, 2.0, 4.0]
    assert stats.tokens_per_s == 500 and stats.mfu == pytest.approx(0.05)
    assert g.step_stats([{**line, "mfu": None} for line in lines], 1).mfu is None
    with pytest.raises(ValueError):
        g.step_stats(lines, warmup=4)


def test_pairs_alternate_which_side_runs_first() -> None:
    assert g.pair_order(4) == [(False, True), (True, False), (False, True), (True, False)]
    assert all(sorted(pair) == [False, True] for pair in g.pair_order(5))


def test_overhead_is_the_ratio_of_the_medians() -> None:
    result = g.overhead([([1.0, 1.0, 1.2], [1.1, 1.1, 1.0]), ([2.0, 2.0, 2.0], [2.0, 2.2, 2.0])])
    assert result.off_s == pytest.approx(1.6)  # median of all off steps
    assert result.on_s == pytest.approx(1.55)
    assert result.ratio == pytest.approx(1.55 / 1.6)
    assert result.pair_ratios == pytest.approx([1.1, 1.0])


def test_agent_activation_is_read_from_its_debug_line() -> None:
    assert g.agent_activated("[rankscope] training\nrankscope agent: active in rank 0 (pid 12)\nstep 1")
    assert not g.agent_activated("[rankscope] training 20 steps\nstep 1/20")


def test_compute_share_is_the_median_over_the_last_steps() -> None:
    lines = [{"step": s, "step_time_s": 0.1} for s in range(1, 6)]
    compute = {1: 1_000_000, 3: 50_000_000, 4: 90_000_000, 5: 80_000_000}
    assert g.compute_share(compute, lines, last=3) == pytest.approx(0.8)
    assert g.compute_share({}, lines, last=3) is None


def test_child_env_drops_the_agent_and_rank_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKSCOPE_ENABLE", "1")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "1")
    monkeypatch.setenv("KEEP_ME", "yes")
    env = g.child_env({"RANK": "0"})
    assert "RANKSCOPE_ENABLE" not in env and "TORCH_NCCL_ENABLE_TIMING" not in env
    assert env["RANK"] == "0" and env["KEEP_ME"] == "yes" and env["PYTHONUNBUFFERED"] == "1"


# --- the flight recorder ---------------------------------------------------------------------------


def test_flight_recorder_summary_counts_nccl_entries_once() -> None:
    def entry(seq: int, state: str, duration: float | None, name: str = "nccl:all_reduce") -> dict:
        e = {"process_group": ("0", "default_pg"), "collective_seq_id": seq, "p2p_seq_id": 0, "record_id": seq,
             "time_created_ns": 1000 + seq, "profiling_name": name, "state": state}  # fmt: skip
        if duration is not None:
            e["duration_ms"] = duration
        return e

    trace = {"entries": [entry(1, "completed", 0.5), entry(2, "completed", None), entry(3, "started", None),
                         entry(4, "completed", 0.25, name="gloo:all_reduce")]}  # fmt: skip
    summary = g.fr_summary([trace, trace])  # two dump functions over one recorder
    assert (summary.entries, summary.completed, summary.timed) == (3, 2, 1)
    assert summary.durations_ms == [0.5]
    assert g.fr_summary([{}]).entries == 0


# --- on a GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.timeout(600)
def test_the_cuda_parts_pass_on_this_gpu() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--parts", "1,2"], capture_output=True, text=True, timeout=560)
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| part | check | value | unit | sanity | note |", done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(table) >= 2 + 3 + 4 and "FAIL" not in done.stdout
