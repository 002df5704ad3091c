"""What a coding agent does, with the official openai SDK against a real `python -m northmk.serve`
process: forced and named tool calls, JSON answers, reasoning apart from content, tool-result
turns; and the process's traces reaching an OTLP/HTTP collector in the caller's trace."""

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from .helpers import (
    DEVICE, PERSON, TIME, TOOL_SCHEMAS, TOOLS, assert_clean, free_port, serve_env, special_texts, wait_healthy,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "north-agents"
SERVICE = "northmk-agents-test"
CALLER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"
USER = {"role": "user", "content": "What is the weather in Paris?"}
FORCED = dict(model=MODEL, messages=[USER], tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=200, seed=5, extra_body={"max_reasoning_tokens": 4})
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP trace collector on a loopback port: (service name, span) as received."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _ExportHandler)
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                found = {s.name: (service, s) for service, s in self.spans if s.trace_id.hex() == trace_id}
            if names <= set(found):
                return found
            time.sleep(0.1)
        raise AssertionError(f"spans {names} of trace {trace_id} did not arrive; got {sorted(found)}")


class _ExportHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        message = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for resource_spans in message.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.server.spans += [(attributes["service.name"], s) for s in scope_spans.spans]
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def collector():
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def sdk(tiny_checkpoint, collector):
    port = free_port()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}",
            "OTEL_SERVICE_NAME": SERVICE, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    env = serve_env(**otel)
    command = [sys.executable, "-m", "northmk.serve", "--model", str(tiny_checkpoint),
               "--device", DEVICE, "--dtype", "float32", "--port", str(port),
               "--served-model-name", MODEL, "--max-model-len", "1024", "--max-batch", "4",
               "--drain-timeout", "1", "--log-level", "warning"]
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def specials(tiny_checkpoint):
    return special_texts(tiny_checkpoint)


def assert_conforms(call):
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_required_tool_choice_gives_a_valid_call_streamed_and_not(sdk, specials):
    reply = sdk.chat.completions.create(**FORCED)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert_conforms(call)
    assert_clean(choice.message.model_extra.get("reasoning_content"), specials)

    names, arguments, ids, finish = [], "", [], None
    for chunk in sdk.chat.completions.create(**FORCED, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            assert delta_call.index == 0
            ids += [delta_call.id] if delta_call.id else []
            names += [delta_call.function.name] if delta_call.function.name else []
            arguments += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and names == [call.function.name] and len(ids) == 1
    assert arguments == call.function.arguments  # the same seed samples the same call


def test_a_named_tool_is_called_with_conforming_arguments(sdk):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = sdk.chat.completions.create(**{**FORCED, "tool_choice": named, "n": 2, "reasoning_effort": "none"})
    for choice in reply.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_a_json_schema_answer_conforms_and_reasoning_has_its_own_field(sdk, specials):
    reply = sdk.chat.completions.create(model=MODEL, messages=[USER], response_format=PERSON_FORMAT, seed=2,
                                        max_tokens=160, extra_body={"max_reasoning_tokens": 5})
    message = reply.choices[0].message
    jsonschema.validate(json.loads(message.content), PERSON)
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and reasoning not in message.content
    assert_clean(reasoning, specials)
    streamed = list(sdk.chat.completions.create(model=MODEL, messages=[USER], response_format=PERSON_FORMAT,
                                                seed=2, max_tokens=160, stream=True,
                                                extra_body={"max_reasoning_tokens": 5}))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(d.content or "" for d in deltas) == message.content
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == reasoning


def test_a_conversation_with_tool_results_round_trips(sdk):
    first = sdk.chat.completions.create(**FORCED).choices[0].message
    turn = [USER, first.model_dump(include={"role", "content", "tool_calls"}),
            {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "22 C and sunny"}]
    second = sdk.chat.completions.create(**{**FORCED, "messages": turn, "seed": 6}).choices[0].message
    [call] = second.tool_calls
    assert call.id != first.tool_calls[0].id
    assert_conforms(call)
    answer = sdk.chat.completions.create(model=MODEL, messages=turn + [second.model_dump(
        include={"role", "content", "tool_calls"}), {"role": "tool", "tool_call_id": call.id, "content": "UTC"}],
        tools=TOOLS, max_tokens=3, extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"


def test_undeclared_tools_and_unanswered_tool_messages_are_bad_requests(sdk):
    undeclared = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "rm_rf", "arguments": "{}"}}]}]
    with pytest.raises(openai.BadRequestError) as error:
        sdk.chat.completions.create(model=MODEL, messages=undeclared, tools=TOOLS, max_tokens=1)
    assert error.value.body["param"] == "messages[1].tool_calls[0].function.name"
    orphan = [USER, {"role": "tool", "tool_call_id": "call_404", "content": "?"}]
    with pytest.raises(openai.BadRequestError) as error:
        sdk.chat.completions.create(model=MODEL, messages=orphan, tools=TOOLS, max_tokens=1)
    assert error.value.body["param"] == "messages[1].tool_call_id"
    with pytest.raises(openai.BadRequestError) as error:
        sdk.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, max_tokens=1,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert error.value.body["param"] == "tool_choice"


def test_a_requests_spans_reach_the_collector_in_the_callers_trace(sdk, collector):
    traceparent = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"
    reply = sdk.chat.completions.create(model=MODEL, messages=[USER], max_tokens=4, stream=True,
                                        extra_body={"ignore_eos": True}, extra_headers={"traceparent": traceparent})
    assert sum(1 for _ in reply) > 1
    names = {"POST /v1/chat/completions", "queue", "prefill", "decode"}
    spans = collector.wait_for(CALLER_TRACE_ID, names)
    assert {service for service, _ in spans.values()} == {SERVICE}
    request = spans["POST /v1/chat/completions"][1]
    assert request.parent_span_id.hex() == CALLER_SPAN_ID
    for phase in ("queue", "prefill", "decode"):
        assert spans[phase][1].parent_span_id == request.span_id
    decode = spans["decode"][1]
    assert {a.key: a.value.int_value for a in decode.attributes}["gen_ai.usage.output_tokens"] == 4
    assert request.end_time_unix_nano >= decode.end_time_unix_nano  # the span covers the whole stream
