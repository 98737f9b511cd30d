"""The rankscope command: version, help without heavy imports, `train` forwarding."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import rankscope
from rankscope.cli.main import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"rankscope {rankscope.__version__}"


def test_help_lists_train_and_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from rankscope.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in ('torch', 'chdb', 'streamlit', 'grpc') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "train" in out
    assert "HEAVY []" in out


def test_train_forwards_every_argument_unparsed(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("rankscope.trainer.torchrun")
    fake.main = lambda argv: seen.append(argv) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rankscope.trainer.torchrun", fake)
    argv = ["--help", "--inject", "straggler:rank=5,factor=1.5", "--", "-x", "pos"]
    assert main(["train", *argv]) == 7
    assert main(["train"]) == 7
    assert seen == [argv, []]


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_the_shared_detector_flags_default_to_the_detectors_own_settings() -> None:
    """``collector`` and ``diagnose`` take --hang-after / --silent-after from rankscope/cli/args.py, which must not import the
    detectors at parse time: their defaults are copies of ``Settings``' and must stay equal."""
    import argparse

    from rankscope.cli.args import add_thresholds, thresholds
    from rankscope.common.settings import Settings

    parser = argparse.ArgumentParser()
    add_thresholds(parser)
    assert thresholds(parser.parse_args([])) == Settings()
    assert thresholds(parser.parse_args(["--hang-after", "10", "--silent-after", "4"])) == Settings(hang_after_s=10, silent_after_s=4)
