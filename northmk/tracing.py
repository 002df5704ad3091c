"""OpenTelemetry tracing, configured only through the standard OTEL_* environment variables.

Off unless one of OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
OTEL_SERVICE_NAME or OTEL_TRACES_SAMPLER is set (and OTEL_SDK_DISABLED is not "true").
Off, no SDK provider is built and every function here returns at once with no-op spans.
On, spans go through a batch processor to the OTLP/HTTP exporter, which reads its endpoint,
headers, timeout and compression from the same variables (Jaeger ingests on :4318);
the sampler comes from OTEL_TRACES_SAMPLER(_ARG), the service name from
OTEL_SERVICE_NAME (default "northmk"). The global tracer provider is left alone.

Spans of one chat/completion request (a W3C `traceparent` header continues the caller's
trace):

    POST /v1/chat/completions        (server span, live for the whole response)
      queue    arrival -> scheduled       \
      prefill  scheduled -> first token    } recorded when the request ends,
      decode   first token -> finish      /  from the engine's monotonic timestamps
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

SWITCHES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_TRACES_SAMPLER",
)
DEFAULT_SERVICE_NAME = "northmk"
INSTRUMENTATION_NAME = "northmk"

# Span attribute names (OpenTelemetry's GenAI conventions where they exist).
REQUEST_ID = "gen_ai.request.id"
PROMPT_TOKENS = "gen_ai.usage.input_tokens"
COMPLETION_TOKENS = "gen_ai.usage.output_tokens"
CACHED_TOKENS = "northmk.usage.cached_tokens"
TTFT_S = "northmk.time_to_first_token_s"
FINISH_REASON = "gen_ai.response.finish_reasons"


def tracing_requested(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(name, "").strip() for name in SWITCHES)


class Tracing:
    """The process's tracer: a real one when configured, else OpenTelemetry's no-op tracer."""

    def __init__(self, provider: TracerProvider | None = None):
        self.provider = provider
        self.tracer = provider.get_tracer(INSTRUMENTATION_NAME) if provider else trace.NoOpTracer()

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    @contextlib.contextmanager
    def request_span(self, name: str, headers: Mapping[str, str], attributes: dict[str, Any] | None = None
                     ) -> Iterator[trace.Span]:
        """The server span of one HTTP request, current inside the block (so logs carry its
        ids), continuing the trace of the request's `traceparent` header if any."""
        if not self.enabled:
            yield trace.INVALID_SPAN
            return
        parent = propagate.extract(headers)
        with self.tracer.start_as_current_span(name, context=parent, kind=trace.SpanKind.SERVER,
                                               attributes=attributes) as span:
            yield span

    def record_generation(self, parent: trace.Span, timing: "GenerationTiming") -> None:
        """The queue / prefill / decode spans of one finished generation, under `parent`."""
        if not self.enabled or not parent.get_span_context().is_valid:
            return
        ctx = trace.set_span_in_context(parent)
        common = {REQUEST_ID: timing.request_id}
        parent.set_attributes({**common, **timing.attributes_of("prefill"), **timing.attributes_of("decode")})
        phases = [("queue", timing.arrival, timing.scheduled), ("prefill", timing.scheduled or timing.arrival,
                                                                  timing.first_token),
                  ("decode", timing.first_token, timing.finished)]
        for name, start, end in phases:
            if start is None or end is None:
                continue
            span = self.tracer.start_span(name, context=ctx, start_time=epoch_ns(start),
                                          attributes={**common, **timing.attributes_of(name)})
            span.end(end_time=epoch_ns(max(start, end)))

    def shutdown(self) -> None:
        """Export what is buffered and stop (blocking: network I/O; not on the event loop)."""
        if self.provider is not None:
            self.provider.force_flush()
            self.provider.shutdown()


@dataclass
class GenerationTiming:
    """One request's engine timeline, time.monotonic() seconds (None: the phase did not happen)."""

    request_id: str
    arrival: float
    scheduled: float | None = None  # first prefill step began
    first_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_completion_tokens: int = 0
    finish_reason: str | None = None

    def attributes_of(self, phase: str) -> dict[str, Any]:
        if phase == "prefill":
            attrs: dict[str, Any] = {PROMPT_TOKENS: self.num_prompt_tokens, CACHED_TOKENS: self.num_cached_tokens}
            if self.first_token is not None:
                attrs[TTFT_S] = self.first_token - self.arrival
            return attrs
        if phase == "decode":
            attrs = {COMPLETION_TOKENS: self.num_completion_tokens}
            if self.finish_reason:
                attrs[FINISH_REASON] = (self.finish_reason,)
            return attrs
        return {}


# Wall-clock minus monotonic time, read once: every conversion uses the same offset, so two
# readings that are equal (one span's end, the next one's start) stay equal in the spans.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as nanoseconds since the epoch (what spans carry)."""
    return _EPOCH_OFFSET_NS + round(monotonic_s * 1e9)


def configure_tracing() -> Tracing:
    """Tracing from os.environ; call once at start-up and `shutdown()` it at exit."""
    if not tracing_requested():
        return Tracing()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return Tracing(provider)


def add_trace_ids(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: the current span's trace_id / span_id (hex) on every log line."""
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event.setdefault("trace_id", format(span_context.trace_id, "032x"))
        event.setdefault("span_id", format(span_context.span_id, "016x"))
    return event
