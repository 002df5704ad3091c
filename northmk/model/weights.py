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

    @property
    def is_dense(self) -> bool:
        return self.gate_up is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}


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
