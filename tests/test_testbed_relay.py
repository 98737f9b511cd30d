"""The delay relay slows one host's open TCP connection by twice the delay and lets it go again.

Two hosts behind a bridge, as the test bed lays them out, built here with plain ``ip`` commands:
an echo server on host 1, and on host 0 a client that sends a small message every 10 ms over ONE
connection and prints each round trip. The delay goes on and off host 1 while that connection
stays open.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from rankscope.testbed.relay import start_delay

SERVER_ADDRESS = "10.200.0.2"  # host 1, the delayed one
PORT = 7777
DELAY_MS = 20.0

SERVER = textwrap.dedent(
    """
    import socket, sys
    listener = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    conn, _ = listener.accept()
    while data := conn.recv(4096):
        conn.sendall(data)
    """
)
# Prints "<monotonic time> <round trip ms>" per message; dies (and says why) if the connection breaks.
CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        start = time.monotonic()
        conn.sendall(b"x" * 64)
        got = 0
        while got < 64:
            chunk = conn.recv(64 - got)
            if not chunk:
                sys.exit("connection closed")
            got += len(chunk)
        print(time.monotonic(), (time.monotonic() - start) * 1000, flush=True)
        time.sleep(0.01)
    """
)


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10).stdout


def _ip(*args: str) -> str:
    return _run("ip", *args)


def _namespaces(prefix: str) -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.startswith(prefix)]


def _links(namespace: str) -> set[str]:
    return {link["ifname"] for link in json.loads(_ip("-n", namespace, "-j", "link", "show"))}


def _python_in(namespace: str, script: str) -> list[str]:
    """``script`` (SERVER or CLIENT, given host 1's address and PORT) run by this Python in ``namespace``."""
    return ["ip", "netns", "exec", namespace, sys.executable, "-c", script, SERVER_ADDRESS, str(PORT)]


def _build(prefix: str, hosts: int) -> None:
    """The test bed's layout: bridge br0 in PREFIX-sw, host I in PREFIX-hI with eth0 = 10.200.0.{I+1}."""
    switch = f"{prefix}-sw"
    try:
        _ip("netns", "add", switch)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.strip()}")
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    for i in range(hosts):
        host = f"{prefix}-h{i}"
        _ip("netns", "add", host)
        _ip("-n", host, "link", "add", "eth0", "type", "veth", "peer", "name", f"h{i}", "netns", switch)
        _ip("-n", switch, "link", "set", f"h{i}", "master", "br0", "up")
        _ip("-n", host, "addr", "add", f"10.200.0.{i + 1}/24", "dev", "eth0")
        _ip("-n", host, "link", "set", "eth0", "up")
        _ip("-n", host, "link", "set", "lo", "up")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_delay_applies_and_lifts_on_an_open_connection(proc_runner) -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces and TAP devices need root")
    if not os.path.exists("/dev/net/tun"):
        pytest.skip("the relay needs TAP devices (/dev/net/tun)")
    prefix = f"rsr{secrets.token_hex(3)}"
    switch, server_ns, client_ns = f"{prefix}-sw", f"{prefix}-h1", f"{prefix}-h0"
    relay = None
    try:
        _build(prefix, hosts=2)
        server = proc_runner.start(_python_in(server_ns, SERVER), name="server")
        server.wait_for("listening", timeout=10)
        client = proc_runner.start(_python_in(client_ns, CLIENT), name="client")

        def median_rtt_ms(seconds: float = 1.5) -> float:
            """The median round trip of the messages sent in the next ``seconds``, on the one connection."""
            start = time.monotonic()
            time.sleep(seconds)
            assert client.returncode is None and server.returncode is None, client.output() + server.output()
            samples = (line.split() for line in client.stdout.splitlines())
            rtts = [float(rtt) for at, rtt in samples if float(at) > start]
            assert len(rtts) >= 10, client.output()
            return statistics.median(rtts)

        before = median_rtt_ms()
        relay = start_delay(switch, server_ns, 1, DELAY_MS)
        during = median_rtt_ms()
        relay.stop()
        assert relay.process.returncode is not None
        assert "dly" not in _links(server_ns) and "dly1" not in _links(switch)
        assert "clsact" not in _run("tc", "-n", server_ns, "qdisc", "show", "dev", "eth0")
        after = median_rtt_ms()
        print(f"median RTT before {before:.3f} ms, with {DELAY_MS:g} ms delay {during:.3f} ms, after {after:.3f} ms")
        assert before < 5
        assert 30 < during - before < 80
        assert after < 5
    finally:
        if relay is not None:
            relay.stop()
        proc_runner.cleanup()
        for namespace in _namespaces(prefix):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
    assert _namespaces(prefix) == []
