"""The route table: path -> handler. Every other method on these paths gets 405."""

from __future__ import annotations

from aiohttp import web

from .handlers import chat, completions, info

ROUTES = [
    web.post("/v1/chat/completions", chat.chat_completions),
    web.post("/v1/completions", completions.completions),
    web.get("/v1/models", info.models, allow_head=False),
    web.post("/tokenize", info.tokenize),
    web.post("/detokenize", info.detokenize),
    web.get("/health", info.health, allow_head=False),
    web.get("/metrics", info.metrics, allow_head=False),
]
