"""GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /metrics."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import schemas
from ..schemas import UNSET
from ..errors import InvalidRequest
from ..schemas import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest
from ..state import CONFIG, HTTP_METRICS, TOKENS
from .common import engine_of, model_name, now, read_request

STARTED = now()


def _json(body) -> web.Response:
    return web.Response(body=schemas.encode(body), content_type="application/json")


async def models(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    max_len = engine_of(request).max_model_len
    cards = [ModelCard(name, STARTED, config.model_root or name, max_len) for name in config.served_model_names]
    return _json(ModelList(cards))


async def tokenize(request: web.Request) -> web.Response:
    req = await read_request(request, TokenizeRequest)
    model_name(request, req.model)
    tokens = request.app[TOKENS]
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of `prompt` and `messages`", param="prompt")
    if req.messages is not None:
        if not req.messages:
            raise InvalidRequest("`messages` must contain at least one message", param="messages")
        ids = tokens.render_chat(req.messages, req.tools, req.add_generation_prompt,
                                 req.continue_final_message, req.chat_template_kwargs)
    else:
        ids = tokens.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [tokens.token_text(i) for i in ids] if req.return_token_strs else UNSET
    return _json(schemas.TokenizeResponse(len(ids), engine_of(request).max_model_len, ids, strs))


async def detokenize(request: web.Request) -> web.Response:
    req = await read_request(request, DetokenizeRequest)
    model_name(request, req.model)
    text = request.app[TOKENS].decode(req.tokens, skip_special_tokens=False)
    return _json(schemas.DetokenizeResponse(text))


async def health(request: web.Request) -> web.Response:
    if engine_of(request).is_healthy:
        return web.Response(text="ok\n")
    return web.json_response(
        {"error": {"message": "engine is not running", "type": "service_unavailable_error",
                   "param": None, "code": "engine_dead"}},
        status=503,
    )


async def metrics(request: web.Request) -> web.Response:
    engine = engine_of(request)
    engine.stats()  # refreshes the engine's gauges (running, waiting, KV usage)
    body = generate_latest(engine.metrics.registry) + generate_latest(request.app[HTTP_METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
