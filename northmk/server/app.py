"""The app factory: `create_app(config, engine)` -> an aiohttp Application.

The app owns the engine's lifetime (started on startup, drained and shut down on
cleanup) and the tracer's (flushed after the engine stops), so `web.run_app` /
`AppRunner` and the test client manage them together.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from aiohttp import web

from .. import telemetry
from ..engine.constrained import ll_tokenizer
from ..parsing import cohere_parser_factory
from ..tracing import Tracing
from .config import ServerConfig
from .metrics import HTTPMetrics
from .middleware import MIDDLEWARES, add_request_id_header
from .output_parser import ParserFactory
from .routes import ROUTES
from .state import CONFIG, ENGINE, GENERATION_SLOTS, HTTP_METRICS, PARSER_FACTORY, TOKENS, TRACING
from .tokens import Tokens

log = telemetry.get_logger("northmk.server")


def create_app(
    config: ServerConfig, engine, parser_factory: ParserFactory = cohere_parser_factory,
    tracing: Tracing | None = None,
) -> web.Application:
    """`tracing`: from `tracing.configure_tracing()`; None: off."""
    app = web.Application(middlewares=MIDDLEWARES, client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[ENGINE] = engine
    app[PARSER_FACTORY] = parser_factory
    app[TRACING] = tracing or Tracing()
    app[HTTP_METRICS] = HTTPMetrics()
    app[TOKENS] = Tokens(engine.tokenizer, engine.model_config.vocab_size)
    if config.max_concurrent_requests is not None:
        app[GENERATION_SLOTS] = asyncio.Semaphore(config.max_concurrent_requests)
    app.add_routes(ROUTES)
    app.on_response_prepare.append(add_request_id_header)
    app.cleanup_ctx.append(_engine_lifetime)
    return app


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    # Built once per tokenizer; the first constrained request would otherwise pay for it.
    await asyncio.to_thread(ll_tokenizer, engine.tokenizer, engine.eos_ids)
    await engine.start()
    log.info("engine started", model=app[CONFIG].served_model_names[0], backend=engine.backend,
             max_model_len=engine.max_model_len, tracing=app[TRACING].enabled)
    yield
    await engine.shutdown(app[CONFIG].drain_timeout_s)
    log.info("engine stopped")
    await asyncio.to_thread(app[TRACING].shutdown)
