"""The layering of the parts (pyproject.toml's import-linter contracts, docs/architecture.md) holds,
and an import the wrong way breaks it: checked by import-linter on the source, as `make test` runs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the package found first on the path at ``root`` (its pyproject's contracts)."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(root / "pyproject.toml")], cwd=root, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
    )  # fmt: skip


def test_every_part_imports_only_the_parts_below_it() -> None:
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 1 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("collector/server.py", "import rankscope.harness.demo", "rankscope.collector is not allowed to import rankscope.harness"),
        ("collector/server.py", "import rankscope.trainer.model", "rankscope.collector is not allowed to import rankscope.trainer"),
        ("healing/driver.py", "from rankscope.testbed import hosts", "rankscope.healing is not allowed to import rankscope.testbed"),
        ("common/incidents.py", "import rankscope.collector.client", "rankscope.common is not allowed to import rankscope.collector"),
    ],
)
def test_an_import_the_wrong_way_breaks_the_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    shutil.copytree(ROOT / "rankscope", tmp_path / "rankscope", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with (tmp_path / "rankscope" / module).open("a") as f:
        f.write(f"\n{line}\n")
    done = lint(tmp_path)
    assert done.returncode == 1, done.stdout[-4000:]
    assert broken in done.stdout, done.stdout[-4000:]


def test_no_two_modules_share_a_name() -> None:
    """A module's name says what it holds, once in the package. The command line's modules are named
    after their subcommands and the dashboard's pages after their pages (both addressed by that name),
    so they may share a name with what they show or run."""
    named: dict[str, list[str]] = {}
    for path in (ROOT / "rankscope").rglob("*.py"):
        relative = path.relative_to(ROOT / "rankscope")
        if path.name == "__init__.py" or relative.parts[0] == "cli" or relative.parts[:2] == ("dashboard", "views"):
            continue
        named.setdefault(path.name, []).append(relative.as_posix())
    assert {name: paths for name, paths in named.items() if len(paths) > 1} == {}
