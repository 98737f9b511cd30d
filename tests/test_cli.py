"""The rankscope command: version, help without heavy imports, `train` forwarding, missing extras named."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import types
from collections.abc import Callable

import pytest

import rankscope
from rankscope.cli.main import COMMANDS, main

#: the packages the extras add, as imported (the agent's install has none of them)
EXTRA_MODULES = ("chdb", "clickhouse_connect", "pyarrow", "pandas", "prometheus_client", "streamlit", "plotly", "pynvml")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"rankscope {rankscope.__version__}"


def test_help_lists_train_and_imports_no_torch_nor_any_extra() -> None:
    code = (
        "import sys\n"
        "from rankscope.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        f"heavy = sorted(m for m in ('torch', 'grpc', *{EXTRA_MODULES}) if m in sys.modules)\n"
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


def without_extras(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``rankscope ARGV`` in an interpreter where the extras' packages cannot be imported, as in `pip install rankscope`."""
    code = f"import sys\nsys.modules.update(dict.fromkeys({EXTRA_MODULES}))\nfrom rankscope.cli.main import main\nsys.exit(main({argv!r}))\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("argv", "extra"), [
    (["collector", "--listen", "127.0.0.1:0"], "collector"),  # refused while parsing: --listen's type imports the collector
    (["sql", "SELECT 1"], "collector"),
    (["dashboard"], "dashboard"),
], ids=lambda v: v[0] if isinstance(v, list) else v)  # fmt: skip
def test_a_command_whose_extra_is_missing_says_which_to_install(argv: list[str], extra: str) -> None:
    done = without_extras(argv)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"rankscope {argv[0]} needs the {extra} extra: pip install 'rankscope[{extra}]' (no module named "), done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""


def test_help_and_the_agent_s_commands_need_no_extra() -> None:
    assert without_extras(["--help"]).returncode == 0
    done = without_extras(["schema"])
    assert done.returncode == 0 and "CREATE TABLE" in done.stdout, done.stderr


def fails_on(missing: str | None) -> Callable[[argparse.Namespace], int]:
    """A command's ``run`` that stops on the module ``missing``."""

    def run(args: argparse.Namespace) -> int:
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    return run


@pytest.mark.parametrize(("command", "missing", "explained"), [
    ("collector", "chdb", True),
    ("collector", "rankscope.collector.store.ddl", False),  # rankscope's own: a broken install, not a missing extra
    ("collector", None, False),
    ("schema", "pyarrow", False),  # a command that declares no extra
])  # fmt: skip
def test_only_a_missing_extra_s_package_is_explained(
    command: str, missing: str | None, explained: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(importlib.import_module(COMMANDS[command]), "run", fails_on(missing))
    if explained:
        assert main([command]) == 1
        assert capsys.readouterr().err == f"rankscope {command} needs the collector extra: pip install 'rankscope[collector]' (no module named {missing})\n"
    else:
        with pytest.raises(ModuleNotFoundError):
            main([command])


def test_ctrl_c_ends_a_command_with_one_line_and_status_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(COMMANDS["sql"]), "run", interrupted)
    assert main(["sql", "SELECT 1"]) == 130
    assert capsys.readouterr().err == "rankscope sql: interrupted\n"
