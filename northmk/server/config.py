"""Settings of the HTTP layer (the engine has its own `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]  # the first is the default for requests naming none
    model_root: str = ""  # the checkpoint a model card points at
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 8 * MIB  # larger bodies get 413
    max_concurrent_requests: int | None = None  # generation requests in flight; beyond: 429
    drain_timeout_s: float = 30.0  # on shutdown, how long in-flight requests may finish

    def __post_init__(self) -> None:
        if not self.served_model_names or any(not n for n in self.served_model_names):
            raise ValueError("served_model_names must hold at least one non-empty name")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (use None for no authentication)")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
