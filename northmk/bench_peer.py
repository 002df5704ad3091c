"""The decode benchmark's peer: Hugging Face transformers' own Cohere2MoeForCausalLM running
our synthetic weights, decoding the way its documentation says to make it fast.

    build_peer(config, weights)        the HF model, its parameters views of `weights` (no copy)
    bench_peer(model, batch, context, steps, warmup)   one row of the benchmark

The fast path (as transformers' CompileConfig documents it; checked with 5.17 and 5.24):
`generate` with a static cache compiles the decode step by itself on CUDA devices
(`torch.compile(mode="reduce-overhead")`, i.e. CUDA graphs); experts run as `grouped_mm` and
attention as SDPA, transformers' defaults. We pass our own StaticCache sized to context +
every decode step, so warm-up and timed steps run in one `generate` call at one cache size
(the warm-up absorbs the compile and the one recompile as the position becomes dynamic).
On a CPU the same call runs eagerly (transformers auto-compiles on accelerators only); only
sizes and device differ.
"""

from __future__ import annotations

import inspect
import time

import torch
from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM, StaticCache
from transformers.generation.streamers import BaseStreamer

from .config import DENSE, ModelConfig
from .model.weights import ModelWeights

BACKEND = "hf-transformers"
# transformers 5.24 renamed the forward/generate argument `past_key_values` to `cache`.
CACHE_ARG = "cache" if "cache" in inspect.signature(Cohere2MoeForCausalLM.forward).parameters else "past_key_values"


def hf_config(config: ModelConfig) -> Cohere2MoeConfig:
    """Every field spelled out: transformers' class defaults describe a different model."""
    c = config
    norm = {"rms_norm_eps": c.norm_eps} if c.norm_kind == "rms" else {"rms_norm_eps": None, "layer_norm_eps": c.norm_eps}
    return Cohere2MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        num_experts=c.num_experts, num_experts_per_tok=c.top_k, intermediate_size=c.moe_intermediate_size,
        prefix_dense_intermediate_size=c.dense_intermediate_size, layer_types=list(c.layer_types),
        mlp_layer_types=list(c.mlp_types), sliding_window=c.sliding_window,
        prefix_dense_sliding_window_pattern=c.prefix_dense_sliding_window_pattern,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}, **norm,
        expert_selection_fn=c.expert_selection, norm_topk_prob=c.norm_topk_prob,
        num_shared_experts=c.num_shared_experts, shared_expert_combination_strategy=c.shared_combination,
        logit_scale=c.logit_scale, tie_word_embeddings=c.tie_word_embeddings, hidden_act="silu",
        attention_bias=False, max_position_embeddings=c.max_position_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids) or None, pad_token_id=c.pad_token_id,
    )


def hf_state_dict(config: ModelConfig, weights: ModelWeights) -> dict[str, torch.Tensor]:
    """transformers' in-memory parameter names -> views of our tensors (row slices stay contiguous)."""
    c = config
    state = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm,
             "lm_head.weight": weights.head}
    for i, (layer, mlp_type) in enumerate(zip(weights.layers, c.mlp_types)):
        p = f"model.layers.{i}"
        q, k, v = layer.qkv.split([c.q_size, c.kv_size, c.kv_size])
        state.update({f"{p}.input_layernorm.weight": layer.norm, f"{p}.self_attn.q_proj.weight": q,
                      f"{p}.self_attn.k_proj.weight": k, f"{p}.self_attn.v_proj.weight": v,
                      f"{p}.self_attn.o_proj.weight": layer.o})
        if mlp_type == DENSE:
            gate, up = layer.gate_up.chunk(2)
            state.update({f"{p}.mlp.gate_proj.weight": gate, f"{p}.mlp.up_proj.weight": up,
                          f"{p}.mlp.down_proj.weight": layer.down})
            continue
        # Same layouts as ours: gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I].
        state.update({f"{p}.mlp.gate.weight": layer.router, f"{p}.mlp.experts.gate_up_proj": layer.experts_gate_up,
                      f"{p}.mlp.experts.down_proj": layer.experts_down})
        if layer.shared_gate_up is not None:
            gate, up = layer.shared_gate_up.chunk(2)
            state.update({f"{p}.mlp.shared_experts.gate_proj.weight": gate,
                          f"{p}.mlp.shared_experts.up_proj.weight": up,
                          f"{p}.mlp.shared_experts.down_proj.weight": layer.shared_down})
    return state


def build_peer(config: ModelConfig, weights: ModelWeights) -> Cohere2MoeForCausalLM:
    """The HF model on `weights`' device and dtype, sharing their memory: built on the meta
    device and assigned, so the full geometry is never materialised a second time."""
    if len(weights.layers) != config.num_layers:
        raise ValueError(f"weights have {len(weights.layers)} layers, config {config.num_layers}")
    if any(layer.experts_tiled for layer in weights.layers):
        raise ValueError("the experts are in the megakernel's tiled layout; model.weights.untile_experts_ first")
    hc = hf_config(config)
    hc.dtype = weights.dtype
    with torch.device("meta"):
        model = Cohere2MoeForCausalLM(hc)
    model.requires_grad_(False)  # assign keeps the flag; our tensors must not start tracking grads
    state = hf_state_dict(config, weights)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"transformers' Cohere2Moe expects other tensors: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    rotary = model.model.rotary_emb  # buffers made on meta: compute them for real
    model.model.rotary_emb = type(rotary)(hc).to(weights.device)
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not meta, f"left on the meta device: {meta}"
    model.generation_config.eos_token_id = None  # decode exactly the steps asked for
    model.generation_config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    return model.eval()


class StepClock(BaseStreamer):
    """Wall-clock time at which each generated token reaches the host, as a streaming user sees it.

    generate() first puts the prompt, then one put per new token; put copies the token to
    the host, so each stamp follows the completion of that step on the device."""

    def __init__(self):
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.stamps.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        """Nothing to flush: every token was stamped as it arrived."""


def routers(model: Cohere2MoeForCausalLM) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]


@torch.inference_mode()
def routed_distinct(model: Cohere2MoeForCausalLM, tokens: torch.Tensor, cache: StaticCache) -> float:
    """One more decode step of `tokens` [B] (eager, with forward hooks on the routers): the
    mean over sparse layers of the distinct experts it routed to."""
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _a, out: chosen.append(out[2])) for r in routers(model)]
    try:
        model(input_ids=tokens[:, None], use_cache=True, **{CACHE_ARG: cache})
    finally:
        for h in hooks:
            h.remove()
    return sum(e.unique().numel() for e in chosen) / max(1, len(chosen))


def random_context(vocab: int, batch: int, context: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, context), generator=gen).to(device)


@torch.inference_mode()
def bench_peer(model: Cohere2MoeForCausalLM, batch: int, context: int, steps: int, warmup: int = 8) -> dict:
    """Prefill a random context of `context` tokens per row, then time `steps` greedy decode
    steps after `warmup` (which absorb torch.compile and CUDA-graph capture) in one generate.

    The row also carries the generated tokens (`tokens`, [B][1 + warmup + steps]) for tests."""
    if batch < 1 or context < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"need batch, context, steps >= 1 and warmup >= 0; got {batch}, {context}, {steps}, {warmup}")
    device = model.device
    prompt = random_context(model.config.vocab_size, batch, context, device)
    new_tokens = 1 + warmup + steps  # the prefill's token, then one per decode step
    cache = StaticCache(config=model.config, max_cache_len=context + new_tokens)  # + the routing step
    clock = StepClock()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         do_sample=False, streamer=clock, **{CACHE_ARG: cache})
    generated = out[:, context:]
    if len(clock.stamps) != new_tokens or generated.shape[1] != new_tokens:
        raise RuntimeError(f"generate produced {generated.shape[1]} tokens / {len(clock.stamps)} stamps, "
                           f"expected {new_tokens}")
    seconds = (clock.stamps[-1] - clock.stamps[warmup]) / steps
    each = sorted(b - a for a, b in zip(clock.stamps[warmup:], clock.stamps[warmup + 1:]))
    distinct = routed_distinct(model, generated[:, -1], cache)
    del cache
    return {"backend": BACKEND, "batch": batch, "context": context, "ms_per_step": seconds * 1e3,
            "tok_s": batch / seconds, "median_ms_per_step": each[len(each) // 2] * 1e3,
            "max_ms_per_step": each[-1] * 1e3,  # far above the median: a compile inside the timed steps
            "distinct_experts": distinct, "distinct_experts_source": "routed",
            "mean_keys": context + warmup + (steps + 1) / 2,  # keys a timed step attends to, on average
            "attn_implementation": model.config._attn_implementation,
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "compiled": getattr(model, "_compiled_call", None) is not None,  # generate auto-compiled the step
            "tokens": generated.tolist()}
