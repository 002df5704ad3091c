"""Tracing: spans reach an OTLP/HTTP collector in the caller's trace, and nothing happens
without the OTEL_* variables."""

import asyncio
import gzip
import time

import pytest
import structlog
from aiohttp import web
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from northmk.tracing import (
    COMPLETION_TOKENS, PROMPT_TOKENS, REQUEST_ID, TTFT_S, GenerationTiming, Tracing, add_trace_ids,
    configure_tracing, tracing_requested,
)

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"}
ALL_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME",
            "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED", "OTEL_RESOURCE_ATTRIBUTES")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ALL_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
async def collector(aiohttp_server):
    """A minimal OTLP/HTTP trace collector on a loopback port: decoded export requests."""
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def export(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        message = trace_service_pb2.ExportTraceServiceRequest()
        message.ParseFromString(body)
        received.append(message)
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    server = await aiohttp_server(app)
    server.received = received
    server.endpoint = f"http://127.0.0.1:{server.port}"
    return server


def spans_of(received):
    """name -> (span, service name) over every export request."""
    spans = {}
    for message in received:
        for resource_spans in message.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans[span.name] = (span, service)
    return spans


def attributes(span):
    out = {}
    for a in span.attributes:
        value = a.value
        out[a.key] = getattr(value, value.WhichOneof("value"))
    return out


async def traced_request(tracing: Tracing, headers=TRACEPARENT):
    """What a handler does: a request span around the generation, engine phases at the end."""
    now = time.monotonic()
    timing = GenerationTiming("chatcmpl-1", arrival=now - 0.5, scheduled=now - 0.4, first_token=now - 0.3,
                              finished=now, num_prompt_tokens=12, num_cached_tokens=4, num_completion_tokens=7,
                              finish_reason="stop")
    with tracing.request_span("POST /v1/chat/completions", headers, {"http.request.method": "POST"}) as span:
        tracing.record_generation(span, timing)
    await asyncio.to_thread(tracing.shutdown)  # the exporter posts to this loop's collector


async def test_spans_reach_the_collector_in_the_callers_trace(collector, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "northmk-test")
    tracing = configure_tracing()
    assert tracing.enabled
    await traced_request(tracing)
    spans = spans_of(collector.received)
    assert set(spans) == {"POST /v1/chat/completions", "queue", "prefill", "decode"}
    assert {service for _, service in spans.values()} == {"northmk-test"}
    assert {span.trace_id.hex() for span, _ in spans.values()} == {CALLER_TRACE_ID}
    request, _ = spans["POST /v1/chat/completions"]
    assert request.parent_span_id.hex() == CALLER_SPAN_ID
    assert request.kind == request.SPAN_KIND_SERVER
    for phase in ("queue", "prefill", "decode"):
        assert spans[phase][0].parent_span_id == request.span_id
        assert attributes(spans[phase][0])[REQUEST_ID] == "chatcmpl-1"
    queue, prefill, decode = (spans[p][0] for p in ("queue", "prefill", "decode"))
    assert queue.end_time_unix_nano <= prefill.start_time_unix_nano + 1000
    assert prefill.end_time_unix_nano <= decode.start_time_unix_nano + 1000
    assert abs((decode.end_time_unix_nano - queue.start_time_unix_nano) / 1e9 - 0.5) < 0.05
    assert attributes(prefill)[PROMPT_TOKENS] == 12
    assert attributes(prefill)[TTFT_S] == pytest.approx(0.2)
    assert attributes(decode)[COMPLETION_TOKENS] == 7
    assert attributes(request)[COMPLETION_TOKENS] == 7


async def test_without_a_traceparent_a_new_trace_starts(collector, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", collector.endpoint + "/v1/traces")
    await traced_request(configure_tracing(), headers={})
    spans = spans_of(collector.received)
    request, service = spans["POST /v1/chat/completions"]
    assert service == "northmk"  # the default service name
    assert request.parent_span_id == b"" and request.trace_id.hex() != CALLER_TRACE_ID


async def test_the_sampler_comes_from_the_environment(collector, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    await traced_request(configure_tracing())
    assert spans_of(collector.received) == {}


@pytest.mark.parametrize("env", [{}, {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "{endpoint}"}])
async def test_without_the_variables_tracing_is_off_and_free(collector, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(endpoint=collector.endpoint))
    provider_before = trace.get_tracer_provider()
    tracing = configure_tracing()
    assert not tracing.enabled and tracing.provider is None
    assert isinstance(tracing.tracer, trace.NoOpTracer)
    with tracing.request_span("POST /v1/chat/completions", TRACEPARENT) as span:
        assert not span.is_recording()
        assert add_trace_ids(None, "info", {"event": "x"}) == {"event": "x"}
    await traced_request(tracing)
    assert trace.get_tracer_provider() is provider_before
    assert collector.received == []


def test_the_switches_are_the_standard_variables():
    assert not tracing_requested({})
    assert not tracing_requested({"OTEL_EXPORTER_OTLP_HEADERS": "a=b"})
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME",
                 "OTEL_TRACES_SAMPLER"):
        assert tracing_requested({name: "x"})
        assert not tracing_requested({name: "x", "OTEL_SDK_DISABLED": "TRUE"})


async def test_log_lines_carry_the_current_trace_and_span_ids(collector, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    tracing = configure_tracing()
    lines = []
    structlog.configure(processors=[add_trace_ids, lambda _l, _m, event: lines.append(event) or ""],
                        logger_factory=structlog.ReturnLoggerFactory())
    try:
        with tracing.request_span("GET /health", TRACEPARENT) as span:
            structlog.get_logger().info("inside")
        structlog.get_logger().info("outside")
    finally:
        structlog.reset_defaults()
    await asyncio.to_thread(tracing.shutdown)
    inside, outside = lines
    assert inside["trace_id"] == CALLER_TRACE_ID
    assert inside["span_id"] == format(span.get_span_context().span_id, "016x")
    assert "trace_id" not in outside and "span_id" not in outside
