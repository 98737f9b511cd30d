"""RANKSCOPE_ENABLE=1 turns the agent on in training ranks of any Python job, and nowhere else.

Activation is observed through RANKSCOPE_DEBUG=1, which prints "rankscope agent: active in rank
R (pid P)" when the agent starts in a process. Every test runs real interpreters: the .venv
(an editable install) and, for the wheel, a throwaway virtual environment with the built wheel.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import OFF_THIS_TREE, Proc, ProcRunner

ACTIVE = re.compile(r"^rankscope agent: active in rank (\S+) \(pid (\d+)\)$", re.M)
NOT_LAUNCHED = {"RANK": "", "WORLD_SIZE": "", "LOCAL_RANK": "", "TORCHELASTIC_RUN_ID": ""}


def python(runner: ProcRunner, code: str, env: dict[str, str], exe: str = sys.executable, name: str = "py") -> Proc:
    proc = runner.start([exe, "-c", textwrap.dedent(code)], env=env, name=name)
    assert proc.wait(120) == 0, proc.output()
    return proc


def activations(proc: Proc) -> list[tuple[str, int]]:
    return [(rank, int(pid)) for rank, pid in ACTIVE.findall(proc.stderr)]


def stderr_lines(proc: Proc) -> list[str]:
    """stderr without the agent's other messages (an agent that cannot reach a collector says so)."""
    return [line for line in proc.stderr.splitlines() if ACTIVE.match(line) or not line.startswith("rankscope agent:")]


@pytest.fixture
def on(tmp_path: Path) -> dict[str, str]:
    """The agent switched on, pointed at a port where no collector listens, spooling under tmp_path."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_DEBUG": "1", "RANKSCOPE_COLLECTOR": f"127.0.0.1:{port}",
            "RANKSCOPE_SPOOL_DIR": str(tmp_path / "spool")}  # fmt: skip


def test_pth_line_is_installed_by_the_editable_install() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    pth = site / "rankscope-agent.pth"
    assert pth.is_file(), "rankscope-agent.pth missing: run `make install` (setup.py changed)"
    (record,) = site.glob("rankscope-*.dist-info/RECORD")
    assert any(line.startswith("rankscope-agent.pth,") for line in record.read_text().splitlines())
    assert len(pth.read_text().splitlines()) == 1


def test_nothing_happens_without_the_variable(proc_runner: ProcRunner) -> None:
    proc = python(proc_runner, """
        import sys
        print(sorted(m for m in sys.modules if m.startswith("rankscope")))
        import torch
        print(type(torch.__loader__).__name__)
    """, {"RANKSCOPE_ENABLE": "", "RANKSCOPE_DEBUG": "1", "RANK": "0", "WORLD_SIZE": "1"})  # fmt: skip
    assert proc.stdout.splitlines() == ["[]", "SourceFileLoader"]
    assert activations(proc) == [] and proc.stderr == ""


def test_enabled_start_up_imports_nothing_heavy(proc_runner: ProcRunner, on: dict[str, str]) -> None:
    """Before torch arrives the hook has imported only the small autoload module."""
    proc = python(proc_runner, """
        import sys
        heavy = [m for m in ("torch", "grpc", "numpy", "google.protobuf", "opentelemetry") if m in sys.modules]
        print("heavy", heavy, "autoload", "rankscope.agent.autoload" in sys.modules, flush=True)
        import torch
        print("loader", type(torch.__loader__).__name__, type(torch.__spec__.loader).__name__, flush=True)
    """, {**on, "RANK": "0", "WORLD_SIZE": "1"})  # fmt: skip
    assert "heavy [] autoload True" in proc.stdout
    assert "loader SourceFileLoader SourceFileLoader" in proc.stdout  # the hook's loader is gone afterwards
    assert [rank for rank, _ in activations(proc)] == ["0"]


def test_hooks_run_once_torch_distributed_is_imported(proc_runner: ProcRunner, on: dict[str, str]) -> None:
    """What the collective wrappers use: a callback right after torch.distributed is loaded."""
    proc = python(proc_runner, """
        from rankscope.agent.autoload import when_imported
        when_imported("torch.distributed", lambda m: print("hook", m.__name__, hasattr(m, "all_reduce"), flush=True))
        print("importing", flush=True)
        import torch
        when_imported("torch.distributed", lambda m: print("again", m.__name__, flush=True))  # already there: now
    """, {**on, **NOT_LAUNCHED})  # fmt: skip
    assert proc.stdout.splitlines() == ["importing", "hook torch.distributed True", "again torch.distributed"]


def test_plain_process_activates_right_after_init_process_group(proc_runner: ProcRunner, on: dict[str, str]) -> None:
    proc = python(proc_runner, """
        import socket, sys
        import torch.distributed as dist
        print("imported torch", file=sys.stderr, flush=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        print("group ready", file=sys.stderr, flush=True)
        dist.destroy_process_group()
    """, {**on, **NOT_LAUNCHED})  # fmt: skip
    expected = ["imported torch", f"rankscope agent: active in rank 0 (pid {proc.pid})", "group ready"]
    assert stderr_lines(proc) == expected, proc.stderr


def test_forbidden_processes_and_their_children_stay_off(proc_runner: ProcRunner, on: dict[str, str]) -> None:
    """forbid() (collector, dashboard) holds in the process and, through RANKSCOPE_ROLE, its children."""
    proc = python(proc_runner, """
        import subprocess, sys
        from rankscope.agent.autoload import forbid
        forbid("dashboard")
        import torch
        subprocess.run([sys.executable, "-c", "import torch; print('child done')"], check=True)
        from rankscope.agent.autoload import activate
        print("activate ->", activate(), flush=True)
    """, {**on, "RANK": "0", "WORLD_SIZE": "1"})  # fmt: skip
    assert "child done" in proc.stdout and "activate -> False" in proc.stdout
    assert activations(proc) == []


def test_bad_setting_one_warning_agent_off(proc_runner: ProcRunner, on: dict[str, str]) -> None:
    proc = python(proc_runner, "import torch; print('trained')", {**on, "RANK": "0", "WORLD_SIZE": "1", "RANKSCOPE_STALL_S": "soon"})
    assert proc.stdout.strip() == "trained"
    assert proc.stderr.splitlines() == [
        "rankscope agent: RANKSCOPE_STALL_S='soon' is not valid (not a number): expected a positive number of seconds, e.g. 20;"
        " the agent stays off"
    ]


@pytest.mark.slow
def test_data_loader_workers_do_not_start_a_second_agent(proc_runner: ProcRunner, tmp_path: Path, on: dict[str, str]) -> None:
    """Forked workers stay quiet; spawned ones descend from an active rank and stay off too."""
    script = tmp_path / "loader.py"
    script.write_text(textwrap.dedent("""
        import os
        import torch
        from torch.utils.data import DataLoader, Dataset
        from rankscope.agent import autoload

        class Pids(Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return torch.tensor([os.getpid(), int(autoload.active())])

        if __name__ == "__main__":
            for context, workers in (("fork", 2), ("spawn", 1)):
                loader = DataLoader(Pids(), batch_size=1, num_workers=workers, multiprocessing_context=context)
                rows = torch.cat(list(loader))
                pids = {int(p) for p in rows[:, 0]}
                assert os.getpid() not in pids and not rows[:, 1].any(), rows
                print(context, len(pids), "workers, none active", flush=True)
    """))
    proc = proc_runner.start([sys.executable, str(script)], env={**on, "RANK": "0", "WORLD_SIZE": "1"}, name="loader")
    assert proc.wait(120) == 0, proc.output()
    assert "fork 2 workers, none active" in proc.stdout and "spawn 1 workers, none active" in proc.stdout
    assert activations(proc) == [("0", proc.pid)]


@pytest.mark.slow
def test_torchrun_ranks_activate_its_agent_does_not(torchrun: Callable[..., Proc], tmp_path: Path, on: dict[str, str]) -> None:
    script = tmp_path / "job.py"
    script.write_text("import torch\nprint('rank done', flush=True)\n")
    proc = torchrun([str(script)], nproc=2, env=on)
    assert proc.wait(120) == 0, proc.output()
    found = activations(proc)
    assert sorted(rank for rank, _ in found) == ["0", "1"], proc.output()
    assert len({pid for _, pid in found}) == 2 and proc.pid not in {pid for _, pid in found}


@pytest.mark.slow
def test_rankscope_train_activates_ranks_not_the_launcher(proc_runner: ProcRunner, on: dict[str, str]) -> None:
    proc = proc_runner.start(
        [sys.executable, "-m", "rankscope.cli.main", "train", "--tp", "1", "--pp", "1", "--dp", "2", "--layers", "1",
         "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--micro-batch", "1", "--global-batch", "2",
         "--steps", "1"],
        env={**on, "OMP_NUM_THREADS": "1"}, name="train",
    )  # fmt: skip
    assert proc.wait(240) == 0, proc.output()
    found = activations(proc)
    assert sorted(rank for rank, _ in found) == ["0", "1"], proc.output()
    assert proc.pid not in {pid for _, pid in found}


@pytest.mark.slow
def test_collector_process_stays_off(proc_runner: ProcRunner, tmp_path: Path, on: dict[str, str]) -> None:
    proc = proc_runner.start(
        [sys.executable, "-m", "rankscope.cli.main", "collector", "--store", str(tmp_path / "store"), "--listen", "127.0.0.1:0"],
        env={**on, "RANK": "0", "WORLD_SIZE": "1"}, name="collector",
    )  # fmt: skip
    proc.wait_for("listening on", timeout=120)
    proc.kill()
    assert activations(proc) == [] and "rankscope agent" not in proc.stderr, proc.output()


@pytest.mark.slow
def test_regular_wheel_ships_a_working_pth(proc_runner: ProcRunner, wheel_file: Path, tmp_path: Path, on: dict[str, str]) -> None:
    """Install the built wheel into a fresh virtual environment, and watch a rank activate.

    The environment gets torch and the other dependencies from the .venv through a plain path
    entry (which, unlike the .venv's own site directory, runs none of the .venv's .pth files),
    so rankscope itself and its .pth come from the wheel alone.
    """
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    venv = tmp_path / "venv"
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel_file)], check=True, capture_output=True, timeout=240)
    assert (site / "rankscope-agent.pth").is_file()
    (site / "aa_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = python(proc_runner, """
        import rankscope, sys
        print(rankscope.__file__, flush=True)
        import torch
    """, {**on, **OFF_THIS_TREE, "RANK": "0", "WORLD_SIZE": "1"}, exe=str(venv / "bin" / "python"), name="wheel")  # fmt: skip
    assert proc.stdout.startswith(str(site / "rankscope")), proc.output()
    assert [rank for rank, _ in activations(proc)] == ["0"], proc.output()
