"""What every generation handler does: read the body, address the engine, start requests."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, AsyncIterator

from aiohttp import web
from opentelemetry import trace

from ...engine.types import GenerationRequest, RequestOutput
from ...tracing import GenerationTiming
from .. import schemas
from ..state import CONFIG, ENGINE, TRACING
from ..streaming import merge
from ..validation import check_model

Outputs = AsyncIterator[tuple[int, RequestOutput]]  # (prompt index, output)


async def read_request(request: web.Request, kind: type) -> Any:
    return schemas.decode(await request.read(), kind)


def engine_of(request: web.Request):
    return request.app[ENGINE]


def model_name(request: web.Request, requested: str | None) -> str:
    return check_model(requested, request.app[CONFIG].served_model_names)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


async def start(engine, requests: list[GenerationRequest]) -> tuple[RequestOutput | None, int, Outputs]:
    """Submit the requests and wait for the first output, so that admission errors
    (overloaded, rejected, dead) surface before a response is started.

    Returns the first (prompt index, output) and an iterator over the rest; closing that
    iterator aborts every request.
    """
    for r in requests:
        r.arrival_time = time.monotonic()
    outputs = merge([engine.generate(r) for r in requests])
    try:
        index, first = await anext(outputs)
    except StopAsyncIteration:
        return None, 0, outputs
    except BaseException:
        await outputs.aclose()
        raise
    return first, index, outputs


async def iterate(first: RequestOutput | None, index: int, rest: Outputs) -> Outputs:
    """The first output followed by the rest; closes `rest` when done or abandoned."""
    async with contextlib.aclosing(rest):
        if first is not None:
            yield index, first
        async for item in rest:
            yield item


def trace_generation(request: web.Request, generation: GenerationRequest, last: RequestOutput | None,
                     num_completion_tokens: int, finish_reason: str | None) -> None:
    """The queue / prefill / decode spans of one engine request (ended now, `last` its final
    output) under the request's span; nothing when tracing is off."""
    tracing = request.app[TRACING]
    if not tracing.enabled:
        return
    timing = GenerationTiming(
        generation.request_id, generation.arrival_time,
        scheduled=last.scheduled_time if last else None, first_token=last.first_token_time if last else None,
        finished=time.monotonic(), num_prompt_tokens=len(generation.prompt_token_ids),
        num_cached_tokens=last.num_cached_tokens if last else 0, num_completion_tokens=num_completion_tokens,
        finish_reason=finish_reason,
    )
    tracing.record_generation(trace.get_current_span(), timing)
