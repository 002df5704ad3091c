"""Settings of one engine instance (the CLI flags of `python -m northmk.serve` map onto these)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# auto: the megakernel where it can run (CUDA sm_90, bf16, a geometry it implements), else torch
BACKENDS = ("auto", "torch", "megakernel")
DEVICES = ("cpu", "cuda")


@dataclass
class EngineConfig:
    model: str | Path | None = None  # checkpoint directory; None: the built-in default model
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    backend: str = "auto"
    max_batch: int = 8  # rows in the decode batch
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    num_kv_pages: int | None = None  # pages of the full-attention group; None: sized below
    kv_memory_fraction: float = 0.9  # CUDA: share of free memory for KV when num_kv_pages is None
    max_waiting: int = 256  # bounded waiting queue; beyond it generate() raises EngineOverloaded
    prefill_chunk: int = 512  # tokens per prefill forward call
    enable_prefix_caching: bool = True
    served_model_name: str | None = None  # None: the checkpoint directory's name
    max_logprobs: int = 20  # the largest top-logprobs count a request may ask for
    # megakernel: enqueue each decode step before the last one's tokens reach the host
    decode_ahead: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.backend == "megakernel" and not self.device.startswith("cuda"):
            raise ValueError("backend 'megakernel' needs device 'cuda'")
        for name in ("max_batch", "max_waiting", "prefill_chunk", "max_logprobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ValueError(f"num_kv_pages must be >= 1, got {self.num_kv_pages}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
