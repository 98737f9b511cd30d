"""Host and GPU metrics as OpenTelemetry observable instruments, sent as MetricBatch payloads.

The instruments are OpenTelemetry's (an SDK ``MeterProvider`` of our own, never the global
one, so a job's own OpenTelemetry set-up is untouched); its periodic reader calls their
callbacks every ``interval_s`` and hands the data points to ``BatchExporter``, which packs them
into one columnar MetricBatch and submits it through the rank's Transport.

Every rank reports its own GPU (the device CUDA numbers LOCAL_RANK); only local rank 0 of each
host reports the host, so eight ranks on a machine do not report its CPU eight times. A row's
``device`` is the point's ``hw.id`` ("cuda:0") or ``network.interface.name`` ("eth0"), else
"host"; any other attribute's value is appended to the name after a dot
(``network.io.direction=receive`` gives ``system.network.io.receive``). Names follow OpenTelemetry's semantic
conventions where they exist; the ones marked * have none and are rankscope's own.

name (unit): meaning
  system.cpu.utilization (1): busy fraction of all CPUs since the previous export
  system.memory.usage (By): MemTotal - MemAvailable
  system.memory.limit (By): MemTotal
  system.memory.utilization (1): usage / limit
  system.network.io.{receive,transmit} (By): per interface, cumulative since boot
  system.network.packets.{receive,transmit} ({packet}): likewise
  system.network.errors.{receive,transmit} ({error}): likewise
  system.network.packet.dropped.{receive,transmit} ({packet}): likewise
  hw.gpu.utilization (1): compute busy fraction
  hw.gpu.memory.utilization (1): memory controller busy fraction
  hw.gpu.memory.usage, hw.gpu.memory.limit (By): used and total device memory
  hw.temperature (Cel): GPU core temperature
  hw.power (W): board power draw
  hw.gpu.clock.sm * (Hz): SM clock
  hw.gpu.throttle_reasons * (1): NVML's throttle reason bitmask (gpu.THROTTLE_REASONS)
  hw.gpu.throttle.<reason> * (1): 1 while that reason throttles the clocks, else 0
  hw.errors.ecc_corrected, hw.errors.ecc_uncorrected ({error}): since the driver loaded
  hw.gpu.xid.<code> * ({event}): Xid events of that code since the agent started
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData, PeriodicExportingMetricReader

from rankscope.agent.config import warn_once
from rankscope.agent.hardware import THROTTLE_REASONS, CpuSampler, GpuDevice, host_memory, network_counters, open_gpu
from rankscope.agent.transport import Transport
from rankscope.protos.v1 import telemetry_pb2

__all__ = ["BatchExporter", "MetricsReporter", "to_metric_batch"]

DEVICE_KEYS = ("hw.id", "network.interface.name")

Read = Callable[[], Iterable[Observation]]


class MetricsReporter:
    """This rank's metrics, exported through ``transport`` every ``interval_s`` once started."""

    def __init__(self, transport: Transport, *, local_rank: int, interval_s: float = 5.0) -> None:
        self.transport = transport
        self.local_rank = local_rank
        self.interval_s = interval_s
        self.gpu: GpuDevice | None = None
        self._provider: MeterProvider | None = None

    def start(self) -> None:
        """Create the instruments (host on local rank 0, GPU where NVML finds one) and the reader."""
        self.gpu = open_gpu(self.local_rank)
        if self.gpu is None and self.local_rank != 0:
            return  # nothing to report
        reader = PeriodicExportingMetricReader(BatchExporter(self.transport), export_interval_millis=self.interval_s * 1000)
        self._provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
        meter = self._provider.get_meter("rankscope.agent")
        if self.local_rank == 0:
            _host_instruments(meter)
        if self.gpu is not None:
            _gpu_instruments(meter, self.gpu)

    def stop(self) -> None:
        """Export one last time and release NVML; call before closing the Transport."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None


class BatchExporter(MetricExporter):
    """OpenTelemetry data points -> one MetricBatch per export, submitted to a Transport."""

    def __init__(self, transport: Transport) -> None:
        super().__init__()
        self.transport = transport

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        batch = to_metric_batch(metrics_data)
        if batch is not None and not self.transport.submit(batch):
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None


def to_metric_batch(metrics_data: MetricsData) -> telemetry_pb2.MetricBatch | None:
    """The data points as a columnar MetricBatch (see the module doc for names and devices)."""
    strings: dict[str, int] = {}
    times: list[int] = []
    names: list[int] = []
    devices: list[int] = []
    values: list[float] = []
    for resource in metrics_data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:  # type: ignore[union-attr]
                    attributes = dict(point.attributes or {})
                    device = next((str(attributes.pop(k)) for k in DEVICE_KEYS if k in attributes), "host")
                    name = ".".join([metric.name, *(str(attributes[k]) for k in sorted(attributes))])
                    times.append(point.time_unix_nano)
                    names.append(strings.setdefault(name, len(strings)))
                    devices.append(strings.setdefault(device, len(strings)))
                    values.append(float(point.value))  # type: ignore[union-attr]
    if not times:
        return None
    return telemetry_pb2.MetricBatch(
        count=len(times),
        strings=list(strings),
        time_ns=np.asarray(times, "<i8").tobytes(),
        name=np.asarray(names, "<i4").tobytes(),
        device=np.asarray(devices, "<i4").tobytes(),
        value=np.asarray(values, "<f8").tobytes(),
    )


# --- instruments ----------------------------------------------------------------------------------


def _host_instruments(meter: Meter) -> None:
    cpu = CpuSampler()

    def cpu_busy() -> Iterable[Observation]:
        busy = cpu.utilization()
        return [] if busy is None else [Observation(busy)]

    def memory(pick: Callable[[int, int], float]) -> Read:
        return lambda: [Observation(pick(*host_memory()))]

    _gauge(meter, "system.cpu.utilization", "1", cpu_busy)
    _gauge(meter, "system.memory.usage", "By", memory(lambda used, total: used))
    _gauge(meter, "system.memory.limit", "By", memory(lambda used, total: total))
    _gauge(meter, "system.memory.utilization", "1", memory(lambda used, total: used / total))
    for name, unit, rx, tx in (
        ("system.network.io", "By", "rx_bytes", "tx_bytes"),
        ("system.network.packets", "{packet}", "rx_packets", "tx_packets"),
        ("system.network.errors", "{error}", "rx_errors", "tx_errors"),
        ("system.network.packet.dropped", "{packet}", "rx_dropped", "tx_dropped"),
    ):
        _counter(meter, name, unit, _nic_reader(rx, tx))


def _nic_reader(rx: str, tx: str) -> Read:
    def read() -> Iterable[Observation]:
        for interface, c in network_counters().items():
            yield Observation(getattr(c, rx), {"network.interface.name": interface, "network.io.direction": "receive"})
            yield Observation(getattr(c, tx), {"network.interface.name": interface, "network.io.direction": "transmit"})

    return read


def _gpu_instruments(meter: Meter, gpu: GpuDevice) -> None:
    device = {"hw.id": gpu.label}

    def one(read: Callable[[], float]) -> Read:
        return lambda: [Observation(read(), device)]

    def throttle() -> Iterable[Observation]:
        mask = gpu.throttle_reasons()
        return [Observation(1 if mask & bit else 0, {**device, "reason": name}) for name, bit in THROTTLE_REASONS.items()]

    def ecc() -> Iterable[Observation]:
        corrected, uncorrected = gpu.ecc_errors()
        return [Observation(corrected, {**device, "error.type": "ecc_corrected"}), Observation(uncorrected, {**device, "error.type": "ecc_uncorrected"})]

    def xid() -> Iterable[Observation]:
        return [Observation(n, {**device, "code": code}) for code, n in sorted(gpu.poll_xid().items())]

    _gauge(meter, "hw.gpu.utilization", "1", one(lambda: gpu.utilization()[0]))
    _gauge(meter, "hw.gpu.memory.utilization", "1", one(lambda: gpu.utilization()[1]))
    _gauge(meter, "hw.gpu.memory.usage", "By", one(lambda: gpu.memory()[0]))
    _gauge(meter, "hw.gpu.memory.limit", "By", one(lambda: gpu.memory()[1]))
    _gauge(meter, "hw.temperature", "Cel", one(gpu.temperature_c))
    _gauge(meter, "hw.power", "W", one(gpu.power_w))
    _gauge(meter, "hw.gpu.clock.sm", "Hz", one(gpu.sm_clock_hz))
    _gauge(meter, "hw.gpu.throttle_reasons", "1", one(gpu.throttle_reasons))
    _gauge(meter, "hw.gpu.throttle", "1", throttle)
    _counter(meter, "hw.errors", "{error}", ecc)
    _counter(meter, "hw.gpu.xid", "{event}", xid)


def _gauge(meter: Meter, name: str, unit: str, read: Read) -> None:
    meter.create_observable_gauge(name, callbacks=[_guarded(name, read)], unit=unit)


def _counter(meter: Meter, name: str, unit: str, read: Read) -> None:
    meter.create_observable_counter(name, callbacks=[_guarded(name, read)], unit=unit)


def _guarded(name: str, read: Read) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """A callback that never raises: the SDK would log a traceback every interval."""

    def callback(options: CallbackOptions) -> Iterable[Observation]:
        try:
            return list(read())
        except Exception as exc:  # noqa: BLE001 - e.g. NVMLError_NotSupported on this GPU
            warn_once(f"metric:{name}", f"metric {name} is not available here ({exc!r})")
            return []

    return callback
