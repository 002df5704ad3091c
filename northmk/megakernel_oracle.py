"""The megakernel's oracle: the PyTorch reference decode step with per-layer records to set
beside a MegakernelTrace, with routing checked layer by layer.

Two bf16 implementations of one step differ in the last bit here and there, and those
differences grow layer by layer. Top-k routing turns them into different experts wherever
the k-th and (k+1)-th router logits are close, and with random weights every later layer
then diverges: comparing two free-running steps end to end says nothing. So the oracle
checks each layer's routing on the kernel's own input (the kernel's experts must be the
reference's top-k of the router logits of the kernel's residual, up to ROUTER_NOISE; any
other choice is a routing error), then routes the reference the same way, so everything
else (attention, norms, projections, the experts' math) is compared end to end.

    reference_step(..., trace=t)                 free-running reference, routing checked and shared
    reference_step(..., trace=t, teacher=True)   each layer fed the kernel's own input: local errors
    layer_report(trace, oracle)                  per-layer cosines; first_divergence() names the first bad one
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from .config import ModelConfig
from .megakernel import POST_SCALED_MAX_BATCH, MegakernelTrace
from .model.kv import BatchLayout, PagedKVCache
from .model.reference import ReferenceModel, rope_tables, swiglu
from .model.weights import LayerWeights, ModelWeights

ROUTER_NOISE = 2**-6  # relative to the k-th logit: 4 bf16 ulps
LOGIT_NOISE = 1e-2  # relative to the largest |logit|: an argmax gap below this is a tie
AGREE = 0.999  # cosine two bf16 implementations of the same step reach (a few layers deep)
AGREE_LAYER = 0.99999  # cosine of one layer's outputs computed from the same input


@dataclass
class OracleStep:
    """fp32 x, attn, mlp [L + 1, rows, H] laid out as MegakernelTrace; experts [L, rows, K]
    as routed (ascending, -1 on dense layers); logits fp32 [rows, V]."""

    logits: torch.Tensor
    x: torch.Tensor
    attn: torch.Tensor
    mlp: torch.Tensor
    experts: torch.Tensor
    routing_errors: list[str] = field(default_factory=list)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    if not a.any() and not b.any():
        return 1.0
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def _checked_experts(logits: torch.Tensor, top_k: int, kernel: torch.Tensor, layer: int,
                     errors: list[str]) -> torch.Tensor:
    """Experts [rows, K] ascending: the kernel's where they are the top-k of `logits` (bf16
    router logits [rows, E] of the kernel's own input) up to ROUTER_NOISE, else the top-k
    of `logits` with the difference reported in errors."""
    own = torch.topk(logits.float(), top_k, dim=-1).indices.sort(dim=-1).values
    chosen = own.clone()
    for r in range(logits.shape[0]):
        theirs = kernel[r].to(own.device)
        if torch.equal(theirs, own[r]):
            continue
        kth = logits[r].float().topk(top_k).values[-1].item()
        floor = kth - ROUTER_NOISE * max(1.0, abs(kth))
        valid = bool(((theirs >= 0) & (theirs < logits.shape[1])).all()) and theirs.unique().numel() == top_k
        if valid and bool((logits[r].float()[theirs] >= floor).all()):
            chosen[r] = theirs
        else:
            errors.append(f"layer {layer} row {r}: kernel routed to {theirs.tolist()}, reference {own[r].tolist()} "
                          f"(k-th logit {kth:.4f}; kernel's logits {logits[r].float()[theirs.clamp(0)].tolist()})")
    return chosen


def post_scaled(x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(rms * (bf16(x * norm) @ weight.T)) per row of bf16 x [T, H]: a GEMV over the normed
    input as the kernel's QKV and ROUTER tasks compute it up to POST_SCALED_MAX_BATCH rows, the
    rms applied to the fp32 sums (include/northmk.h, task semantics v0.6)."""
    xf = x.float()
    rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    g = (xf * norm.float()).to(torch.bfloat16).float()
    return (rms * (g @ weight.float().T)).to(torch.bfloat16)


class _Fp32Arithmetic(torch.overrides.TorchFunctionMode):
    """bf16 matmuls and attention computed from the same bf16 operands with IEEE fp32 sums,
    rounded to bf16 once per output: the kernel's arithmetic. (torch's bf16 tensor-core
    GEMMs accumulate with truncation, their own noise.)"""

    MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bf16 = all(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args[:2])
        if bf16 and func in self.MATMULS:
            return torch.matmul(args[0].float(), args[1].float()).to(torch.bfloat16)
        if func is torch.nn.functional.scaled_dot_product_attention and args[0].dtype == torch.bfloat16:
            q, k, v = (a.float() for a in args[:3])
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, *args[3:], **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def expert_sum(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(h[t]) in bf16, experts added one at a time in
    ascending id (the order of HF's eager per-expert loop, and the kernel's). h [T, H]; weights bf16,
    experts [T, K]; the experts are layer's, in either layout (LayerWeights.expert).
    Fixed here so the oracle does not move with the reference's own MoE kernels, whose
    grouped GEMMs and one scattered add round in another order."""
    out = torch.zeros_like(h)
    for e in experts.unique().tolist():
        rows, k = (experts == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, swiglu(h[rows], *layer.expert(e)) * weights[rows, k, None])
    return out


def reference_step(config: ModelConfig, weights: ModelWeights, tokens: torch.Tensor, layout: BatchLayout,
                   kv: PagedKVCache, trace: MegakernelTrace | None = None, teacher: bool = False,
                   fp32_sums: bool = True) -> OracleStep:
    """One decode step (one new token per row) of the reference, writing its k, v into kv.
    trace: the kernel's records of the same step; its routing is checked on its own input
    and then shared. teacher: feed each layer the kernel's input x instead of the
    reference's own (then the records measure each layer's error alone). fp32_sums: every
    bf16 matmul and attention sums in IEEE fp32 (False: torch's own bf16 kernels). Up to
    POST_SCALED_MAX_BATCH rows the QKV projection and the router logits are rounded as the
    kernel's (post_scaled)."""
    if teacher and trace is None:
        raise ValueError("teacher forcing needs the kernel's trace")
    with torch.inference_mode(), (_Fp32Arithmetic() if fp32_sums else nullcontext()):
        return _reference_step(config, weights, tokens, layout, kv, trace, teacher)


def _reference_step(config: ModelConfig, weights: ModelWeights, tokens: torch.Tensor, layout: BatchLayout,
                    kv: PagedKVCache, trace: MegakernelTrace | None, teacher: bool) -> OracleStep:
    ref = ReferenceModel(config, weights)
    positions = layout.positions(weights.device)
    cos, sin = rope_tables(positions, config.head_dim, config.rope_theta)
    x = weights.embed[tokens.to(weights.device).long()]
    rows, L, H = x.shape[0], config.num_layers, config.hidden_size
    records = torch.zeros(3, L + 1, rows, H, dtype=torch.float32, device=x.device)
    experts = torch.full((L, rows, config.top_k), -1, dtype=torch.long, device=x.device)
    errors: list[str] = []
    scaled = rows <= POST_SCALED_MAX_BATCH

    def project(x: torch.Tensor, h: torch.Tensor, layer: LayerWeights, weight: torch.Tensor) -> torch.Tensor:
        return post_scaled(x, layer.norm, weight, config.norm_eps) if scaled else h @ weight.T

    for i, layer in enumerate(weights.layers):
        if teacher:
            x = trace.x[i].to(x.device, x.dtype)
        if i == 0:
            records[0, 0] = x.float()
        h = ref.norm(x, layer.norm)
        attn = ref.attention(i, layer, h, positions, cos, sin, layout, kv, qkv=project(x, h, layer, layer.qkv))
        if layer.is_dense:
            mlp = swiglu(h, layer.gate_up, layer.down)
        else:
            logits = project(x, h, layer, layer.router)
            if trace is None:
                experts[i] = torch.topk(logits.float(), config.top_k, dim=-1).indices.sort(dim=-1).values
            else:
                x_kernel = trace.x[i].to(x.device, x.dtype)
                own = project(x_kernel, ref.norm(x_kernel, layer.norm), layer, layer.router)
                experts[i] = _checked_experts(own, config.top_k, trace.experts[i], i, errors)
            picked = torch.sigmoid(logits.gather(1, experts[i]).float())
            mlp = expert_sum(h, picked.to(h.dtype), experts[i], layer)
        x = x + attn + mlp
        records[:, i + 1] = torch.stack((x.float(), attn.float(), mlp.float()))
    logits = ref.logits(ref.norm(x, weights.final_norm))
    return OracleStep(logits, records[0], records[1], records[2], experts, errors)


def layer_report(trace: MegakernelTrace, oracle: OracleStep) -> list[dict[str, float]]:
    """Per layer l: cosines of the kernel's x entering l and attn / mlp of layer l - 1 against the oracle's."""
    return [{"layer": l, "x": cosine(trace.x[l], oracle.x[l]), "attn": cosine(trace.attn[l], oracle.attn[l]),
             "mlp": cosine(trace.mlp[l], oracle.mlp[l])} for l in range(trace.x.shape[0])]


def first_divergence(report: list[dict[str, float]], threshold: float = AGREE) -> str | None:
    """The first record below threshold, as 'layer l-1 attn: cosine c', or None."""
    for row in report:
        for stage in ("attn", "mlp", "x"):
            if row[stage] < threshold:
                owner = row["layer"] - (stage != "x")
                return f"layer {owner} {stage}: cosine {row[stage]:.5f}"
    return None


def tie_band(logits: torch.Tensor) -> float:
    """How far below a row's top logit another one may lie and still tie with it: the sums'
    noise (LOGIT_NOISE of the largest |logit|) plus two bf16 spacings at the top logit, since
    both implementations round every logit to bf16 (a true gap under one spacing can come out
    as two in one of them and none in the other)."""
    top = logits.max().float()
    spacing = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(top.abs().clamp_min(1e-30))).item()
    return LOGIT_NOISE * logits.abs().max().item() + 2 * spacing


def clear_argmax(logits: torch.Tensor) -> bool:
    """Whether a row's top-2 logit gap exceeds the noise between two bf16 implementations."""
    top2 = logits.topk(2).values
    return (top2[0] - top2[1]).item() > tie_band(logits)
