"""When the collector last heard from each rank: the clock the diagnosis judges silence by.

Kept apart from decoding and from the run registry because it answers another question (is a
rank still talking to this collector, whatever the store holds yet), is written on the event
loop and read by the diagnosis thread, and discounts the time the collector itself could not
listen.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
import pyarrow as pa

from rankscope.agent.transport import BACKOFF_MAX_S, CALL_TIMEOUT_S
from rankscope.collector.decode import Decoded

log = logging.getLogger("rankscope.collector")

#: how long after a collector's start a live agent may take to reach it: its call's deadline, then its
#: next probe (``rankscope.agent.transport``)
REJOIN_S = CALL_TIMEOUT_S + BACKOFF_MAX_S
#: a deafness this long may have made the agents' calls outlive their deadline (the calls queued before it
#: waited longer): they spool, and come back one by one over the next ``REJOIN_S``
LONG_DEAF_S = CALL_TIMEOUT_S / 2


def cpu_wait_ns() -> int | None:
    """How long the calling thread has waited for a CPU while it could run (ns since it began: the kernel's
    ``run_delay``, throttling by a cgroup's CPU quota included); None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as stats:
            return int(stats.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


class LastHeard:
    """When the collector last heard from each rank, by its own clock, whatever its writer has stored.

    A collector that falls behind (short of CPU, replaying a spool, a slow store) stores heartbeats
    late: judged by its newest stored heartbeat, every rank would look silent while it keeps
    sending. A rank is heard when a heartbeat or registration of it arrives, at the arrival time; one
    older than ``stale_ns`` on arrival (a spool replayed after the rank's end) says only that the
    rank lived until then. Written on the event loop, read by the
    diagnosis thread (``of`` copies).

    Silence counts only the time the collector could listen. While its event loop stalls (the
    process stopped, or starved of CPU) the ranks' calls wait unread in its sockets, so a stall is
    added to every rank's last-heard time: ``listening()``, called by the loop every ``tick_s``,
    counts a tick that came more than a tick late as a stall, and ``of`` counts the stall in
    progress too (a diagnosis pass can run before the loop catches up). A loop that ticks on time can
    still be starved between its ticks: a collector at a low priority beside a busy job gets a few
    milliseconds a second, enough to tick, not to take up the calls queued in its sockets (seen: a
    collector at nice 10 beside 16 training processes on 2 cores heard nobody for over a minute and
    named every host lost): what that costs is measured where it shows, in the calls (below). How long
    the loop's thread waited for a CPU (``cpu_wait``, the kernel's run delay) is said once a minute when
    it was most of a tick, and is no deafness by itself: a collector at nice 10 beside a busy job waits
    0.5-0.9 s of each second and still takes up its calls on time, and counting that wait slowed every
    silence it had to name (test-bed kills beside one busy loop: unnamed in 3 of 3 runs, named in 10-13 s without it).
    A rank need not be back the moment the collector listens again after a deafness of over ``LONG_DEAF_S``:
    its agent's call may have outlived its deadline, and it comes back by its spool's next probe. So
    after such a deafness no rank is silent before ``REJOIN_S`` has passed (seen: a collector starved for
    a minute beside CPU hogs, seven ranks back 35 s after their calls failed, the eighth 13 s after
    them, and named lost). Nor does the time before
    this collector started count (it was down, or killed and restarted): ``of`` hears no rank of
    the run earlier than the start, whatever the store's heartbeats or a replayed spool say, so a
    rank silent since is named lost ``silent_after`` after the start.

    Nor does the time calls wait for the collector: a loop that ticks on time can still be behind
    its calls (a process at a low priority on a saturated machine decodes a batch a second while
    they queue). ``sent(sent_ns, received_ns)``, for every batch the loop takes up, measures how far
    behind: the least wait of a second's batches (one sent just now by a live rank waited only for
    the collector; an old one replayed is stamped when sent again). While that exceeds ``stale_ns``
    every rank's heartbeats arrive stale and are heard when said, so ``of`` adds the wait to them:
    a rank is silent once it has been quiet for ``silent_after`` beyond how far behind the collector
    is. A second without a batch keeps the last measure (the ranks all gone say nothing about it).

    Nor the time a restarted collector waits for a run's agents to come back: a rank of a run known
    before the start is silent no earlier than ``silent_after`` after the run's first fresh call
    (``sent``: one that waited at most ``stale_ns``; a spool a launcher replays for ranks gone carries
    its old stamps), or, while none has come, after ``REJOIN_S`` more: an agent's call waits up to
    its deadline for a collector that is starting (its lanes, its first passes, at a low priority)
    and the next probe follows within the longest backoff. Seen: eight live ranks came back 36 s
    after the fifth restart in a row, and were named lost from the start.

    Nor the time the collector keeps calls waiting for their answer: an agent whose calls are not
    answered (a slow store, a flush behind a flood of replayed spools) cannot send its heartbeats,
    and one whose call outlives its deadline spools them and probes again. ``answering(received_ns)``
    counts each call until it is answered; ``of`` adds the longest a call has waited so far, or the
    longest answer of the last ``stale_ns``. Seen: calls taken up 13 s late but answered past the
    agents' 30 s deadline, and eight ranks beating all along named lost.

    A rank whose last word (its end) has arrived is never silent: the store may hold its end only
    at the writer's next flush, seconds after the rank stopped talking, and a lost rank is one
    that went silent *without* a last word.
    """

    def __init__(self, stale_ns: int, tick_s: float = 1.0, started_ns: int | None = None,
                 cpu_wait: Callable[[], int | None] = cpu_wait_ns) -> None:  # fmt: skip
        self.stale_ns = stale_ns
        self._heard: dict[tuple[str, int], dict[int, int]] = {}
        self._ended: dict[tuple[str, int], set[int]] = {}  # (run, attempt) -> ranks whose end arrived
        self._tick_ns = int(tick_s * 1e9)
        self._ticked_ns: int | None = None  # monotonic: the loop's last tick
        self._deaf_ns = 0  # the stalls so far; heard times are kept less the stalls before them
        self._cpu_wait = cpu_wait
        self._waited_ns: int | None = None  # the loop's thread's wait for a CPU at its last tick (None: not known)
        self._said_starved_ns = -(10**12)  # monotonic: when a starved loop was last said (once a minute at most)
        self._deaf_for_ns = 0  # how long the collector has been deaf without a break, by its ticks
        self._rejoin_ns = 0  # wall clock: when the last deafness of over LONG_DEAF_S ended (0: none)
        self._started_ns = time.time_ns() if started_ns is None else started_ns  # when the collector began to listen
        self._behind_ns = 0  # how long the calls of the last second with any waited for the loop (their least)
        self._second: tuple[int, int] = (0, 0)  # (the second in progress, its least wait so far)
        self._back: dict[str, int] = {}  # run -> when its first fresh call since the start arrived
        self._open: dict[int, int] = {}  # calls not answered yet -> when they arrived
        self._answers: dict[int, int] = {}  # second -> the longest answer of the calls answered then
        self._calls = itertools.count()

    def listening(self, now_ns: int | None = None) -> None:
        """The event loop's tick (``now_ns``: monotonic): the time since the last one beyond a tick's
        lateness was time the collector could not listen."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        self._say_starved(now_ns)
        deaf = self._stalled(now_ns)
        self._deaf_ns += deaf
        self._deafness(now_ns, deaf > 0 or self.behind_ns() > 0 or self.kept_waiting_ns() > self.stale_ns)
        self._ticked_ns = now_ns

    def _deafness(self, now_ns: int, deaf: bool) -> None:
        """A tick's interval counted into the deafness without a break, or the end of it: past ``LONG_DEAF_S``,
        the ranks have ``REJOIN_S`` from now to come back."""
        if deaf:
            self._deaf_for_ns += 0 if self._ticked_ns is None else now_ns - self._ticked_ns
            return
        if self._deaf_for_ns > LONG_DEAF_S * 1e9:
            self._rejoin_ns = time.time_ns()
            log.warning("rankscope collector: it could not listen for %.0f s; a rank silent since is judged so only %.0f s "
                        "from now (its agent's call may have failed: it comes back by its next probe)", self._deaf_for_ns / 1e9, REJOIN_S)  # fmt: skip
        self._deaf_for_ns = 0

    def _say_starved(self, now_ns: int) -> None:
        """Say (once a minute at most) that the loop waited for a CPU most of the time since its last tick."""
        was, self._waited_ns = self._waited_ns, self._cpu_wait()
        if was is None or self._waited_ns is None or self._ticked_ns is None:
            return
        waited = self._waited_ns - was
        if 2 * waited > now_ns - self._ticked_ns and now_ns - self._said_starved_ns > 60 * 10**9:
            self._said_starved_ns = now_ns
            log.warning("rankscope collector: its event loop waited %.1f s of the last %.1f s for a CPU (short of CPU? see "
                        "--nice): a rank's silence is judged by how late its calls are taken up", waited / 1e9, (now_ns - self._ticked_ns) / 1e9)  # fmt: skip

    def sent(self, sent_ns: int, received_ns: int, run_id: str = "") -> None:
        """A batch of ``run_id`` sent at ``sent_ns`` (this collector's clock; 0: the sender did not say)
        is taken up at ``received_ns``."""
        if sent_ns <= 0:
            return
        second, least = self._second
        waited = max(0, received_ns - sent_ns)
        if run_id and waited <= self.stale_ns:
            self._back.setdefault(run_id, received_ns)
        if received_ns // 10**9 != second:
            if second:
                self._took_up(least)
            self._second = (received_ns // 10**9, waited)
        elif waited < least:
            self._second = (second, waited)

    def answering(self, received_ns: int) -> Callable[[], None]:
        """A call that arrived at ``received_ns``, kept waiting until the callable says it was answered."""
        call = next(self._calls)
        self._open[call] = received_ns

        def answered() -> None:
            now = time.time_ns()
            took = now - self._open.pop(call, now)
            second = now // 10**9
            self._answers[second] = max(took, self._answers.get(second, 0))
            for old in [s for s in self._answers if s < second - self.stale_ns // 10**9]:
                del self._answers[old]

        return answered

    def kept_waiting_ns(self, now_ns: int | None = None) -> int:
        """How long the collector keeps calls waiting: its oldest open call's wait, or the longest answer
        of the last ``stale_ns`` (wall clock ``now_ns``), whichever is longer."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        oldest = min(list(self._open.values()), default=now_ns)
        recent = [took for second, took in list(self._answers.items()) if second >= (now_ns - self.stale_ns) // 10**9]
        return max(now_ns - oldest, max(recent, default=0))

    def _took_up(self, waited_ns: int) -> None:
        """A second's least wait becomes the measure; crossing ``stale_ns`` either way is said once."""
        was, self._behind_ns = self.behind_ns(), waited_ns
        if not was and self.behind_ns():
            log.warning("rankscope collector: calls wait %.1f s for this collector (short of CPU?): a rank is judged silent "
                        "that much later while it lasts", waited_ns / 1e9)  # fmt: skip
        elif was and not self.behind_ns():
            log.warning("rankscope collector: calls are taken up on time again (%.1f s)", waited_ns / 1e9)

    @property
    def waited_s(self) -> float:
        """The last measure of how long calls wait for this collector (the metric)."""
        return self._behind_ns / 1e9

    def behind_ns(self) -> int:
        """How long calls wait for this collector now, counted when beyond ``stale_ns`` (0 otherwise)."""
        return self._behind_ns if self._behind_ns > self.stale_ns else 0

    def _stalled(self, now_ns: int) -> int:
        if self._ticked_ns is None:
            return 0
        late = now_ns - self._ticked_ns - self._tick_ns
        return late if late > self._tick_ns else 0

    def note(self, decoded: Decoded, received_ns: int, answered_ns: int | None = None) -> None:
        """Every rank with a heartbeat or a registration in ``decoded`` is heard, each by its own newest
        (a rank registers seconds before its first heartbeat: a pass between the two must not judge it
        from the collector's start); every rank with an end in it has said its last word.

        ``answered_ns``: noted again once the batch is answered, a writer that kept the sender waiting
        (its store slow, its flush far) kept it from talking: heard until the answer, not the arrival.
        """
        ends = decoded.parts.get("exits")
        if ends is not None and ends.num_rows:
            run_id = ends["run_id"][0].as_py()
            for rank, attempt in zip(ends["rank"].to_pylist(), ends["attempt"].to_pylist()):
                self._ended.setdefault((run_id, attempt), set()).add(rank)
        for table, said_at in (("heartbeats", "time"), ("ranks", "registered")):
            rows = decoded.parts.get(table)
            if rows is not None and rows.num_rows:
                self._hear(rows, rows[said_at].cast(pa.int64()).to_numpy(), received_ns, answered_ns or received_ns)

    def _hear(self, rows: pa.Table, said_ns: np.ndarray, received_ns: int, answered_ns: int) -> None:
        """Each row's rank heard at ``answered_ns``, or when it spoke (``said_ns``) if that was older than
        ``stale_ns`` on arrival."""
        run_id = rows["run_id"][0].as_py()
        heard = np.where(received_ns - said_ns <= self.stale_ns, answered_ns, said_ns) - self._deaf_ns
        attempts = rows["attempt"].to_numpy()
        for attempt in np.unique(attempts).tolist():
            mine = attempts == attempt
            ranks = self._heard.setdefault((run_id, attempt), {})
            for rank, at in zip(rows["rank"].to_numpy()[mine].tolist(), heard[mine].tolist()):
                if at > ranks.get(rank, 0):
                    ranks[rank] = at

    def of(self, run_id: str, attempt: int, ranks: Iterable[int] = (), now_ns: int | None = None) -> dict[int, int]:
        """rank -> when it was last heard (ns, collector clock), for one attempt of a run and at least
        ``ranks`` (its registered ranks), none before the run's agents could be back (see the class: after
        the collector's start, or a long deafness), moved later by the stalls since (``now_ns``: monotonic,
        for the stall in progress)."""
        deaf = self._deaf_ns + self._stalled(time.monotonic_ns() if now_ns is None else now_ns) + self.behind_ns() + self.kept_waiting_ns()
        heard = {**dict.fromkeys(ranks, 0), **self._heard.get((run_id, attempt), {})}
        ended, now = self._ended.get((run_id, attempt), ()), time.time_ns()
        back = self._back.get(run_id, self._started_ns + int(REJOIN_S * 1e9))
        rejoin = self._rejoin_ns + int(REJOIN_S * 1e9) if self._rejoin_ns else 0
        return {rank: now if rank in ended else max(max(at, back) + deaf, rejoin) for rank, at in heard.items()}

    def forget(self, run_id: str) -> None:
        """Drop every rank of ``run_id``: the diagnosis has let the run go."""
        self._heard = {key: ranks for key, ranks in self._heard.items() if key[0] != run_id}
        self._ended = {key: ranks for key, ranks in self._ended.items() if key[0] != run_id}
        self._back.pop(run_id, None)
