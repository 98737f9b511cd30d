"""Each live diagnosis lane in a process of its own, reading the store through the collector.

A detector's pass is Python (pandas, the straggler's window, critical paths) for seconds at
100,000 ranks; in the collector's interpreter it took the GIL from the event loop that decodes and
acknowledges batches, and the urgent lane's pass (the hang) from the thorough lane's. Here each lane
(``registry.URGENT``, ``registry.THOROUGH``) runs ``LiveDiagnosis`` in a child process, and the
collector answers it over a socket pair: the store's queries (one process owns a chDB data path,
and chDB releases the GIL while it runs a query), the incidents to insert, stack requests, what
the writer stored of a run and when each rank was last heard (both in the collector's memory).
A lane process that dies is started again and counted (``rankscope_diagnosis_restarts_total``);
ingest never waits for it. The child dies with the collector (``PR_SET_PDEATHSIG``, and an answer
that never comes ends it).

    python -m rankscope.collector.diagnosis.lane_process LANE FD PARENT_PID   (started by the collector)
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import pickle
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pyarrow as pa

from rankscope.collector.diagnosis.engine import LiveDiagnosis
from rankscope.collector.diagnosis.ledger import to_arrow
from rankscope.collector.diagnosis import registry
from rankscope.collector.diagnosis.detector import Detector
from rankscope.collector.diagnosis.registry import THOROUGH, URGENT
from rankscope.collector.store.base import StoreError
from rankscope.common.incidents import Incident
from rankscope.common.settings import Settings

log = logging.getLogger("rankscope.diagnosis")

LANES = {lane.name: lane for lane in (URGENT, THOROUGH)}
#: seconds before a lane process that exited is started again (a crash at start-up must not spin)
RESTART_AFTER_S = 1.0
#: seconds a lane process gets to exit after SIGTERM before it is killed
EXIT_GRACE_S = 5.0


@dataclass(frozen=True)
class LaneConfig:
    """What a lane process is told (after the collector's ``sys.path``): the collector's diagnosis options,
    and the detectors registered in the collector beyond the built-ins (``registry.register``), pickled."""

    settings: Settings
    interval_s: float
    webhook: str | None
    detectors: tuple[Detector, ...] = ()


@dataclass(frozen=True)
class Services:
    """What the collector does for its lane processes: functions called on the thread that serves a
    lane (``serve``), never on its event loop."""

    query: Callable[[str, Mapping[str, object]], pa.Table]
    insert_incidents: Callable[[pa.Table], None]
    request_stack: Callable[[str, int, str], None]
    stored: Callable[[str], tuple[int, int]]
    heard: Callable[[str, int, Iterable[int]], dict[int, int]]
    forget: Callable[[str], None]
    passed: Callable[[str, float], None]
    detected: Callable[[str, float], None]


def serve(conn: Connection, collector: Services) -> None:
    """Answer one lane process's requests until it is gone: ``(name, args)`` -> ``("ok", value)`` or
    ``("error", message)``; a failure of one request is the lane's to report, never the collector's."""
    calls: dict[str, Callable[..., Any]] = {name: getattr(collector, name) for name in Services.__dataclass_fields__}
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, Any] = ("ok", calls[name](*args))
        except Exception as e:  # noqa: BLE001 - the lane's pass fails with it, as it did on the store itself
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except OSError:
            return


class LaneProcesses:
    """The collector's side: a process per lane, kept running until ``stop``; each restart counted
    by ``on_restart(lane)``."""

    def __init__(self, collector: Services, settings: Settings, interval_s: float, webhook: str | None,
                 on_restart: Callable[[str], None]) -> None:  # fmt: skip
        self.collector = collector
        self.settings = settings
        self.interval_s = interval_s
        self.webhook = webhook
        self.on_restart = on_restart

    async def run(self, stop: asyncio.Event) -> None:
        """Keep a process for each lane until ``stop``; then end them (SIGTERM, SIGKILL after a grace)."""
        await asyncio.gather(*(self._keep(name, stop) for name in LANES))

    async def _keep(self, lane: str, stop: asyncio.Event) -> None:
        started = False
        while not stop.is_set():
            if started:
                self.on_restart(lane)
            started = True
            proc, server = await self._start(lane)
            ended = asyncio.create_task(proc.wait())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({ended, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not ended.done():
                proc.terminate()
                try:
                    await asyncio.wait_for(asyncio.shield(ended), EXIT_GRACE_S)
                except asyncio.TimeoutError:
                    proc.kill()
            code = await ended
            await asyncio.to_thread(server.join)
            if not stop.is_set():
                log.warning("rankscope diagnosis: the %s lane's process exited (status %s); starting it again", lane, code)
                try:
                    await asyncio.wait_for(stop.wait(), RESTART_AFTER_S)
                except asyncio.TimeoutError:
                    pass

    async def _start(self, lane: str) -> tuple[asyncio.subprocess.Process, threading.Thread]:
        """The lane's process (started from this thread: its parent-death signal follows it) and the
        thread that serves it."""
        ours, theirs = socket.socketpair()
        with theirs:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, lane, str(theirs.fileno()), str(os.getpid()),
                stdin=asyncio.subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
            )  # fmt: skip
        conn = Connection(ours.detach())
        conn.send(sys.path)  # first, so that the detectors' modules import there as here
        conn.send(LaneConfig(self.settings, self.interval_s, self.webhook, _own_detectors()))
        server = threading.Thread(target=_serve_then_close, args=(conn, self.collector), name=f"rankscope-{lane}-lane", daemon=True)
        server.start()
        return proc, server


def _own_detectors() -> tuple[Detector, ...]:
    """The detectors registered here beyond the built-ins that can travel to a lane process (a lambda
    cannot be pickled, nor imported there what ``__main__`` defines); those that cannot are named in a warning."""
    own = []
    for detector in registry.registered():
        if detector in registry.BUILT_IN:
            continue
        try:
            if b"__main__" in pickle.dumps(detector):
                raise pickle.PicklingError("it is defined in __main__, which a lane process does not run")
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            log.warning("rankscope diagnosis: detector %r cannot run in a lane process (%s); define it at the top level of an "
                        "importable module", detector.name, e)  # fmt: skip
            continue
        own.append(detector)
    return tuple(own)


def _serve_then_close(conn: Connection, collector: Services) -> None:
    with conn:
        serve(conn, collector)


class _Parent:
    """The lane process's side: the collector's functions as ``LiveDiagnosis`` takes them. The
    collector gone, the process ends."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()  # a pass's thread and the lane's event loop both call

    def call(self, name: str, *args: object) -> Any:
        with self._lock:
            try:
                self.conn.send((name, args))
                status, value = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the collector is gone: nothing is left to diagnose for
        if status == "error":
            raise StoreError(value)
        return value

    def query(self, sql: str, params: Mapping[str, object]) -> pa.Table:
        return self.call("query", sql, dict(params))

    def write(self, incidents: list[Incident]) -> None:
        self.call("insert_incidents", to_arrow(incidents))

    def of(self, run_id: str, attempt: int, ranks: Iterable[int] = ()) -> Mapping[int, int]:
        """``LastHeard.of`` in the collector, asked for when a detector first reads it (the thorough lane's
        do not: at 100,000 ranks it is a dictionary of 100,000 built, sent and read each pass)."""
        return _Asked(lambda: self.call("heard", run_id, attempt, list(ranks)))

    def forget(self, run_id: str) -> None:
        self.call("forget", run_id)


class _Asked(Mapping[int, int]):
    """A mapping read from the collector when first used."""

    def __init__(self, ask: Callable[[], dict[int, int]]) -> None:
        self._ask = ask

    @functools.cached_property
    def _values(self) -> dict[int, int]:
        return self._ask()

    def __getitem__(self, key: int) -> int:
        return self._values[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def _die_with(parent_pid: int) -> None:
    """SIGTERM when the collector's thread that started this process ends (Linux); exit now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass  # not Linux: an unanswered request ends the process instead
    if os.getppid() != parent_pid:
        os._exit(0)


def main(argv: list[str]) -> int:
    """Run lane ``argv[0]`` for the collector at the other end of socket ``argv[1]`` until SIGTERM."""
    lane, fd, parent_pid = LANES[argv[0]], int(argv[1]), int(argv[2])
    _die_with(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the collector's to handle
    trouble = logging.StreamHandler(sys.stderr)
    trouble.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("rankscope").addHandler(trouble)
    logging.getLogger("rankscope").propagate = False
    conn = Connection(fd)
    sys.path[:] = conn.recv()
    config: LaneConfig = conn.recv()
    for detector in config.detectors:
        if all(other.name != detector.name for other in registry.registered()):  # its module may register it on import
            registry.register(detector)
    parent = _Parent(conn)
    live = LiveDiagnosis(
        parent.query, parent.write, lambda run, rank, reason: parent.call("request_stack", run, rank, reason), config.settings,
        interval_s=config.interval_s, webhook=config.webhook, stored=lambda run: tuple(parent.call("stored", run)),
        heard=parent, on_pass=lambda lane, s: parent.call("passed", lane, s), on_detector=lambda name, s: parent.call("detected", name, s),
    )  # fmt: skip

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await live.run(stop, (lane,))

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
