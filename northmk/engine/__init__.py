"""The serving engine: scheduler, sampling, output processing, metrics."""

from .config import EngineConfig
from .types import (
    CompletionOutput, EngineDead, EngineError, EngineOverloaded, FinishReason, GenerationRequest,
    RequestOutput, RequestRejected, SamplingParams, TokenLogprob,
)

__all__ = [
    "AsyncEngine", "CompletionOutput", "EngineConfig", "EngineDead", "EngineError", "EngineOverloaded",
    "FinishReason", "GenerationRequest", "RequestOutput", "RequestRejected", "SamplingParams", "TokenLogprob",
]


def __getattr__(name: str):
    # Imported on first use: the engine loads the native library, which the message types
    # (used by the HTTP layer on its own) do not need.
    if name == "AsyncEngine":
        from .async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
