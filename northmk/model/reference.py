"""The PyTorch reference of North Mini Code over the paged KV cache: prefill and decode.

One decoder layer (parallel residual, one norm):  h = norm(x);  x = x + attn(h) + mlp(h)
Final:  logits = (norm(x) @ head.T) * logit_scale
Shapes: T = new tokens in the call (rows concatenated), H = hidden, D = head_dim,
Hq / Hkv = query / kv heads, S = keys a row attends to, E = experts, K = experts per token.
This is the correctness oracle of the megakernel; it favours clarity over speed but keeps
prefill usable on a GPU (SDPA attention, experts grouped by expert).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from ..config import PAGE_SIZE, SLIDING, ModelConfig
from .kv import BatchLayout, PagedKVCache
from .weights import LayerWeights, ModelWeights, from_tiled


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm: mean-centred, no bias."""
    xf = x.float()
    xf = xf - xf.mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] in fp32 for interleaved (GPT-J) pairs."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [T, heads, D] by the angles of cos/sin [T, D/2], in fp32."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)
    return out.flatten(-2).to(x.dtype)


class ReferenceModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights):
        if len(weights.layers) != config.num_layers:
            raise ValueError(f"weights have {len(weights.layers)} layers, config {config.num_layers}")
        self.config = config
        self.weights = weights
        self._norm = rms_norm if config.norm_kind == "rms" else layer_norm
        self._rope = config.rope_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._norm(x, weight, self.config.norm_eps)

    # ---- whole model ------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, layout: BatchLayout, kv: PagedKVCache) -> torch.Tensor:
        """Run the new tokens of every row; write their K/V into the pages; return final-normed hidden [T, H]."""
        if input_ids.numel() != layout.num_tokens:
            raise ValueError(f"{input_ids.numel()} input ids but the layout has {layout.num_tokens} tokens")
        positions = layout.positions(self.device)
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        x = self.weights.embed[input_ids.to(self.device)]
        for i, layer in enumerate(self.weights.layers):
            h = self.norm(x, layer.norm)
            attn = self.attention(i, layer, h, positions, cos, sin, layout, kv)
            x = x + attn + self.mlp(layer, h)
        return self.norm(x, self.weights.final_norm)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [N, V] logits of final-normed hidden states [N, H]."""
        return (hidden @ self.weights.head.T).float() * self.config.logit_scale

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, layout: BatchLayout, kv: PagedKVCache) -> torch.Tensor:
        """float32 [rows, V]: the logits after each row's last new token."""
        hidden = self.forward(input_ids, layout, kv)
        return self.logits(hidden[layout.last_token_index()])

    # ---- attention ----------------------------------------------------------------------
    def attention(self, i: int, layer: LayerWeights, h: torch.Tensor, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, layout: BatchLayout, kv: PagedKVCache,
                  qkv: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of layer i over normed h [T, H]; qkv: the projection h @ qkv.T when the
        caller computed it itself (the megakernel's oracle, with the kernel's rounding)."""
        c = self.config
        q, k, v = (h @ layer.qkv.T if qkv is None else qkv).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.unflatten(-1, (c.num_heads, c.head_dim))  # [T, Hq, D]
        k = k.unflatten(-1, (c.num_kv_heads, c.head_dim))  # [T, Hkv, D]
        v = v.unflatten(-1, (c.num_kv_heads, c.head_dim))
        if self._rope[i]:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        pages = kv.layer_view(i)  # [P, 2, Hkv, PAGE, D]
        table = layout.block_tables[c.layer_group[i]]
        window = c.sliding_window if c.layer_types[i] == SLIDING else None
        write_kv(pages, table, layout, k, v)
        out = torch.empty_like(q)
        t0 = 0
        for row, (start, qlen) in enumerate(zip(layout.start_positions, layout.query_lens)):
            out[t0:t0 + qlen] = attend_row(q[t0:t0 + qlen], pages, table[row], start, qlen, window)
            t0 += qlen
        return out.flatten(-2) @ layer.o.T

    # ---- MLP ------------------------------------------------------------------------------
    def mlp(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        if layer.is_dense:
            return swiglu(h, layer.gate_up, layer.down)
        c = self.config
        weights, experts = route(h @ layer.router.T, c.top_k, c.expert_selection, c.norm_topk_prob)
        out = moe_experts(h, weights.to(h.dtype), experts, layer.experts_gate_up, layer.experts_down,
                          tiled=layer.experts_tiled)
        if layer.shared_gate_up is not None:
            shared = swiglu(h, layer.shared_gate_up, layer.shared_down)
            out = out + shared if c.shared_combination == "sum" else (out + shared) / 2
        return out


def write_kv(pages: torch.Tensor, table: torch.Tensor, layout: BatchLayout, k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter the new tokens' k, v [T, Hkv, D] into their pages."""
    rows = torch.repeat_interleave(torch.arange(layout.num_rows), torch.tensor(layout.query_lens))
    positions = layout.positions("cpu")
    page_ids = table.cpu()[rows, positions // PAGE_SIZE].long()
    if (page_ids < 0).any():
        bad = positions[page_ids < 0][0].item()
        raise ValueError(f"no KV page for position {bad}: the block table must cover every new token")
    page_ids = page_ids.to(pages.device)
    offsets = (positions % PAGE_SIZE).to(pages.device)
    pages[page_ids, 0, :, offsets] = k.to(pages.dtype)
    pages[page_ids, 1, :, offsets] = v.to(pages.dtype)


def attend_row(q: torch.Tensor, pages: torch.Tensor, table_row: torch.Tensor, start: int, qlen: int,
               window: int | None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of one row's new queries q [qlen, Hq, D] over its cache."""
    end = start + qlen  # keys at positions [lo, end)
    lo = 0 if window is None else max(0, start - window + 1)
    first, last = lo // PAGE_SIZE, (end - 1) // PAGE_SIZE
    ids = table_row[first:last + 1].long().to(pages.device)
    if (ids < 0).any():
        raise ValueError(f"KV pages for positions [{lo}, {end}) are missing from the block table")
    kv = pages[ids]  # [n, 2, Hkv, PAGE, D]
    keys = kv[:, 0].permute(1, 0, 2, 3).flatten(1, 2)  # [Hkv, n*PAGE, D]
    values = kv[:, 1].permute(1, 0, 2, 3).flatten(1, 2)
    offset = lo - first * PAGE_SIZE
    keys, values = keys[:, offset:offset + end - lo], values[:, offset:offset + end - lo]
    key_pos = torch.arange(lo, end, device=q.device)
    query_pos = torch.arange(start, end, device=q.device)
    visible = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        visible &= query_pos[:, None] - key_pos[None, :] < window
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).to(dtype), keys.to(dtype), values.to(dtype),
        attn_mask=visible, enable_gqa=True,
    )  # [Hq, qlen, D]
    return out.transpose(0, 1).to(q.dtype)


def swiglu(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (h @ gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.T


def route(router_logits: torch.Tensor, top_k: int, selection: str, norm_topk_prob: bool):
    """Top-k of the raw router logits [T, E]; weights from the selected logits only. Returns fp32 [T, K], ids [T, K]."""
    selected, experts = torch.topk(router_logits, top_k, dim=-1)
    if selection == "softmax":
        return F.softmax(selected, dim=-1, dtype=torch.float32), experts
    weights = torch.sigmoid(selected.float())
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def moe_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(h[t]), each token's experts added in ascending id.

    h [T, H]; weights, experts [T, K]; gate_up [E, 2I, H]; down [E, H, I], each expert in the
    tiled layout if `tiled` (model.weights). The GEMMs run over (token, choice) pairs grouped by
    expert: one grouped GEMM per projection where torch has one for these operands (on tiled
    experts, model.tiled_moe's on a CUDA device with Triton), else one GEMM per routed expert
    (tiled experts untiled first). The sum is deterministic and in transformers' order and
    precision (a rounding add per expert, lowest id first).
    """
    tokens, top_k = experts.shape
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    x = h[order // top_k]
    if tiled and _tiled_gemm_supported(x, gate_up, down):
        from .tiled_moe import swiglu_tiled
        y = swiglu_tiled(x, counts, gate_up, down)
    elif tiled:
        y = _per_expert(x, counts, lambda e: (from_tiled(gate_up[e]), from_tiled(down[e])))
    elif _grouped_mm_supported(x, gate_up, down):
        offsets = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)
    else:
        y = _per_expert(x, counts, lambda e: (gate_up[e], down[e]))
    per_pair = torch.empty_like(y)
    per_pair[order] = y  # back to (token, choice) order
    per_pair = per_pair.view(tokens, top_k, -1) * weights[..., None]
    by_id = experts.argsort(dim=-1)
    per_pair = per_pair.gather(1, by_id[..., None].expand_as(per_pair))
    out = torch.zeros_like(h)
    for k in range(top_k):
        out = out + per_pair[:, k].to(out.dtype)
    return out


def _per_expert(x: torch.Tensor, counts: torch.Tensor, expert) -> torch.Tensor:
    """SwiGLU of x's rows grouped by expert, one GEMM per routed expert e (expert(e): gate_up, down)."""
    y = torch.empty_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            y[start:start + n] = swiglu(x[start:start + n], *expert(e))
            start += n
    return y


# Why model.tiled_moe cannot run in this process (disable_tiled_gemm), or None.
_tiled_gemm_unusable: str | None = None


def disable_tiled_gemm(reason: str) -> None:
    """Tiled experts are untiled per call from now on: model.tiled_moe failed here (`reason`),
    e.g. Triton found no C compiler for its launcher."""
    global _tiled_gemm_unusable
    _tiled_gemm_unusable = reason


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def tiled_gemm_available(device: torch.device) -> bool:
    """Whether moe_experts runs tiled experts by model.tiled_moe on `device`."""
    return device.type == "cuda" and _tiled_gemm_unusable is None and _have_triton()


def _tiled_gemm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    # model.tiled_moe's blocks: 64 rows (N) by 32 columns (K) of a matrix at least
    shapes_fit = all(w.shape[1] % 64 == 0 and w.shape[2] % 32 == 0 for w in (gate_up, down))
    return x.dtype in (torch.bfloat16, torch.float16) and shapes_fit and tiled_gemm_available(x.device)


def _grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    # CUDA grouped GEMMs take bf16 with 16-byte aligned rows.
    dims = (gate_up.shape[1], gate_up.shape[2], down.shape[2])
    return x.dtype == torch.bfloat16 and all(d % 8 == 0 for d in dims)
