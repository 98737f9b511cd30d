"""Faults applied from outside the job on namespace hosts, diagnosed by the live collector.

Each scenario is a real job across four hosts of two ranks (the bundled trainer or a plain DDP
script), a real fault from outside its processes (cgroup quota, freezer, SIGSTOP, SIGKILL, tbf, a
delaying relay), and the incidents the collector stores: the right kind, ranks and host (the name
the host's own processes report), and no other incident. Skipped, with the reason, only where no
test bed can be made (not root, no namespaces).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import by_speed

from rankscope.testbed import hosts

from rankscope.harness import testbed_scenarios as scenarios

pytestmark = pytest.mark.slow

@pytest.mark.timeout(420)
@pytest.mark.parametrize("scenario", [by_speed(s, s.name, s.kind) for s in scenarios.SCENARIOS.values()])
def test_an_external_fault_is_diagnosed(scenario: scenarios.Scenario, tmp_path: Path) -> None:
    try:
        score = scenarios.run(scenario, workdir=tmp_path, log=lambda line: None)
    except hosts.TestbedError as e:
        pytest.skip(f"no test bed on this machine: {e}")
    assert score.passed, f"{score.line()}\nincidents: {score.incidents}\n{_logs(tmp_path)}"


def _logs(workdir: Path) -> str:
    logs = sorted(workdir.glob("*.log")) + sorted((workdir / "hosts").glob("*.log"))
    return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}" for p in logs)
