"""In-memory weight layout shared by the PyTorch reference and the megakernel.

Shapes (H = hidden, Q = heads*head_dim, KV = kv_heads*head_dim, E = experts,
I = expert intermediate, D = dense intermediate, V = vocab):

    embed            [V, H]
    lm_head          [V, H]      the same tensor as embed when tied
    final_norm       [H]
    layer.norm       [H]
    layer.qkv        [Q + 2*KV, H]   rows: q, then k, then v
    layer.o          [H, Q]
    dense layer:   layer.gate_up [2*D, H] (gate rows first), layer.down [H, D]
    sparse layer:  layer.router [E, H], layer.experts_gate_up [E, 2*I, H] (gate rows first),
                   layer.experts_down [E, H, I],
                   layer.shared_gate_up [2*S, H], layer.shared_down [H, S] when shared experts exist

The experts may instead be held in the tiled layout (layer.experts_tiled; tile_experts_),
in place and under the same shapes: the layout the megakernel streams weights in, where
each band of 16 rows of an [R, K] matrix is stored as its K / 32 blocks of [16, 32]
(row-major inside), so that element (r, c) lies at (r - r % 16) K + (c / 32) 512 + (r % 16) 32
+ c % 32 (include/northmk.h). Code that reads the experts goes through LayerWeights.expert,
or reads the layout itself (the reference's MoE).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerWeights:
    norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor | None = None  # dense MLP
    down: torch.Tensor | None = None
    router: torch.Tensor | None = None  # sparse MLP
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    experts_tiled: bool = False  # experts_gate_up, experts_down hold each expert in the tiled layout

    @property
    def is_dense(self) -> bool:
        return self.gate_up is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's gate_up [2I, H] and down [H, I], row-major (views, or copies when tiled)."""
        gate_up, down = self.experts_gate_up[e], self.experts_down[e]
        if self.experts_tiled:
            return from_tiled(gate_up), from_tiled(down)
        return gate_up, down


@dataclass
class ModelWeights:
    embed: torch.Tensor
    final_norm: torch.Tensor
    layers: list[LayerWeights] = field(default_factory=list)
    lm_head: torch.Tensor | None = None  # None: tied to embed

    @property
    def head(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def nbytes(self) -> int:
        total = self.embed.nbytes + self.final_norm.nbytes
        if self.lm_head is not None:
            total += self.lm_head.nbytes
        return total + sum(t.nbytes for layer in self.layers for t in layer.tensors().values())


def to_tiled(w: torch.Tensor) -> torch.Tensor:
    """w [..., R, K] (R % 16 == 0, K % 32 == 0), each trailing matrix in the tiled layout, as a
    new contiguous tensor of w's shape."""
    *lead, rows, k = w.shape
    if rows % 16 or k % 32:
        raise ValueError(f"the tiled layout needs rows % 16 == 0 and columns % 32 == 0, got {tuple(w.shape)}")
    return w.reshape(*lead, rows // 16, 16, k // 32, 32).transpose(-3, -2).reshape(w.shape)


def from_tiled(w: torch.Tensor) -> torch.Tensor:
    """The row-major matrices [..., R, K] of w, which holds them in the tiled layout."""
    *lead, rows, k = w.shape
    return w.reshape(*lead, rows // 16, k // 32, 16, 32).transpose(-3, -2).reshape(w.shape)


# Experts re-laid out per call of _relayout_: bounds the temporary copy (16 of North's experts, 150 MB).
_RELAYOUT_EXPERTS = 16


def _relayout_(weights: ModelWeights, tiled: bool) -> None:
    convert = to_tiled if tiled else from_tiled
    for layer in weights.layers:
        if layer.experts_gate_up is None or layer.experts_tiled == tiled:
            continue
        for w in (layer.experts_gate_up, layer.experts_down):
            for e in range(0, w.shape[0], _RELAYOUT_EXPERTS):
                w[e:e + _RELAYOUT_EXPERTS] = convert(w[e:e + _RELAYOUT_EXPERTS])
        layer.experts_tiled = tiled


def tile_experts_(weights: ModelWeights) -> None:
    """Every sparse layer's experts into the tiled layout, in place (no-op where they are)."""
    _relayout_(weights, True)


def untile_experts_(weights: ModelWeights) -> None:
    """Every sparse layer's experts back to row-major, in place (no-op where they are)."""
    _relayout_(weights, False)
