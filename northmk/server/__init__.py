"""The OpenAI-compatible HTTP server (aiohttp + msgspec) in front of the engine.

`create_app` and `ServerConfig` load on first use: `northmk.parsing` builds on this package's
schemas, and the app builds on the parsers, so importing either package first must work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "ServerConfig":
        from .config import ServerConfig

        return ServerConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
