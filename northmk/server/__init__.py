"""The OpenAI-compatible HTTP server (aiohttp + msgspec) in front of the engine."""

from .app import create_app
from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
