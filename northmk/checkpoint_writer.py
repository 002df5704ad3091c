"""Writing checkpoints in the real on-disk format: config.json, safetensors with the real key
names (single file or sharded with an index), tokenizer files and chat_template.jinja.

Presets name geometries; any field can be overridden. `north` is the full North Mini Code
geometry; `default` is the small built-in model (its vocabulary is what the built-in
tokenizer fills: bytes, learned merges and the Cohere special tokens); `mk-small` is the
default's vocabulary at a geometry the decode megakernel runs; `tiny` is for tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .checkpoint import checkpoint_tensors, parse_dtype, synthetic_weights
from .config import ModelConfig
from .model.weights import ModelWeights

PRESETS: dict[str, dict[str, Any]] = {
    "north": dict(
        vocab_size=262144, hidden_size=2048, num_hidden_layers=49, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        intermediate_size=768, prefix_dense_intermediate_size=3072, sliding_window=4096,
        max_position_embeddings=262144,
    ),
    "default": dict(
        vocab_size=608, hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
        intermediate_size=128, prefix_dense_intermediate_size=512, sliding_window=256,
        max_position_embeddings=8192,
    ),
    # head_dim 128, tied embeddings; layer 0 dense and full, 1-3 sliding, 4 full
    "mk-small": dict(
        vocab_size=608, hidden_size=512, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=1, head_dim=128, num_experts=16, num_experts_per_tok=4,
        intermediate_size=256, prefix_dense_intermediate_size=512, sliding_window=128,
        max_position_embeddings=8192,
    ),
    "tiny": dict(
        vocab_size=1024, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        intermediate_size=32, prefix_dense_intermediate_size=96, sliding_window=80,
        max_position_embeddings=4096,
    ),
}

# North Mini Code's numerics: fixed across presets unless overridden.
NORTH_RULES: dict[str, Any] = dict(
    model_type="cohere2_moe",
    architectures=["Cohere2MoeForCausalLM"],
    hidden_act="silu",
    attention_bias=False,
    first_k_dense_replace=1,
    prefix_dense_sliding_window_pattern=1,
    sliding_window_pattern=4,
    num_shared_experts=0,
    shared_expert_combination_strategy="average",
    expert_selection_fn="sigmoid",
    norm_topk_prob=False,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
    logit_scale=1.0,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
)


def config_dict(preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """A config.json dict for a preset geometry with North's rules; explicit layer_types included."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    raw = {**NORTH_RULES, **PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    parsed = ModelConfig.from_dict(raw)  # derive layer/mlp types exactly as a loader would
    raw.setdefault("layer_types", list(parsed.layer_types))
    raw.setdefault("mlp_layer_types", list(parsed.mlp_types))
    return raw


def write_weights(
    directory: Path,
    config: ModelConfig,
    weights: ModelWeights,
    dtype: torch.dtype,
    shards: int = 1,
    fused_experts: bool = False,
) -> None:
    """safetensors file(s) for `weights`; with shards > 1, model-0000i-of-0000n + an index."""
    items = [(k, t.to(dtype).contiguous().cpu()) for k, t in checkpoint_tensors(config, weights, fused_experts)]
    if shards <= 1:
        save_file(dict(items), str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    total = sum(t.nbytes for _, t in items)
    budget = -(-total // shards)
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for key, tensor in items:
        if size >= budget and len(groups) < shards:
            groups.append([])
            size = 0
        groups[-1].append((key, tensor))
        size += tensor.nbytes
    weight_map = {}
    for n, group in enumerate(groups, start=1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file(dict(group), str(directory / name), metadata={"format": "pt"})
        weight_map.update({k: name for k, _ in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_checkpoint(
    directory: str | Path,
    raw_config: dict[str, Any],
    weights: ModelWeights | None = None,
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    shards: int = 1,
    fused_experts: bool = False,
    tokenizer: bool = True,
) -> Path:
    """Write a complete checkpoint directory; random weights unless `weights` is given."""
    from .tokenizer_files import write_tokenizer_files

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(dtype)
    raw = dict(raw_config)
    if tokenizer:
        ids = write_tokenizer_files(directory, raw["vocab_size"])
        raw.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    config = ModelConfig.from_dict(raw)
    if weights is None:
        weights = synthetic_weights(config, dtype=torch.float32, seed=seed)
    write_weights(directory, config, weights, dtype, shards=shards, fused_experts=fused_experts)
    (directory / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return directory
