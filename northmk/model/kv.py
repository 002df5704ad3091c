"""Paged KV cache: the page layout that PyTorch prefill writes and the megakernel reads.

Layers are grouped by attention kind (`ModelConfig.attention_groups`: full first, then
sliding). Each group has its own page pool and its own block table per request, so the
sliding group can release pages that fell behind the window while the full group keeps
them. A page holds PAGE_SIZE consecutive token positions for every layer of its group:

    pages[g]    [num_pages_g, layers_in_group, 2 (k, v), kv_heads, PAGE_SIZE, head_dim]

so each (page, layer, k|v, kv_head) is one contiguous [PAGE_SIZE, head_dim] tile
(16 KiB in bf16 at head_dim 128). Logical page j of a request covers positions
[j*PAGE_SIZE, (j+1)*PAGE_SIZE); block_tables[g][row, j] is its physical page id, or -1
when absent (never allocated or released behind a sliding window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PAGE_SIZE, ModelConfig


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_pages: list[int] | tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        groups = config.attention_groups
        if len(num_pages) != len(groups):
            raise ValueError(f"need a page count per attention group {groups}, got {num_pages}")
        self.config = config
        self.page_size = PAGE_SIZE
        self.pages = [
            torch.zeros(
                (n, layers, 2, config.num_kv_heads, PAGE_SIZE, config.head_dim),
                dtype=dtype,
                device=device,
            )
            for n, layers in zip(num_pages, config.layers_per_group)
        ]

    @property
    def num_pages(self) -> list[int]:
        return [p.shape[0] for p in self.pages]

    @staticmethod
    def bytes_per_page(config: ModelConfig, dtype: torch.dtype) -> list[int]:
        elem = torch.empty((), dtype=dtype).element_size()
        tile = 2 * config.num_kv_heads * PAGE_SIZE * config.head_dim * elem
        return [layers * tile for layers in config.layers_per_group]

    def layer_view(self, layer: int) -> torch.Tensor:
        """[num_pages, 2, kv_heads, PAGE_SIZE, head_dim] for one layer."""
        c = self.config
        return self.pages[c.layer_group[layer]][:, c.layer_slot[layer]]


@dataclass
class BatchLayout:
    """Where each row's new tokens sit: the ragged batch of one forward call.

    Row r contributes query_lens[r] consecutive tokens at positions
    start_positions[r] .. start_positions[r] + query_lens[r] - 1 (its tokens already in
    the cache are exactly the positions before start_positions[r]).
    """

    query_lens: list[int]
    start_positions: list[int]
    block_tables: list[torch.Tensor]  # per group: int32/int64 [rows, max_logical_pages], -1 absent

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[T] absolute position of every new token, rows concatenated."""
        return torch.cat(
            [torch.arange(s, s + q, dtype=torch.long) for s, q in zip(self.start_positions, self.query_lens)]
        ).to(device)

    def last_token_index(self) -> list[int]:
        """Index into the concatenated tokens of each row's last new token."""
        out, acc = [], 0
        for q in self.query_lens:
            acc += q
            out.append(acc - 1)
        return out
