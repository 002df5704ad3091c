"""Logging: structlog, one JSON object per line.

`configure(...)` is the one entry point the CLIs call. Every log line carries the
contextvars bound for the current task, so a request's lines share its `request_id`
(bound by the server's request middleware with `bind_request`), and, while a traced
request's span is current, its `trace_id` / `span_id`. Standard-library loggers (aiohttp,
the engine) go through the same processors. Tracing itself lives in `northmk.tracing`.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

from .tracing import add_trace_ids

LEVELS = ("debug", "info", "warning", "error", "critical")


def configure(log_level: str = "info", json_logs: bool = True, stream: TextIO | None = None) -> None:
    configure_logging(log_level, json_logs, stream)


def configure_logging(level: str = "info", json_logs: bool = True, stream: TextIO | None = None) -> None:
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {LEVELS}, got {level!r}")
    shared = [
        structlog.contextvars.merge_contextvars,
        add_trace_ids,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            renderer,
        ])
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


def bind_request(request_id: str) -> None:
    """Tag every log line of the current task (and tasks it starts) with the request id."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id)


def unbind_request() -> None:
    structlog.contextvars.clear_contextvars()
