"""Tracing span, request id + access log + metrics, errors -> OpenAI JSON, API key, limit.

Order (outermost first): tracing, context, errors, auth, limit — so an auth failure or a
429 is still traced, logged, counted and shaped like every other error, and the access log
line carries the request span's trace id. The span lasts until the handler returns, which
for a streamed response is after its last event.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid

import msgspec
from aiohttp import web

from .. import telemetry
from ..engine.types import EngineError
from .errors import (
    APIError, InternalError, TooManyRequests, Unauthorized, from_decode_error, from_engine_error,
    from_http_exception, json_response,
)
from .state import CONFIG, GENERATION_SLOTS, HTTP_METRICS, TRACING

REQUEST_ID_HEADER = "X-Request-Id"
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
OPEN_PATHS = frozenset({"/health"})
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
REQUEST_ID = web.RequestKey("request_id", str)

log = telemetry.get_logger("northmk.server")


def request_id_of(request: web.Request) -> str:
    return request[REQUEST_ID]


@web.middleware
async def tracing_middleware(request: web.Request, handler) -> web.StreamResponse:
    tracing = request.app[TRACING]
    if not tracing.enabled:
        return await handler(request)
    route = request.match_info.route.resource
    name = f"{request.method} {route.canonical}" if route is not None else request.method
    attributes = {"http.request.method": request.method, "url.path": request.path}
    with tracing.request_span(name, request.headers, attributes) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if REQUEST_ID in request:
            span.set_attribute("northmk.request_id", request[REQUEST_ID])
        return response


@web.middleware
async def context_middleware(request: web.Request, handler) -> web.StreamResponse:
    client_id = request.headers.get(REQUEST_ID_HEADER, "")
    request[REQUEST_ID] = client_id if _CLIENT_REQUEST_ID.match(client_id) else uuid.uuid4().hex
    telemetry.bind_request(request[REQUEST_ID])
    metrics = request.app[HTTP_METRICS]
    metrics.in_flight.inc()
    start = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away (nginx's convention)
        raise
    finally:
        elapsed = time.perf_counter() - start
        route = request.match_info.route.resource
        route_name = route.canonical if route is not None else "unmatched"
        metrics.in_flight.dec()
        metrics.observe(request.method, route_name, status, elapsed)
        log.info("request", method=request.method, path=request.path, status=status,
                 duration_ms=round(elapsed * 1000, 2))
        telemetry.unbind_request()


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as error:
        return json_response(error)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        return json_response(from_decode_error(error))
    except EngineError as error:
        return json_response(from_engine_error(error))
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return json_response(from_http_exception(error))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error")
        return json_response(InternalError("internal server error; see the server log", code="internal_error"))


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    key = request.app[CONFIG].api_key
    if key is None or request.path in OPEN_PATHS:
        return await handler(request)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise Unauthorized(
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )
    return await handler(request)


@web.middleware
async def limit_middleware(request: web.Request, handler) -> web.StreamResponse:
    slots = request.app.get(GENERATION_SLOTS)
    if slots is None or request.path not in GENERATION_PATHS:
        return await handler(request)
    if slots.locked():
        raise TooManyRequests(
            "too many concurrent generation requests; retry later",
            code="too_many_requests", headers={"Retry-After": "1"},
        )
    async with slots:
        return await handler(request)


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID in request:
        response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]


MIDDLEWARES = (tracing_middleware, context_middleware, error_middleware, auth_middleware, limit_middleware)
