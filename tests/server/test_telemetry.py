"""Logs are one JSON object per line and carry the bound request id (and the trace's ids);
a traced request is one server span over its queue, prefill and decode spans."""

import io
import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from northmk import telemetry
from northmk.server.state import TRACING
from northmk.tracing import Tracing


@pytest.fixture
def log_stream():
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    telemetry.configure(log_level="info", json_logs=True, stream=stream)
    yield stream
    telemetry.unbind_request()
    root.handlers[:], _ = saved
    root.setLevel(saved[1])


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_structlog_lines_are_json_with_the_request_id(log_stream):
    telemetry.bind_request("req-42")
    telemetry.get_logger("northmk.test").info("hello", tokens=3)
    telemetry.unbind_request()
    telemetry.get_logger("northmk.test").info("after")
    first, second = lines(log_stream)
    assert first["event"] == "hello" and first["request_id"] == "req-42" and first["tokens"] == 3
    assert first["level"] == "info" and first["logger"] == "northmk.test" and "timestamp" in first
    assert "request_id" not in second


def test_standard_library_loggers_share_the_format_and_level(log_stream):
    telemetry.bind_request("abc")
    logging.getLogger("aiohttp.server").warning("plain %s", "logging")
    logging.getLogger("aiohttp.server").debug("hidden at info")
    (line,) = lines(log_stream)
    assert line["event"] == "plain logging" and line["request_id"] == "abc" and line["level"] == "warning"


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="log level"):
        telemetry.configure_logging("loud")


# ---- tracing through the app --------------------------------------------------------------
CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = {"traceparent": f"00-{CALLER_TRACE_ID}-00f067aa0ba902b7-01"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


@pytest.fixture
async def traced_client(make_client, exporter):
    provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)  # root spans too, whatever the environment
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return await make_client(tracing=Tracing(provider))


async def test_a_streamed_request_is_one_server_span_over_its_queue_prefill_and_decode(traced_client, exporter):
    response = await traced_client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=TRACEPARENT)
    await response.read()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "queue", "prefill", "decode"}
    request = spans["POST /v1/chat/completions"]
    assert format(request.context.trace_id, "032x") == CALLER_TRACE_ID
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["northmk.request_id"] == response.headers["X-Request-Id"]
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert all(s.parent.span_id == request.context.span_id for s in (queue, prefill, decode))
    assert request.start_time <= queue.start_time <= queue.end_time <= prefill.start_time
    assert prefill.end_time <= decode.start_time <= decode.end_time <= request.end_time
    assert decode.attributes["gen_ai.usage.output_tokens"] == 3 and prefill.attributes["gen_ai.usage.input_tokens"]


async def test_errors_and_completions_are_traced_too(traced_client, exporter):
    assert (await traced_client.post("/v1/chat/completions", json={"messages": []})).status == 400
    [refused] = exporter.get_finished_spans()  # no engine phases: it never reached the engine
    assert refused.attributes["http.response.status_code"] == 400
    exporter.clear()
    assert (await traced_client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})).status == 200
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["POST /v1/completions", *["decode"] * 2, *["prefill"] * 2, *["queue"] * 2]  # per prompt


async def test_without_tracing_the_app_makes_no_spans(client, exporter):
    assert not client.server.app[TRACING].enabled
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=TRACEPARENT)).status == 200
    assert exporter.get_finished_spans() == ()


async def test_log_lines_of_a_traced_request_carry_its_trace_id(traced_client, log_stream):
    assert (await traced_client.get("/v1/models", headers=TRACEPARENT)).status == 200
    [access] = [line for line in lines(log_stream) if line["event"] == "request"]
    assert access["trace_id"] == CALLER_TRACE_ID and len(access["span_id"]) == 16
