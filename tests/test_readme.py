"""The README cannot drift from the code: its commands parse, its variables are read, its make
targets exist. (The SQL cookbook runs on a recorded run in test_diagnosis_scenarios.py, the demo
and deployment sections are checked in test_demo.py and test_deploy.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rankscope.cli.main import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Words that stand for a value the reader supplies, in prose examples such as `--run RUN`.
PLACEHOLDERS = {"RUN", "NAME", "DIR", "URL", "HOST:PORT", "HOST:7777", "SPEC", "N", "FILE", "TOKEN", "PEM", "SECONDS", "PORT"}


def shell_blocks() -> list[str]:
    """The README's bash code blocks, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", README, re.S)
    return [re.sub(r"\s*#[^\n]*", "", b.replace("\\\n", " ")) for b in blocks]


def rankscope_commands() -> list[list[str]]:
    """Every ``rankscope ...`` invocation in the README's shell blocks, as argv (without "rankscope")."""
    found = []
    for block in shell_blocks():
        for line in block.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.wordchars += "{}[]/:=,.*-"
            words: list[str] = []
            for token in [*lexer, ";"]:
                if token and set(token) <= set("|&;()<>"):  # end of one command of the line
                    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
                        words.pop(0)
                    if words and Path(words[0]).name == "rankscope":
                        found.append(words[1:])
                    words = []
                else:
                    words.append(token)
    return found


def test_the_readme_shows_commands() -> None:
    assert len(rankscope_commands()) >= 5, rankscope_commands()


@pytest.mark.parametrize("argv", rankscope_commands(), ids=lambda argv: " ".join(argv)[:60])
def test_every_shell_command_parses(argv: list[str]) -> None:
    """Each command of a shell block parses with rankscope's own parser (the trainer's for train)."""
    assert argv and argv[0] in COMMANDS, f"no such command: rankscope {' '.join(argv)}"
    if argv[0] == "train":
        from rankscope.trainer.config import build_parser as trainer_parser

        trainer_parser().parse_args(argv[1:])
        return
    build_parser().parse_args(argv)


def test_every_flag_in_prose_belongs_to_its_command() -> None:
    """Inline examples such as `rankscope diagnose --run RUN --format json`: each flag exists on that command."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices  # noqa: SLF001
    problems = []
    for snippet in re.findall(r"`rankscope ([a-z]+)((?: [^`]*)?)`", README):
        command, rest = snippet
        if command not in COMMANDS:
            problems.append(f"rankscope {command}: no such command")
            continue
        if command == "train":
            continue  # passthrough: the trainer's flags, checked in shell blocks
        known = {s for a in subparsers[command]._actions for s in a.option_strings}  # noqa: SLF001
        problems += [f"rankscope {command} {flag}" for flag in re.findall(r"(--[a-z][a-z-]*)", rest) if flag not in known]
    assert not problems, f"the README names flags the commands lack: {problems}"


def test_every_environment_variable_is_read_by_the_code() -> None:
    named = set(re.findall(r"\b(RANKSCOPE_[A-Z0-9_]+)", README))
    code = "\n".join(p.read_text() for p in ROOT.rglob("*.py") if ".venv" not in p.parts)
    code += (ROOT / "docker-compose.yml").read_text() + (ROOT / "Makefile").read_text()
    unread = sorted(v for v in named if v not in code)
    assert not unread, f"the README names variables nothing reads: {unread}"


def test_every_agent_variable_is_documented() -> None:
    from rankscope.agent.config import AGENT_VARIABLES

    missing = sorted(v for v in AGENT_VARIABLES if v not in README)
    assert not missing, f"agent variables the README does not document: {missing}"


def test_every_make_target_named_exists() -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    in_shell = "\n".join(shell_blocks())
    named = set(re.findall(r"`make ([a-z][a-z-]*)", README)) | set(re.findall(r"^\s*make ([a-z][a-z-]*)", in_shell, re.M))
    assert named and named <= targets, f"the README names make targets the Makefile lacks: {named - targets}"
