"""Typed keys of what the app holds; handlers read them from `request.app`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

from ..tracing import Tracing
from .config import ServerConfig
from .metrics import HTTPMetrics
from .output_parser import ParserFactory
from .tokens import Tokens

if TYPE_CHECKING:
    from ..engine import AsyncEngine

CONFIG = web.AppKey("config", ServerConfig)
ENGINE = web.AppKey("engine", "AsyncEngine")
PARSER_FACTORY = web.AppKey("parser_factory", ParserFactory)
HTTP_METRICS = web.AppKey("http_metrics", HTTPMetrics)
GENERATION_SLOTS = web.AppKey("generation_slots", asyncio.Semaphore)  # only with a concurrency limit
TOKENS = web.AppKey("tokens", Tokens)
TRACING = web.AppKey("tracing", Tracing)
