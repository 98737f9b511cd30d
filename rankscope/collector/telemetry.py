"""The collector's own health as Prometheus metrics (``rankscope collector --metrics-port``).

What an operator needs to see before the agents notice anything: rows coming in and going out
per table, duplicates (agents retrying), insert latency, buffer depth (how close the collector
is to refusing batches), refused calls by status code, how many ranks are sending, and how far
behind the collector is: how long a batch took from its agent's send to the collector's receipt,
and from there to being stored (a hang is named only once the blocked ranks' reports are stored). The
metrics live in their own registry, so several collectors in one process (tests) never clash.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rankscope.collector.writer import Writer

#: a rank counts as connected while its last batch is younger than this
CONNECTED_WINDOW_S = 30.0

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: a batch's way to the store: a lagging collector is tens of seconds behind
_DELAY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _WriterCollector(Collector):
    """Reads the writer's own counters at scrape time (the writer keeps them as plain ints)."""

    def __init__(self, writer: Writer):
        self.writer = writer

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        written = CounterMetricFamily("rankscope_rows_written", "Rows inserted into the store, per table.", labels=["table"])
        for table, rows in sorted(self.writer.rows_written.items()):
            written.add_metric([table], rows)
        yield written
        yield CounterMetricFamily("rankscope_batches_written", "Batches stored and acknowledged.", value=self.writer.batches_written)
        yield CounterMetricFamily(
            "rankscope_batches_failed", "Batches the store could not take (answered UNAVAILABLE).", value=self.writer.batches_failed
        )
        yield CounterMetricFamily(
            "rankscope_duplicate_batches", "Batches acknowledged without writing: their id was already stored.", value=self.writer.duplicates
        )
        yield GaugeMetricFamily("rankscope_buffered_rows", "Rows accepted and not yet stored.", value=self.writer.buffered_rows)


class Telemetry:
    """The collector's metrics; ``serve(port)`` exposes them over HTTP for Prometheus."""

    def __init__(self, writer: Writer, clock: Callable[[], float] = time.monotonic):
        self.registry = CollectorRegistry()
        self._writer = writer
        self._clock = clock
        self._last_seen: dict[tuple[str, int], float] = {}
        self._pruned = clock()
        self.rows_received = Counter(
            "rankscope_rows_received", "Rows decoded from agent batches, per table.", ["table"], registry=self.registry
        )
        self.batches_received = Counter(
            "rankscope_batches_received", "Batches decoded, per payload kind.", ["kind"], registry=self.registry
        )
        self.rejected = Counter(
            "rankscope_rejected_calls", "Calls answered with an error, per gRPC status code.", ["code"], registry=self.registry
        )
        self.refused = Counter(
            "rankscope_refused_batches",
            "Batches refused as malformed or untrue, nothing of them kept, per reason: count (declared counts or lengths the "
            "bytes do not hold), length (ids and texts), range (integers, enums, string indices), time (outside the window), "
            "ended (dated after their run's end), order (ends before starts), rank (outside the world), unregistered (rows of a run no rank registered), malformed.",
            ["reason"], registry=self.registry,
        )  # fmt: skip
        self.insert_seconds = Histogram(
            "rankscope_insert_seconds", "Duration of one insert into the store, per table.", ["table"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.delivery_seconds = self._per_kind(
            "rankscope_delivery_seconds",
            "From an agent's send of a batch to the collector's receipt, per payload kind (the agent's clock corrected by the "
            "offset it stamps): the network and the calls queued in the collector.",
        )
        self.store_seconds = self._per_kind(
            "rankscope_store_seconds",
            "From the collector's receipt of a batch to its being stored and acknowledged, per payload kind: a timeline's "
            "turn to be decoded, the wait for the writer's flush and the insert.",
        )
        self.diagnosis_seconds = Histogram(
            "rankscope_diagnosis_pass_seconds",
            "Duration of one live diagnosis pass over the active runs, per lane (urgent: hangs and crashes; thorough: the "
            "rest): a fault is named up to two passes of its lane after its evidence is stored (a long pass is followed by as "
            "long a rest).",
            ["lane"], buckets=(*_LATENCY_BUCKETS, 30.0, 60.0), registry=self.registry,
        )  # fmt: skip
        self.detector_seconds = Histogram(
            "rankscope_detector_seconds", "Duration of one detector in a live diagnosis pass over one run, per detector.",
            ["detector"], buckets=(*_LATENCY_BUCKETS, 30.0, 60.0), registry=self.registry,
        )  # fmt: skip
        self.diagnosis_restarts = Counter(
            "rankscope_diagnosis_restarts_total", "Live diagnosis lane processes started again after they exited, per lane.",
            ["lane"], registry=self.registry,
        )  # fmt: skip
        self.calls_wait = Gauge(
            "rankscope_calls_wait_seconds", "How long calls waited for the collector to take them up (the least of a second's), "
            "from the sender's stamp: beyond --silent-after, silence is judged that much later.", registry=self.registry,
        )  # fmt: skip
        connected = Gauge(
            "rankscope_connected_ranks", f"Distinct (run, rank) that sent a batch in the last {CONNECTED_WINDOW_S:.0f} s.",
            registry=self.registry,
        )
        connected.set_function(self.connected_ranks)
        self.registry.register(_WriterCollector(writer))
        self._http: object | None = None

    def _per_kind(self, name: str, documentation: str) -> Histogram:
        """A histogram of seconds on a batch's way to the store, labelled by payload kind."""
        return Histogram(name, documentation, ["kind"], buckets=_DELAY_BUCKETS, registry=self.registry)

    def delivered(self, kind: str, sent_ns: int, received_ns: int, stored_ns: int) -> None:
        """One batch stored: ``sent_ns`` on the collector's clock (0: the agent did not say)."""
        if sent_ns > 0:
            self.delivery_seconds.labels(kind).observe(max(0.0, (received_ns - sent_ns) / 1e9))
        self.store_seconds.labels(kind).observe(max(0.0, (stored_ns - received_ns) / 1e9))

    def diagnosed(self, lane: str, seconds: float) -> None:
        """One live diagnosis pass of ``lane`` (called from the thread that serves the lane's process)."""
        self.diagnosis_seconds.labels(lane).observe(seconds)

    def detected(self, detector: str, seconds: float) -> None:
        """One detector's pass over one run (called from the thread that serves its lane's process)."""
        self.detector_seconds.labels(detector).observe(seconds)

    def restarted(self, lane: str) -> None:
        """The process of a live diagnosis lane exited and is started again."""
        self.diagnosis_restarts.labels(lane).inc()

    def seen(self, run_id: str, ranks: Iterable[int]) -> None:
        """A batch of ``run_id`` spoke for ``ranks`` now."""
        now = self._clock()
        self._last_seen.update({(run_id, rank): now for rank in ranks})

    def connected_ranks(self) -> int:
        horizon = self._clock() - CONNECTED_WINDOW_S
        # A copy: scrapes run on the HTTP server's thread while the event loop adds ranks.
        return sum(1 for t in list(self._last_seen.values()) if t >= horizon)

    def tick(self) -> None:
        """Once a second, on the event loop: insert durations into the histogram; once a window, old
        ranks out (at 100,000 ranks a copy of the table every second cost the loop 8% of its time)."""
        for table, samples in self._writer.take_insert_latencies().items():
            for seconds in samples:
                self.insert_seconds.labels(table).observe(seconds)
        now = self._clock()
        if now - self._pruned >= CONNECTED_WINDOW_S:
            self._pruned = now
            self._last_seen = {key: t for key, t in self._last_seen.items() if t >= now - CONNECTED_WINDOW_S}

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the port (0 picks one)."""
        server, _thread = start_http_server(port, host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()  # type: ignore[attr-defined]
            self._http.server_close()  # type: ignore[attr-defined]
            self._http = None
