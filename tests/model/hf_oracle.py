"""Hugging Face transformers' Cohere2MoeForCausalLM as the independent oracle.

Checkpoints here are written by transformers itself (`save_pretrained`) from config
variants that differ from North's geometry in every dimension we could get wrong.
"""

from __future__ import annotations

from pathlib import Path

import torch

transformers = __import__("pytest").importorskip("transformers")
from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM  # noqa: E402

BASE = dict(
    vocab_size=520, hidden_size=48, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
    head_dim=16, num_experts=6, num_experts_per_tok=2, intermediate_size=24, prefix_dense_intermediate_size=40,
    first_k_dense_replace=1, rms_norm_eps=1e-6, expert_selection_fn="sigmoid", norm_topk_prob=False,
    sliding_window=20, rope_theta=50000.0, logit_scale=1.0, bos_token_id=2, eos_token_id=519,
    pad_token_id=0, max_position_embeddings=1024, initializer_range=0.1,
)

VARIANTS: dict[str, dict] = {
    # North's rules at a small, odd geometry
    "north-rules": {},
    # Cohere LayerNorm, softmax routing, no dense prefix, MHA, a scaled head, wider window
    "layernorm-softmax": dict(
        rms_norm_eps=None, layer_norm_eps=1e-5, expert_selection_fn="softmax", first_k_dense_replace=0,
        num_attention_heads=4, num_key_value_heads=4, head_dim=12, hidden_size=40, logit_scale=0.25,
        sliding_window=33, num_hidden_layers=5, num_experts=5, num_experts_per_tok=3,
    ),
    # sigmoid with renormalised top-k, summed shared experts, a two-layer dense prefix on its own pattern
    "shared-sum": dict(
        norm_topk_prob=True, num_shared_experts=1, shared_expert_combination_strategy="sum",
        first_k_dense_replace=2, prefix_dense_sliding_window_pattern=2, num_hidden_layers=7,
        sliding_window=16, num_attention_heads=8, num_key_value_heads=1, logit_scale=0.5,
    ),
    # averaged shared experts, explicit layer types, theta 10000
    "shared-average-explicit": dict(
        num_shared_experts=2, shared_expert_combination_strategy="average", rope_theta=10000.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"], num_hidden_layers=5,
        sliding_window=24, hidden_size=64, num_experts=10, num_experts_per_tok=4,
    ),
}


def hf_config(variant: str) -> Cohere2MoeConfig:
    kwargs = {**BASE, **VARIANTS[variant]}
    return Cohere2MoeConfig(**kwargs)


def write_hf_checkpoint(directory: Path, variant: str, seed: int = 0) -> Cohere2MoeForCausalLM:
    """A transformers model with context-sensitive random weights, saved by transformers itself.

    Weights ~ N(0, 1/fan_in) (embeddings N(0, 4/H), norms 1 + N(0, 0.02)) instead of the
    library's 0.02 init, so that greedy decoding does not collapse into repeating one token.
    """
    torch.manual_seed(seed)
    model = Cohere2MoeForCausalLM(hf_config(variant)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.02)
            elif "embed_tokens" in name:
                param.normal_(0.0, 2.0 / param.shape[-1] ** 0.5)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    model.save_pretrained(directory)
    return model


@torch.inference_mode()
def hf_greedy(model: Cohere2MoeForCausalLM, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and chosen-token logprobs, token by token with transformers' own cache.

    EOS is disabled (not masked: masking would change the argmax) so every run is `steps` long.
    """
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, tokens)]
    return tokens, logprobs


@torch.inference_mode()
def hf_prefill_logits(model: Cohere2MoeForCausalLM, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()
