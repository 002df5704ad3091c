"""Logs are one JSON object per line and carry the bound request id."""

import io
import json
import logging

import pytest

from northmk import telemetry


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
