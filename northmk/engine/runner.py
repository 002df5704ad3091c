"""The PyTorch backend: the reference model over one KV arena, for prefill and decode steps.

Stateless between calls apart from the KV pages, so a prefill on an executor thread and
a decode step on the native loop thread may run at the same time on different pages.
"""

from __future__ import annotations

import math

import torch

from ..checkpoint import load_checkpoint, parse_dtype
from ..config import PAGE_SIZE, SLIDING, ModelConfig
from ..model.kv import BatchLayout, PagedKVCache
from ..model.reference import ReferenceModel
from ..model.weights import ModelWeights
from .config import EngineConfig

CPU_KV_BUDGET_BYTES = 2 << 30  # default KV arena cap on CPU


def kv_page_counts(engine: EngineConfig, model: ModelConfig, max_model_len: int, dtype: torch.dtype,
                   reserved_bytes: int = 0) -> list[int]:
    """Physical pages per attention group.

    Full group: `num_kv_pages`, else enough for max_batch rows of max_model_len (capped by
    the memory budget, less `reserved_bytes` the backend allocates after the KV). Sliding group:
    never more than the full group needs, never fewer than one row's window plus a prefill
    chunk (a row must always be able to progress).
    """
    window_pages = 0
    if model.sliding_window is not None:
        window_pages = math.ceil((model.sliding_window + engine.prefill_chunk) / PAGE_SIZE) + 2
    if engine.num_kv_pages is not None:
        full = engine.num_kv_pages
    else:
        per_row = math.ceil(max_model_len / PAGE_SIZE)
        budget = max(0, _kv_budget_bytes(engine) - reserved_bytes)
        page_bytes = sum(PagedKVCache.bytes_per_page(model, dtype))
        full = max(per_row, min(engine.max_batch * per_row, budget // page_bytes))
    counts = []
    for group in model.attention_groups:
        counts.append(max(full, window_pages) if group == SLIDING else full)
    return counts


def _kv_budget_bytes(engine: EngineConfig) -> int:
    if engine.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(engine.device))
        return int(free * engine.kv_memory_fraction)
    return CPU_KV_BUDGET_BYTES


class TorchRunner:
    backend = "torch"

    def __init__(self, model_config: ModelConfig, weights: ModelWeights, num_pages: list[int]):
        self.config = model_config
        self.model = ReferenceModel(model_config, weights)
        self.kv = PagedKVCache(model_config, num_pages, weights.dtype, weights.device)

    @classmethod
    def load(cls, engine: EngineConfig, path, max_model_len: int) -> "TorchRunner":
        dtype = parse_dtype(engine.dtype)
        model_config, weights = load_checkpoint(path, dtype=dtype, device=engine.device)
        reserved = cls.reserved_bytes(weights)
        return cls(model_config, weights, kv_page_counts(engine, model_config, max_model_len, dtype, reserved))

    @staticmethod
    def reserved_bytes(weights: ModelWeights) -> int:
        """Device memory the backend allocates beside the weights and the KV (none here)."""
        return 0

    def prefill(self, tokens: list[int], start: int, block_tables: list[torch.Tensor],
                all_logits: bool = False) -> torch.Tensor:
        """Write the KV of `tokens` at positions start.. of one row; float32 logits [V] of the
        last token, or with all_logits [n, V] of every token (prompt logprobs)."""
        layout = BatchLayout([len(tokens)], [start], [t.view(1, -1) for t in block_tables])
        ids = torch.tensor(tokens, dtype=torch.long)
        if all_logits:
            return self.model.logits(self.model.forward(ids, layout, self.kv))
        return self.model.step(ids, layout, self.kv)[0]

    def decode(self, tokens: list[int], positions: list[int], block_tables: list[torch.Tensor]) -> torch.Tensor:
        """One token per row at its position (tables [rows, cols] per group); float32 logits [rows, V]."""
        return self.decode_on_device(torch.tensor(tokens), positions, block_tables)

    def device_tables(self, block_tables: list[torch.Tensor], positions: list[int]) -> list[torch.Tensor]:
        """The tables as decode_on_device takes them (the megakernel's runner moves them to the GPU)."""
        return block_tables

    def decode_on_device(self, tokens: torch.Tensor, positions: list[int], tables: list[torch.Tensor]) -> torch.Tensor:
        """decode() on a tensor of tokens, e.g. the previous step's sampled ones where they lie."""
        layout = BatchLayout([1] * len(positions), list(positions), tables)
        return self.model.step(tokens.long(), layout, self.kv)

    def decode_greedy_on_device(self, tokens: torch.Tensor, positions: list[int], tables: list[torch.Tensor]
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """decode_on_device, and each row's greedy token where the backend's step computes it
        beside the logits (int32 [rows] on the device, the lowest id among equal maxima, as
        nmk_sample's greedy draw), else None (here: the PyTorch step computes none)."""
        return self.decode_on_device(tokens, positions, tables), None

    def prepare_schedules(self, max_batch: int, max_len: int) -> None:
        """Starts the backend's background work before serving (the megakernel's schedules);
        the PyTorch backend has none."""

    def close(self) -> None:
        """Stops the backend's background work."""

    def copy_page(self, group: int, src: int, dst: int) -> None:
        self.kv.pages[group][dst].copy_(self.kv.pages[group][src])
