"""OpenTelemetry spans the script creates itself, recorded as ``user`` spans on the agent's timeline.

A span processor on the script's SDK ``TracerProvider`` hands every ended span to the recorder
(its start and end are wall-clock ns, like the agent's CPU clock). When the script has set no
provider, the agent installs an SDK provider carrying only this processor, so spans created
through the plain OpenTelemetry API are recorded. If the script sets its own provider later
(through ``opentelemetry.trace.set_tracer_provider``), the processor joins it and the agent's
provider steps aside: OpenTelemetry would otherwise refuse the second provider.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

from rankscope.agent.config import warn_once
from rankscope.agent.recorder import Recorder
from rankscope.protos.v1 import telemetry_pb2 as pb


class RecordingProcessor(SpanProcessor):
    """Records ended spans while ``active``; OpenTelemetry calls it on the ending thread."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.active = True

    def on_end(self, span: ReadableSpan) -> None:
        if not self.active or span.start_time is None or span.end_time is None:
            return
        try:
            rec = self.rec
            attrs = rec.attributes(dict(span.attributes or {}))
            rec.add_span(rec.strings.id(span.name), pb.SPAN_KIND_USER, rec.state.step, -1, span.start_time, span.end_time, attrs)
        except Exception as exc:  # noqa: BLE001 - never fail the script's span
            warn_once("otel", f"an OpenTelemetry span could not be recorded ({exc!r})")

    def shutdown(self) -> None:
        self.active = False

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def install(rec: Recorder) -> Callable[[], None]:
    """Start recording the script's OpenTelemetry spans; returns the function that stops it."""
    processor = RecordingProcessor(rec)
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.add_span_processor(processor)
        ours = None
    else:
        ours = TracerProvider()
        ours.add_span_processor(processor)
        trace.set_tracer_provider(ours)
    original = trace.set_tracer_provider

    def set_tracer_provider(tracer_provider: Any) -> None:
        if isinstance(tracer_provider, TracerProvider) and processor.active:
            tracer_provider.add_span_processor(processor)
        if ours is not None and trace.get_tracer_provider() is ours:
            _release_global_provider()
        original(tracer_provider)

    trace.set_tracer_provider = set_tracer_provider

    def uninstall() -> None:
        processor.shutdown()
        if trace.set_tracer_provider is set_tracer_provider:
            trace.set_tracer_provider = original

    return uninstall


def _release_global_provider() -> None:
    """Let the script's provider replace the agent's (OpenTelemetry's private set-once guard)."""
    try:
        from opentelemetry.util._once import Once

        if not hasattr(trace, "_TRACER_PROVIDER_SET_ONCE"):
            raise AttributeError("opentelemetry.trace._TRACER_PROVIDER_SET_ONCE")
        trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
        trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - then OpenTelemetry keeps the agent's provider
        warn_once("otel-provider", f"could not hand the global TracerProvider over ({exc!r})")
