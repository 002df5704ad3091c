"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError` (or one of the engine's errors); the error middleware turns
any exception into one of these so a client never sees an HTML page or a traceback.
"""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

from ..engine.types import EngineDead, EngineOverloaded, RequestRejected


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    status = 400
    type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.type, self.param, self.code))


class InvalidRequest(APIError):
    """400 invalid_request_error (APIError's defaults)."""


class Unauthorized(APIError):
    status = 401
    type = "authentication_error"


class NotFound(APIError):
    status = 404
    type = "not_found_error"


class MethodNotAllowed(APIError):
    status = 405


class BodyTooLarge(APIError):
    status = 413


class TooManyRequests(APIError):
    status = 429
    type = "rate_limit_error"


class ServiceUnavailable(APIError):
    status = 503
    type = "service_unavailable_error"


class InternalError(APIError):
    status = 500
    type = "server_error"


_JSON_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def from_decode_error(error: msgspec.DecodeError) -> InvalidRequest:
    """A msgspec decode/validation failure as a 400 naming the offending field."""
    message = str(error)
    match = _JSON_PATH.search(message)
    if isinstance(error, msgspec.ValidationError):
        param = match.group(1) if match and match.group(1) else None
        return InvalidRequest(f"invalid request: {message}", param=param, code="invalid_value")
    return InvalidRequest(f"request body is not valid JSON: {message}", code="invalid_json")


def from_engine_error(error: Exception) -> APIError:
    if isinstance(error, RequestRejected):
        return InvalidRequest(str(error), param=error.param)
    if isinstance(error, EngineOverloaded):
        retry = str(max(1, round(error.retry_after_s)))
        return ServiceUnavailable(str(error), code="overloaded", headers={"Retry-After": retry})
    if isinstance(error, EngineDead):
        return ServiceUnavailable(f"engine is not running: {error}", code="engine_dead")
    raise TypeError(f"not an engine error: {error!r}")


def as_api_error(error: Exception) -> APIError:
    return error if isinstance(error, APIError) else from_engine_error(error)


def from_http_exception(error: web.HTTPException) -> APIError:
    """aiohttp's own errors (no route, wrong method, body too large) in our shape."""
    if isinstance(error, web.HTTPNotFound):
        return NotFound(f"no route for this path: {error.reason}", code="route_not_found")
    if isinstance(error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(error.allowed_methods))
        return MethodNotAllowed(
            f"method {error.method} not allowed; use {allowed}",
            code="method_not_allowed",
            headers={"Allow": allowed},
        )
    if isinstance(error, web.HTTPRequestEntityTooLarge):
        return BodyTooLarge(f"request body too large: {error.text}", code="body_too_large")
    result = APIError(error.reason or "HTTP error", code=None)
    result.status = error.status
    result.type = "invalid_request_error" if error.status < 500 else "server_error"
    return result


def json_response(error: APIError) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(error.body()),
        status=error.status,
        content_type="application/json",
        headers=error.headers,
    )
