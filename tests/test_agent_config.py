"""RANKSCOPE_* variables -> AgentConfig: every variable, the host template grammar, and warnings.

Warnings are said once per process per distinct message, so every test here uses values of its
own.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from pathlib import Path

import pytest

from rankscope.agent.config import AgentConfig, TemplateError, load_config, render_host

ON = {"RANKSCOPE_ENABLE": "1"}


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rankscope.agent"]


def test_defaults(caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(ON)
    assert config == AgentConfig(
        collector="127.0.0.1:7777", run_id=None, host_template="", token=None, tls_ca=None,
        spool_dir=Path(tempfile.gettempdir()) / f"rankscope-spool-{os.getuid()}",
        spool_max_bytes=256 << 20, heartbeat_s=2.0, flush_s=2.0, stall_s=20.0, debug=False,
        rank=None, world_size=None, local_rank=None, node_rank=None,
    )  # fmt: skip
    assert config.host(0, 0, 0) == socket.gethostname()
    assert warnings(caplog) == []


@pytest.mark.parametrize("value", [None, "", "0"])
def test_off_unless_enabled(value: str | None, caplog: pytest.LogCaptureFixture) -> None:
    environ = {"RANKSCOPE_HEARTBEAT_S": "-5", "RANKSCOPE_NOT_A_THING": "1"}
    if value is not None:
        environ["RANKSCOPE_ENABLE"] = value
    assert load_config(environ) is None
    assert warnings(caplog) == []  # an agent that is off says nothing about its settings


def test_every_variable(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    config = load_config({
        **ON, "RANKSCOPE_COLLECTOR": "collector.example:9000", "RANKSCOPE_RUN_ID": "run-42",
        "RANKSCOPE_HOST": "node-{node_rank}-gpu{local_rank}", "RANKSCOPE_TOKEN": "t0k3n",
        "RANKSCOPE_TLS_CA": str(ca), "RANKSCOPE_SPOOL_DIR": str(tmp_path / "spool"), "RANKSCOPE_SPOOL_MAX_MB": "8",
        "RANKSCOPE_HEARTBEAT_S": "0.5", "RANKSCOPE_FLUSH_S": "0.25", "RANKSCOPE_STALL_S": "7.5", "RANKSCOPE_DEBUG": "1",
        "RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "GROUP_RANK": "1",
        "RANKSCOPE_INJECT": "straggler:rank=1,factor=2,from_step=3",  # the trainer's: no warning
    })  # fmt: skip
    assert config == AgentConfig(
        collector="collector.example:9000", run_id="run-42", host_template="node-{node_rank}-gpu{local_rank}",
        token="t0k3n", tls_ca=ca, spool_dir=tmp_path / "spool", spool_max_bytes=8 << 20, heartbeat_s=0.5,
        flush_s=0.25, stall_s=7.5, debug=True, rank=13, world_size=16, local_rank=5, node_rank=1,
    )  # fmt: skip
    assert config.host(13, 5, 1) == "node-1-gpu5"
    assert warnings(caplog) == []


def test_ipv6_collector_and_node_rank_fallback() -> None:
    config = load_config({**ON, "RANKSCOPE_COLLECTOR": "[::1]:7777", "NODE_RANK": "3"})
    assert config is not None and config.collector == "[::1]:7777" and config.node_rank == 3


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"RANKSCOPE_RUN_ID": "mine", "TORCHELASTIC_RUN_ID": "elastic", "SLURM_JOB_ID": "77"}, "mine"),
        ({"TORCHELASTIC_RUN_ID": "elastic", "SLURM_JOB_ID": "77"}, "elastic"),
        ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}, "77"),  # torchrun's placeholder is no id
        ({"TORCHELASTIC_RUN_ID": "none"}, None),  # the ranks agree one at start-up
    ],
)
def test_run_id_sources(environ: dict[str, str], expected: str | None) -> None:
    config = load_config({**ON, **environ})
    assert config is not None and config.run_id == expected


@pytest.mark.parametrize(
    ("template", "rank", "local_rank", "node_rank", "host"),
    [
        ("node-{rank//2}", 5, 1, 0, "node-2"),
        ("gpu{rank%4}", 7, 3, 1, "gpu3"),
        ("n{node_rank+1}", 0, 0, 4, "n5"),
        ("h{ (rank - local_rank) // 8 * 10 }", 21, 5, 2, "h20"),
        ("h{-rank+10}-{--rank}", 3, 0, 0, "h7-3"),
        ("{rank*2+1}{local_rank}", 4, 1, 0, "91"),
        ("{{literal}}-{rank}", 2, 0, 0, "{literal}-2"),
        ("plain-name", 9, 9, 9, "plain-name"),
        ("{-7//2}:{-7%2}", 0, 0, 0, "-4:1"),  # integer floor division and modulo, as in Python
    ],
)
def test_host_template_grammar(template: str, rank: int, local_rank: int, node_rank: int, host: str) -> None:
    assert render_host(template, rank, local_rank, node_rank) == host


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("{rank", "unclosed '{'"),
        ("a}b", "unmatched '}'"),
        ("{}", "empty {}"),
        ("{host}", "unknown name 'host'"),
        ("{rank/2}", "unexpected '/'"),
        ("{rank**2}", "unexpected '*'"),
        ("{rank rank}", "unexpected 'rank'"),
        ("{(rank+1}", "ends too early"),
        ("{rank//0}", "division by zero"),
        ("{__import__('os')}", "unexpected \"'\""),  # refused while tokenizing: never evaluated
        ("{open}", "unknown name 'open'"),
        ("{rank.real}", "unexpected '.'"),
    ],
)
def test_bad_host_templates(template: str, reason: str) -> None:
    with pytest.raises(TemplateError, match=re.escape(reason)):
        render_host(template, 1, 1, 1)


def test_bad_template_in_the_environment_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert load_config({**ON, "RANKSCOPE_HOST": "node-{rnak}"}) is None
    assert load_config({**ON, "RANKSCOPE_HOST": "node-{rnak}"}) is None
    (message,) = warnings(caplog)
    assert message.startswith("rankscope agent: RANKSCOPE_HOST='node-{rnak}' is not valid (unknown name 'rnak'")
    assert "e.g. node-{rank//8}" in message and message.endswith("the agent stays off")


def test_template_that_cannot_render_for_this_rank(caplog: pytest.LogCaptureFixture) -> None:
    assert load_config({**ON, "RANKSCOPE_HOST": "n{rank % (local_rank - 3)}", "RANK": "1", "LOCAL_RANK": "3"}) is None
    (message,) = warnings(caplog)
    assert "RANKSCOPE_HOST='n{rank % (local_rank - 3)}' is not valid (division by zero)" in message


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        ("RANKSCOPE_ENABLE", "yes", "expected 1 (on) or 0 (off)"),
        ("RANKSCOPE_COLLECTOR", "collector", "expected host:port, [v6 address]:port or unix:/absolute/path"),
        ("RANKSCOPE_COLLECTOR", "collector:99999", "expected host:port, [v6 address]:port or unix:/absolute/path"),
        ("RANKSCOPE_COLLECTOR", "::1:7777", "expected host:port, [v6 address]:port or unix:/absolute/path"),
        ("RANKSCOPE_COLLECTOR", "unix:relative.sock", "expected host:port, [v6 address]:port or unix:/absolute/path"),
        ("RANKSCOPE_TOKEN", "two words", "expected printable ASCII without spaces"),
        ("RANKSCOPE_TLS_CA", "/no/such/ca.pem", "expected the path of a readable CA bundle (PEM)"),
        ("RANKSCOPE_SPOOL_MAX_MB", "0", "expected a whole number of MiB >= 1"),
        ("RANKSCOPE_SPOOL_MAX_MB", "1.5", "expected a whole number of MiB >= 1"),
        ("RANKSCOPE_HEARTBEAT_S", "0", "expected a positive number of seconds"),
        ("RANKSCOPE_HEARTBEAT_S", "two", "expected a positive number of seconds"),
        ("RANKSCOPE_FLUSH_S", "-1", "expected a positive number of seconds"),
        ("RANKSCOPE_STALL_S", "inf", "expected a positive number of seconds"),
        ("RANKSCOPE_DEBUG", "true", "expected 1 (on) or 0 (off)"),
        ("RANK", "-1", "expected a rank number"),
        ("WORLD_SIZE", "0", "expected a positive number of ranks"),
    ],
)
def test_bad_value_one_clear_warning_agent_off(name: str, value: str, accepted: str, caplog: pytest.LogCaptureFixture) -> None:
    environ = {**ON, name: value} if name != "RANKSCOPE_ENABLE" else {name: value}
    assert load_config(environ) is None
    assert load_config(environ) is None  # asked again: still said once
    (message,) = warnings(caplog)
    assert message.startswith(f"rankscope agent: {name}={value!r} is not valid")
    assert accepted in message and message.endswith("the agent stays off")


def test_several_bad_values_one_warning_each(caplog: pytest.LogCaptureFixture) -> None:
    assert load_config({**ON, "RANKSCOPE_HEARTBEAT_S": "-2", "RANKSCOPE_STALL_S": "never"}) is None
    assert sorted(m.split("=")[0] for m in warnings(caplog)) == ["rankscope agent: RANKSCOPE_HEARTBEAT_S", "rankscope agent: RANKSCOPE_STALL_S"]


def test_unknown_option_warns_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    config = load_config({**ON, "RANKSCOPE_HEARTBEATS": "5", "RANKSCOPE_ROLE": "", "RANKSCOPE_INJECT": ""})
    assert config is not None and config.heartbeat_s == 2.0
    (message,) = warnings(caplog)
    assert message.startswith("rankscope agent: unknown option RANKSCOPE_HEARTBEATS ignored (known: RANKSCOPE_ENABLE,")
