"""The agent's life in one process: start, wiring, the background loop, and the last word.

``start(config)`` is called by the start-up hook (``autoload``: under torchrun as soon as torch
is imported, otherwise right after ``init_process_group``) or by ``rankscope.agent.init()``. It
wires the recorder, the collective wrappers, automatic spans and OpenTelemetry at once, so
nothing the script does afterwards is missed. The rank comes from torchrun's environment or the
default process group; the run id is ``config.run_id`` (torchrun's, Slurm's, or the user's),
else the ranks agree on one through the job's c10d store once the default group exists (every
rank proposes a uuid with ``compare_set``; the first one wins everywhere): a store operation,
not a collective, so no sequence number moves. Until both are known, rows wait in the buffers.

The background thread, every ``RANKSCOPE_FLUSH_S`` or when a buffer fills: switches to CUDA
timing once the script has initialised CUDA, re-anchors the clocks, looks for collectives the
wrappers could not see, re-registers when groups, topology or device changed, and hands the
recorder's batches to the Transport.

The end of a rank is reported as an EndOfRank: a normal end (atexit), ``sys.exit`` with a
non-zero code (with the exception being handled, when a launcher's wrapper caught the script's
and exits, as ``torch.multiprocessing.spawn`` does), an uncaught exception (``sys.excepthook``,
chained), or SIGTERM. torchrun sends
SIGTERM to the surviving ranks when one fails, and those are usually blocked inside a
collective, where a Python signal handler would not run until the collective returns; so the
signal is watched from a thread through ``signal.set_wakeup_fd``, which reports it, flushes for
at most ``SIGTERM_FLUSH_S`` and then lets the default action end the process as SIGTERM would
have. A forked child (a data-loader worker) turns everything off at once and stays quiet.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import rankscope
from rankscope import agent as api
from rankscope.agent import otel
from rankscope.agent.autospans import AutoSpans
from rankscope.agent.collective_patches import install as install_collectives
from rankscope.agent.collective_patches import uninstall as uninstall_collectives
from rankscope.agent.collective_tracker import Collectives
from rankscope.agent.config import AgentConfig, warn_once
from rankscope.agent.heartbeat import Heartbeat
from rankscope.agent.metrics import MetricsReporter
from rankscope.agent.process_groups import Groups
from rankscope.agent.recorder import Recorder
from rankscope.agent.state import RankState
from rankscope.agent.timing import CpuClock, cuda_clock
from rankscope.agent.transport import Transport
from rankscope.protos.v1 import telemetry_pb2 as pb

__all__ = ["Agent", "current", "start", "stop"]

EXIT_FLUSH_S = 5.0
SIGTERM_FLUSH_S = 2.0
RUN_ID_KEY = "rankscope/run_id"

_agent: Agent | None = None
_lock = threading.Lock()


def start(config: AgentConfig) -> None:
    """Start the agent in this process (idempotent). Called through ``autoload.activate``, which
    turns anything this raises into one warning: training goes on without the agent."""
    global _agent
    with _lock:
        if _agent is not None:
            return
        _agent = Agent(config)
    _agent.start()


def stop(timeout_s: float = EXIT_FLUSH_S) -> None:
    """End the agent as at a normal exit and detach it (tests and benchmarks)."""
    global _agent
    with _lock:
        running, _agent = _agent, None
    if running is not None:
        running.finish(pb.EndOfRank.REASON_NORMAL, 0, 0, "", timeout_s)


def current() -> Agent | None:
    """The running agent of this process, if any."""
    return _agent


class Agent:
    """Everything one process's agent runs; see the module docstring for the order of things."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.pid = os.getpid()
        self.start_ns = time.time_ns()
        self.state = RankState()
        self.rec = Recorder(CpuClock(), self.state)
        self.groups = Groups()
        self.collectives = Collectives(self.rec, self.groups)
        self.autospans: AutoSpans | None = None
        self.stop_otel: Any = None
        self.transport: Transport | None = None
        self.heartbeat: Heartbeat | None = None
        self.metrics: MetricsReporter | None = None
        self.identity: Identity | None = None
        self.topology: tuple[int, int, int, int, int, int] | None = None  # tp, pp, dp, tp_rank, pp_rank, dp_rank
        self._registered: tuple[Any, ...] | None = None
        self._stop = threading.Event()
        self._finished = threading.Lock()
        self._done = False
        self._ended = threading.Event()  # set once finish() has sent the EndOfRank (or given up)
        self._finisher: int | None = None  # the thread running finish()
        self._exit_code: Any = None
        self._exception = ""
        self._thread = threading.Thread(target=self._run, name="rankscope-agent", daemon=True)

    def start(self) -> None:
        self.identity = _identify(self.config)  # now, while the default group surely exists
        install_collectives(self.collectives)
        self.autospans = _guarded("starting automatic spans", lambda: AutoSpans(self.rec, self.collectives))
        self.stop_otel = _guarded("recording OpenTelemetry spans", lambda: otel.install(self.rec))
        self._hook_exit()
        os.register_at_fork(after_in_child=_after_fork_in_child)
        api._attach(self.rec)
        self._thread.start()

    # --- what the public API forwards --------------------------------------------------------

    def name_groups(self, groups: Mapping[str, Any]) -> None:
        for name, group in groups.items():
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
                self.collectives.rename(group, name)

    def set_topology(self, tp: int, pp: int, dp: int, coords: tuple[int | None, int | None, int | None]) -> None:
        rank = self.identity.rank if self.identity else self.config.rank
        default = (rank % tp, rank // (tp * dp), (rank // tp) % dp) if rank is not None else (-1, -1, -1)
        tp_rank, pp_rank, dp_rank = (d if c is None else c for c, d in zip(coords, default))
        self.topology = (tp, pp, dp, tp_rank, pp_rank, dp_rank)

    # --- the background thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the loop must go on
                warn_once("agent-loop", f"the agent's background loop failed ({exc!r})")
            self.rec.wake.wait(self.config.flush_s)
            self.rec.wake.clear()

    def tick(self, final: bool = False) -> None:
        """One round of background work (also run once more at the end, ``final``)."""
        if self.transport is None:
            self._connect(final)
        if self.rec.cpu_clock and (clock := cuda_clock()) is not None:
            self.rec.use_clock(clock)
        self.rec.clock.calibrate()
        self.collectives.poll()
        if self.transport is None:
            return  # keep the rows until there is somewhere to send them
        self._register()
        rows = 0
        for batch in self.rec.drain():
            rows += batch.count
            if not self.transport.submit(batch):
                self.state.dropped += batch.count
        if rows:  # spans or collectives ended since the last round
            self.state.progress(self.rec.clock.wall_ns())

    def _connect(self, final: bool) -> None:
        """Create the Transport once this process knows its rank and run id (at the very end,
        only the Transport: the data still goes out, heartbeats and metrics would be too late)."""
        if self.identity is None:
            self.identity = _identify(self.config)
            if self.identity is None:
                return
        self.transport = Transport(self.config, self.identity.run_id, self.identity.rank, on_command=self._on_command)
        self.transport.start()
        if final:
            return
        self._register()  # before the first heartbeat: the collector takes a run's rows once it is registered
        self.heartbeat = Heartbeat(self.state, self.transport, interval_s=self.config.heartbeat_s, stall_s=self.config.stall_s)
        self.heartbeat.start()
        self.metrics = _guarded("starting metrics", self._start_metrics)

    def _start_metrics(self) -> MetricsReporter:
        assert self.transport is not None
        reporter = MetricsReporter(self.transport, local_rank=self.config.local_rank or 0)
        reporter.start()
        return reporter

    def _on_command(self, command: Any) -> None:
        if self.heartbeat is not None:
            self.heartbeat.on_command(command)

    def _register(self) -> None:
        device = _device()
        key = (self.groups.version, self.topology, device)
        if key == self._registered or self.transport is None:
            return
        self._registered = key
        tp, pp, dp, tp_rank, pp_rank, dp_rank = self.topology or (1, 1, 1, -1, -1, -1)
        local_rank = self.config.local_rank or 0
        node_rank = self.config.node_rank or 0
        rank, world_size, _ = self.identity  # type: ignore[misc]
        self.transport.submit(
            pb.Register(
                world_size=world_size, host=self.config.host(rank, local_rank, node_rank), pid=self.pid,
                local_rank=local_rank, device=device, tp=tp, pp=pp, dp=dp, tp_rank=tp_rank, pp_rank=pp_rank,
                dp_rank=dp_rank, groups=self.groups.protos(), config_json=json.dumps({"argv": sys.argv}),
                start_time_ns=self.start_ns, agent_version=rankscope.__version__, time_ns=time.time_ns(),
                world=_world(world_size),
            )
        )  # fmt: skip

    # --- the end ------------------------------------------------------------------------------

    def finish(self, reason: int, exit_code: int, signum: int, message: str, timeout_s: float) -> None:
        """Flush everything, send the EndOfRank, close the Transport; once per process.

        A second caller on another thread (SIGTERM arriving while the script exits, or the
        reverse) waits for the first, up to ``timeout_s``: it would otherwise end the process
        in the middle of the first one's flush. If that is not done by then, what it has handed
        the Transport is spooled before the process ends (``Transport.cut_short``)."""
        with self._finished:
            first = not self._done
            self._done = True
            if first:
                self._finisher = threading.get_ident()
        if not first:
            if self._finisher != threading.get_ident() and not self._ended.wait(timeout_s) and self.transport is not None:
                self.transport.cut_short()  # the process ends when this returns: what the first one sends goes to disk
            return
        try:
            self._finish(reason, exit_code, signum, message, timeout_s)
        finally:
            self._ended.set()

    def _finish(self, reason: int, exit_code: int, signum: int, message: str, timeout_s: float) -> None:
        api._attach(None)
        uninstall_collectives()
        self._stop.set()
        self.rec.wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(min(timeout_s, 1.0))
        try:
            self.collectives.finish_all()
            self.tick(final=True)
        except Exception as exc:  # noqa: BLE001
            warn_once("agent-end", f"the last flush failed ({exc!r})")
        if self.heartbeat is not None:
            _guarded("ending heartbeats", lambda: self.heartbeat.stop(min(timeout_s, 1.0)))  # type: ignore[union-attr]
        for part, end in ((self.autospans, "close"), (self.metrics, "stop"), (self.stop_otel, "__call__")):
            if part is not None:
                _guarded(f"ending {type(part).__name__}", getattr(part, end))
        if self.transport is not None:
            now = self.rec.clock.wall_ns()
            self.transport.submit(pb.EndOfRank(time_ns=now, reason=reason, exit_code=exit_code, signal=signum, message=message))
            self.transport.close(timeout_s)
            if self.config.debug:  # what a harness counts the store against (harness/collector_kills.py)
                stats = self.transport.stats()
                print(f"rankscope agent: rank {self.transport.rank} sent {stats.events} events, dropped {stats.dropped_events}",
                      file=sys.stderr, flush=True)  # fmt: skip

    def _hook_exit(self) -> None:
        atexit.register(self._at_exit)
        previous_hook = sys.excepthook

        def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            self._exception = _describe(value)
            previous_hook(kind, value, tb)

        sys.excepthook = excepthook
        previous_exit = sys.exit

        def exit(code: Any = None) -> None:  # noqa: A001 - sys.exit's own name
            self._exit_code = code
            handled = sys.exc_info()[1]
            if code not in (None, 0) and handled is not None and not isinstance(handled, SystemExit):
                # A launcher's wrapper caught the script's exception and exits with a code
                # (torch.multiprocessing.spawn does): that exception is why the rank ended.
                self._exception = _describe(handled)
            previous_exit(code)

        sys.exit = exit
        _watch_sigterm(self._on_sigterm)

    def _at_exit(self) -> None:
        if os.getpid() != self.pid:
            return
        code = self._exit_code
        if self._exception:
            self.finish(pb.EndOfRank.REASON_EXCEPTION, code if isinstance(code, int) and code else 1, 0, self._exception, EXIT_FLUSH_S)
        elif code not in (None, 0):
            message = "" if isinstance(code, int) else str(code)
            self.finish(pb.EndOfRank.REASON_EXIT_CODE, code if isinstance(code, int) else 1, 0, message, EXIT_FLUSH_S)
        else:
            self.finish(pb.EndOfRank.REASON_NORMAL, 0, 0, "", EXIT_FLUSH_S)

    def _on_sigterm(self) -> None:
        if os.getpid() == self.pid:
            self.finish(pb.EndOfRank.REASON_SIGNAL, 0, int(signal.SIGTERM), "SIGTERM", SIGTERM_FLUSH_S)


def _describe(exc: BaseException) -> str:
    """An exception as its last traceback line says it ("RuntimeError: ...")."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


# --- identity ----------------------------------------------------------------------------------


class Identity(NamedTuple):
    rank: int
    world_size: int
    run_id: str


def _identify(config: AgentConfig) -> Identity | None:
    """Rank, world size and run id once they are known: from torchrun's environment at once,
    else once the default process group exists; a process with neither is a run of one."""
    grouped = dist.is_available() and dist.is_initialized()
    if grouped:
        rank, world = dist.get_rank(), dist.get_world_size()
    elif config.rank is not None:
        rank, world = config.rank, config.world_size or 1
    else:
        rank, world = 0, 1
    if config.run_id is not None:
        return Identity(rank, world, config.run_id)
    if grouped:
        return Identity(rank, world, _agree_run_id())
    return None if config.rank is not None or config.world_size else Identity(0, 1, uuid.uuid4().hex)


def _agree_run_id() -> str:
    """One id for the whole job, through the default group's store (every rank proposes one)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.compare_set(RUN_ID_KEY, "", uuid.uuid4().hex).decode()
    except Exception as exc:  # noqa: BLE001 - private API; this rank then reports under its own id
        warn_once("run-id", f"the ranks could not agree on a run id ({exc!r}); set RANKSCOPE_RUN_ID")
        return uuid.uuid4().hex


def _device() -> str:
    """"cuda:N (name)" once the script has initialised CUDA, else "cpu"."""
    if torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return "cpu"


# --- process plumbing ---------------------------------------------------------------------------


def _guarded(what: str, make: Any) -> Any:
    """``make()``, or None with one warning: a part of the agent may fail, the rest goes on."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001
        warn_once(f"part:{what}", f"{what} failed ({exc!r})")
        return None


def _after_fork_in_child() -> None:
    """A forked child (data-loader worker) is not a rank: no API, no wrappers, default SIGTERM."""
    global _agent
    _agent = None
    api._attach(None)
    api._may_start = False  # for good: span() takes its no-op fast path
    uninstall_collectives()
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass


def _watch_sigterm(report: Any) -> None:
    """Report SIGTERM even while the main thread is blocked in C (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        warn_once("sigterm", "started off the main thread: an ending SIGTERM is not reported")
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_IGN, None):
        return  # ignored, or owned by C code: leave it alone
    if callable(previous):  # the script's own handler: chain it (runs when the main thread can)
        def chained(signum: int, frame: Any) -> None:
            report()
            previous(signum, frame)

        signal.signal(signal.SIGTERM, chained)
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    if signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False) != -1:  # taken (asyncio): put it back
        signal.set_wakeup_fd(signal.set_wakeup_fd(-1))
        os.close(read_fd)
        os.close(write_fd)
        warn_once("sigterm", "the signal wake-up fd is in use: an ending SIGTERM is not reported")
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the watcher acts for it

    def watch() -> None:
        while True:
            data = os.read(read_fd, 64)
            if int(signal.SIGTERM) in data:
                report()
                _die_of_sigterm()

    threading.Thread(target=watch, name="rankscope-sigterm", daemon=True).start()


def _die_of_sigterm() -> None:
    """End the process as an unhandled SIGTERM would, from any thread."""
    try:
        libc = ctypes.CDLL(None)
        libc.signal(int(signal.SIGTERM), 0)  # SIG_DFL, at the OS level (signal.signal is main-thread only)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5.0)  # the signal ends the process long before this
    finally:
        os._exit(128 + int(signal.SIGTERM))


def _world(world_size: int) -> str:
    """What every rank of one torchrun round shares and the next round does not: its store's address
    and its size. Where torchrun does not share its rendezvous store with the workers
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as ``rankscope launch`` runs it) each round's store has a
    port of its own. Where it does, the port stays, and the restart count tells the rounds apart: on
    one host it is every rank's, while across hosts it is not (each host's agent counts only the
    restarts its own workers' failures caused)."""
    master = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    if master == ":":
        return ""
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return f"{master}/{world_size}"
    return f"{master}/{world_size}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
