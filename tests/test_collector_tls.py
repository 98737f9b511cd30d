"""TLS between agents, readers and a real collector: certificates made with openssl for each test.

The collector is the real ``rankscope collector`` process with ``--tls-cert``/``--tls-key`` and a
token; the agent side is the real Transport with ``RANKSCOPE_TLS_CA``, the reading side the
collector client and ``rankscope sql --tls-ca``. A plain-text client and a client that trusts
another CA must both be turned away.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from test_agent_transport import TOKEN, agent_config, register, run_name, span_batch
from conftest import start_collector

from rankscope.agent.transport import Transport
from rankscope.cli.main import main
from rankscope.collector.client import Client, QueryFailed, Unreachable
from rankscope.collector.server import ServerOptions

if TYPE_CHECKING:
    from conftest import ProcRunner

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 that is its own CA, and its key (PEM files)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


@needs_openssl
@pytest.mark.slow
def test_agent_and_readers_talk_tls_and_plain_text_or_another_ca_is_refused(
    proc_runner: ProcRunner, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key = self_signed(tmp_path, "collector")
    other_ca, _ = self_signed(tmp_path, "other")
    collector = start_collector(
        proc_runner, tmp_path / "store", "--token", TOKEN, "--tls-cert", str(cert), "--tls-key", str(key), "--flush-interval", "0.1"
    )
    assert ", with TLS, " in collector.proc.stdout
    # serving TLS before the agent's first handshake: a collector just started in a starved background lane
    # let one time out ("handshaker shutdown", CI of 4829125), and the agent spooled both batches, as it should
    deadline = time.monotonic() + 120
    while True:
        try:
            with Client(collector.target, token=TOKEN, tls_ca=cert, timeout_s=30) as client:
                client.query("SELECT 1")
            break
        except Unreachable:
            assert time.monotonic() < deadline, "the collector did not answer over TLS within 120 s"
            time.sleep(1)

    run_id = run_name()
    transport = Transport(agent_config(collector.target, tmp_path / "spool", RANKSCOPE_TLS_CA=str(cert)), run_id, 0)
    transport.start()
    assert transport.submit(register()) and transport.submit(span_batch(1, n=100))
    transport.close(timeout_s=60)
    stats = transport.stats()
    assert (stats.acked, stats.spooled, stats.errors) == (2, 0, {})

    count = "SELECT count() AS n FROM spans WHERE run_id = {run:String}"
    with Client(collector.target, token=TOKEN, tls_ca=cert) as client:
        assert client.query(count, {"run": run_id}).to_pylist() == [{"n": 100}]
    assert main(["sql", "--collector", collector.target, "--token", TOKEN, "--tls-ca", str(cert), "--format", "csv",
                 "--param", f"run={run_id}", count]) == 0  # fmt: skip
    assert capsys.readouterr().out.splitlines() == ["n", "100"]

    for refused in (Client(collector.target, token=TOKEN, timeout_s=5), Client(collector.target, token=TOKEN, timeout_s=5, tls_ca=other_ca)):
        with refused, pytest.raises(Unreachable):
            refused.query("SELECT 1")


def test_a_certificate_needs_its_key_and_the_reverse() -> None:
    with pytest.raises(ValueError, match="both a certificate and its private key"):
        ServerOptions(tls_cert=Path("cert.pem"))
    with pytest.raises(ValueError, match="both a certificate and its private key"):
        ServerOptions(tls_key=Path("key.pem"))


@needs_openssl
def test_the_collector_command_refuses_half_a_pair_before_opening_a_store(proc_runner: ProcRunner, tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path, "collector")
    proc = proc_runner.start([sys.executable, "-m", "rankscope.cli.main", "collector", "--store", str(tmp_path / "store"),
                              "--tls-cert", str(cert)])  # fmt: skip
    assert proc.wait(60) == 2
    assert "--tls-cert and --tls-key" in proc.stderr
    assert not (tmp_path / "store").exists()


@needs_openssl
@pytest.mark.parametrize(
    "command, flag, file, reason",
    [
        ("collector", "--tls-cert", "missing.pem", "cannot read missing.pem"),
        ("collector", "--tls-cert", "collector-key.pem", "holds no PEM CERTIFICATE"),
        ("collector", "--tls-key", "collector.pem", "holds no PEM PRIVATE KEY"),
        ("sql", "--tls-ca", "missing.pem", "cannot read missing.pem"),
        ("dashboard", "--tls-ca", "collector-key.pem", "holds no PEM CERTIFICATE"),
    ],
)
def test_pem_flags_are_checked_when_parsed(
    command: str, flag: str, file: str, reason: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    self_signed(tmp_path, "collector")
    monkeypatch.chdir(tmp_path)
    extra = ["SELECT 1"] if command == "sql" else []
    with pytest.raises(SystemExit) as exit_info:
        main([command, flag, file, *extra])
    assert exit_info.value.code == 2
    assert reason in capsys.readouterr().err


def test_the_client_names_an_unreadable_ca_bundle(tmp_path: Path) -> None:
    with pytest.raises(QueryFailed, match="cannot read the CA bundle"):
        Client("127.0.0.1:1", tls_ca=tmp_path / "missing.pem")
