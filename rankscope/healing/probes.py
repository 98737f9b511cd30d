"""One host's end of a self-check: the tests that run *on* the host, as a child process the
orchestration (``rankscope.healing.selfcheck``) starts there.

``python -m rankscope.healing.probes --probe local`` runs the host's own tests, in this order:

- ``memory_bandwidth``: a 64 MiB memory copy, GB/s (bytes read plus bytes written, as STREAM counts);
- ``loopback_allreduce``: ``ranks`` local processes all-reduce 1 MiB over 127.0.0.1 (gloo; NCCL on
  CUDA), ms per all-reduce;
- ``matmul``: matrix-multiply throughput, GFLOP/s (CPU: float32 256x256; CUDA: bf16 4096x4096).

``--serve-links`` starts a small sink server on a host; ``--probe links --peer NAME=ADDRESS:PORT``
measures, from the host to each peer's server, ``link_throughput:PEER`` (a TCP stream, Mbit/s) and
``link_rtt:PEER`` (a ping-pong, ms, median). Link tests and servers contact only the networks
given with ``--allow`` (default: loopback).

Each test prints one JSON line after ``MARK`` (its figures, or why it could not run); anything else
on stdout is ignored. Measurements are windows of about 0.1 s or more (many 10 ms CPU-quota
periods), best of a few, so that a throttled host measures slow instead of fitting one lucky burst
into its quota. This module runs on every checked host: it imports only the standard library at
load (numpy and torch inside the tests that need them).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LINK_BYTES", "LINK_SECONDS", "LOCAL_CHECKS", "LOOPBACK", "MARK", "main"]

#: the tests run on each host itself, in this order (``matmul`` last: nothing forks after it)
LOCAL_CHECKS = ("memory_bandwidth", "loopback_allreduce", "matmul")
#: the networks a link test may contact unless told others (``--allow``; ``Runner.networks``)
LOOPBACK = ("127.0.0.0/8",)
#: what the probes print before each JSON line (anything else on their stdout is ignored)
MARK = "@selfcheck "
#: bytes and seconds of a link test: the stream stops at whichever comes first
LINK_BYTES = 256 << 20
LINK_SECONDS = 0.3
LINK_PINGS = 30


def _say(message: Mapping[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def _best_window(work: Any, *, windows: int = 3, window_s: float = 0.12) -> float:
    """Seconds per call of ``work``, from the best of ``windows`` windows of at least ``window_s``
    each: a window spans many CPU-quota periods, so a throttled host measures throttled."""
    best = math.inf
    for _ in range(windows):
        calls, began = 0, time.perf_counter()
        while True:
            work()
            calls += 1
            spent = time.perf_counter() - began
            if spent >= window_s:
                break
        best = min(best, spent / calls)
    return best


def _memory_bandwidth(size: int = 64 << 20) -> dict[str, Any]:
    import numpy as np

    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page first
    per_copy = _best_window(lambda: np.copyto(dst, src))
    return {"check": "memory_bandwidth", "value": 2 * size / per_copy / 1e9, "unit": "GB/s", "detail": f"{size >> 20} MiB copy"}


def _matmul(device: str) -> dict[str, Any]:
    import torch

    if device == "cuda":  # untested on the CPU-only development machine: keep it this small
        n, dtype = 4096, torch.bfloat16
        a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)

        def work() -> None:
            for _ in range(10):
                a @ b
            torch.cuda.synchronize()

        work()
        per_call = _best_window(work) / 10
    else:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        n, dtype = 256, torch.float32
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        per_call = _best_window(lambda: a @ b)
    return {"check": "matmul", "value": 2 * n**3 / per_call / 1e9, "unit": "GFLOP/s", "detail": f"{device} {str(dtype).split('.')[-1]} {n}x{n}"}


def _allreduce_worker(rank: int, world: int, port: int, device: str, size: int, window_s: float, conn: Any) -> None:
    """One rank of the loopback all-reduce: sends back its ms per all-reduce, from the best of three
    windows of about ``window_s`` each (the ranks agree on how many all-reduces make a window)."""
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=world)
        if device == "cuda":
            torch.cuda.set_device(rank)
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)

        def window(iterations: int) -> float:
            if device == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            for _ in range(iterations):
                dist.all_reduce(tensor)
            if device == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - began) / iterations

        window(3)  # warm-up
        count = torch.tensor([min(2000, max(5, math.ceil(window_s / window(5))))], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        best = min(window(int(count.item())) for _ in range(3))
        dist.destroy_process_group()
        conn.send(best * 1e3)
    except BaseException as e:  # noqa: BLE001: the parent reports it
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def _loopback_allreduce(device: str, ranks: int, size: int = 1 << 20, window_s: float = 0.12) -> dict[str, Any]:
    import multiprocessing

    import torch.distributed as dist

    if ranks <= 0:
        import torch

        ranks = torch.cuda.device_count() if device == "cuda" else 2
        if ranks < 2:  # NCCL takes one rank per GPU: with one GPU, the loopback test is gloo's
            device, ranks = "cpu", 2
    if ranks < 2:
        raise RuntimeError(f"a loopback all-reduce needs 2 or more processes, not {ranks}")
    # fork on CPU: the workers share the parent's imported torch (starting a fresh interpreter that
    # imports torch costs seconds on a throttled host); spawn on CUDA, which does not survive a fork
    context = multiprocessing.get_context("spawn" if device == "cuda" else "fork")
    store = dist.TCPStore("127.0.0.1", 0, ranks + 1, True, wait_for_workers=False)
    pipes, workers = [], []
    for rank in range(ranks):
        receive, send = context.Pipe(duplex=False)
        worker = context.Process(target=_allreduce_worker, args=(rank, ranks, store.port, device, size, window_s, send), daemon=True)
        worker.start()
        send.close()
        pipes.append(receive)
        workers.append(worker)
    answers = [p.recv() for p in pipes]
    for w in workers:
        w.join(10)
    del store
    errors = [a for a in answers if isinstance(a, str)]
    if errors:
        raise RuntimeError(errors[0])
    backend = "nccl" if device == "cuda" else "gloo"
    return {"check": "loopback_allreduce", "value": max(answers), "unit": "ms", "detail": f"{ranks} ranks, {size >> 20} MiB, {backend}"}


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _probe_local(checks: Sequence[str], ranks: int, device: str) -> None:
    for check in checks:
        try:
            if check == "memory_bandwidth":
                figure = _memory_bandwidth()
            elif check == "loopback_allreduce":
                figure = _loopback_allreduce(_device(device), ranks)
            elif check == "matmul":
                figure = _matmul(_device(device))
            else:
                raise ValueError(f"no check {check!r}")
        except Exception as e:  # noqa: BLE001: a test that cannot run is a finding, not a crash
            _say({"checks": [check], "error": f"{type(e).__name__}: {e}"})
            continue
        _say({"figures": [figure]})


def _allowed(address: str, networks: Sequence[str]) -> None:
    if not any(ipaddress.ip_address(address) in ipaddress.ip_network(net) for net in networks):
        raise ValueError(f"a link test contacts only {', '.join(networks)}, not {address}")


def _probe_links(peers: Sequence[str], total_bytes: int, seconds: float, socket_timeout_s: float, networks: Sequence[str]) -> None:
    for spec in peers:
        name, _, target = spec.partition("=")
        address, _, port = target.rpartition(":")
        checks = [f"link_throughput:{name}", f"link_rtt:{name}"]
        try:
            _allowed(address, networks)
            rtt = _ping(address, int(port), socket_timeout_s)
            mbit = _stream(address, int(port), total_bytes, seconds, socket_timeout_s)
        except (OSError, ValueError) as e:
            _say({"checks": checks, "error": f"{address}:{port}: {type(e).__name__}: {e}"})
            continue
        _say({"figures": [
            {"check": checks[0], "value": mbit, "unit": "Mbit/s", "detail": f"to {address}"},
            {"check": checks[1], "value": rtt, "unit": "ms", "detail": f"to {address}, median of {LINK_PINGS}"},
        ]})  # fmt: skip


def _ping(address: str, port: int, timeout_s: float) -> float:
    with socket.create_connection((address, port), timeout=timeout_s) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"E")
        times = []
        for _ in range(LINK_PINGS + 3):
            began = time.perf_counter()
            s.sendall(b"x" * 64)
            _read_exactly(s, 64)
            times.append(time.perf_counter() - began)
        return statistics.median(times[3:]) * 1e3


def _stream(address: str, port: int, total_bytes: int, seconds: float, timeout_s: float) -> float:
    chunk = b"\0" * (256 << 10)
    with socket.create_connection((address, port), timeout=timeout_s) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # what is left in it when time is up drains quickly on a slow link
        s.sendall(b"S")
        sent, began = 0, time.perf_counter()
        while sent < total_bytes and time.perf_counter() - began < seconds:
            s.sendall(chunk)
            sent += len(chunk)
        s.shutdown(socket.SHUT_WR)
        (received,) = struct.unpack("!Q", _read_exactly(s, 8))
        spent = time.perf_counter() - began
    return received * 8 / spent / 1e6


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = s.recv(n - len(data))
        if not part:
            raise ConnectionError("the peer closed the connection")
        data += part
    return data


def _serve_links(bind: str, for_s: float, networks: Sequence[str]) -> None:
    """The peer's end of the link tests: ``E`` echoes, ``S`` sinks and answers with the byte count.
    One connection at a time (the hosts are checked one at a time); gone after ``for_s`` seconds."""
    _allowed(bind, networks)
    deadline = time.monotonic() + for_s
    with socket.create_server((bind, 0)) as server:
        _say({"port": server.getsockname()[1]})
        while (left := deadline - time.monotonic()) > 0:
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                return
            with conn:
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                try:
                    mode = conn.recv(1)
                    if mode == b"E":
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        while data := conn.recv(1 << 16):
                            conn.sendall(data)
                    elif mode == b"S":
                        received = 0
                        while data := conn.recv(1 << 20):
                            received += len(data)
                        conn.sendall(struct.pack("!Q", received))
                except OSError:
                    continue


def main(argv: Sequence[str] | None = None) -> int:
    """Run the probe or the link server the command line names, on this host; 0 even when a test
    could not run (that is an answer too, printed in place of its figure)."""
    from rankscope.common.cmdline import Parser

    parser = Parser(prog="python -m rankscope.healing.probes", description="one host's end of rankscope selfcheck (a probe or a link server)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--probe", choices=("local", "links"))
    what.add_argument("--serve-links", action="store_true")
    parser.add_argument("--checks", default=",".join(LOCAL_CHECKS))
    parser.add_argument("--ranks", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=ADDRESS:PORT")
    parser.add_argument("--bytes", type=int, default=LINK_BYTES)
    parser.add_argument("--seconds", type=float, default=LINK_SECONDS)
    parser.add_argument("--socket-timeout", type=float, default=10.0)
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--for", dest="for_s", type=float, default=600.0)
    parser.add_argument("--allow", action="append", metavar="CIDR", help=f"a network link tests may contact (default: {', '.join(LOOPBACK)})")
    args = parser.parse_args(argv)
    networks = args.allow or list(LOOPBACK)
    if args.serve_links:
        _serve_links(args.bind, args.for_s, networks)
    elif args.probe == "local":
        from rankscope.common.frozen_imports import frozen_imports

        with frozen_imports():  # torch's import, 0.7 s of CPU less: seconds on a throttled host
            _probe_local(args.checks.split(","), args.ranks, args.device)
    else:
        _probe_links(args.peer, args.bytes, args.seconds, args.socket_timeout, networks)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # its answers are out and its workers joined: skip the interpreter's teardown of torch, which took a
    # host's single core 1.6 s and a throttled host over the orchestration's 5 s of grace (then SIGTERM)
    os._exit(code)
