"""Model configuration read from a checkpoint's config.json.

Every field the model depends on is read explicitly from the file; nothing falls back to
transformers' class defaults (they describe a larger Cohere model). Anything the engine
cannot run fails here with one message naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
DENSE = "dense"
SPARSE = "sparse"
PAGE_SIZE = 64  # tokens per KV page; one attention tile


class ConfigError(ValueError):
    """A config.json the engine cannot run; the message names the field."""


def _require(raw: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in raw or raw[name] is None:
        raise ConfigError(f"config.json: missing required field '{name}'")
    value = raw[name]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(f"config.json: field '{name}' must be {kind}, got {value!r}")
    if not isinstance(value, kind):
        raise ConfigError(f"config.json: field '{name}' must be {kind}, got {value!r}")
    return value


def _positive_int(raw: dict[str, Any], name: str, default: int | None = None) -> int:
    if default is not None and raw.get(name) is None:
        return default
    value = _require(raw, name, int)
    if value <= 0:
        raise ConfigError(f"config.json: field '{name}' must be a positive integer, got {value}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """North Mini Code (Cohere2MoeForCausalLM) geometry and numerics."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    layer_types: tuple[str, ...]  # FULL or SLIDING per layer
    mlp_types: tuple[str, ...]  # DENSE or SPARSE per layer
    sliding_window: int | None  # keys visible to a sliding layer, the current token included
    rope_theta: float
    norm_kind: str  # "rms" or "layer" (Cohere's mean-centred, bias-free LayerNorm)
    norm_eps: float
    expert_selection: str  # "sigmoid" or "softmax"
    norm_topk_prob: bool
    num_shared_experts: int
    shared_combination: str  # "average" or "sum"
    prefix_dense_sliding_window_pattern: int
    logit_scale: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    max_position_embeddings: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # ---- derived -----------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rope_layers(self) -> tuple[bool, ...]:
        """RoPE on sliding layers, and on dense-prefix layers when their pattern is 1."""
        force = self.prefix_dense_sliding_window_pattern == 1
        return tuple(
            lt == SLIDING or (mt == DENSE and force)
            for lt, mt in zip(self.layer_types, self.mlp_types)
        )

    @property
    def attention_groups(self) -> tuple[str, ...]:
        """KV page groups: one per attention kind present, full first."""
        return tuple(k for k in (FULL, SLIDING) if k in self.layer_types)

    @property
    def layer_group(self) -> tuple[int, ...]:
        """Index into attention_groups for each layer."""
        return tuple(self.attention_groups.index(t) for t in self.layer_types)

    @property
    def layer_slot(self) -> tuple[int, ...]:
        """Position of each layer inside its group's KV page."""
        seen = [0] * len(self.attention_groups)
        slots = []
        for g in self.layer_group:
            slots.append(seen[g])
            seen[g] += 1
        return tuple(slots)

    @property
    def layers_per_group(self) -> tuple[int, ...]:
        return tuple(self.layer_group.count(g) for g in range(len(self.attention_groups)))

    def window_for(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def num_params(self) -> int:
        h, e = self.hidden_size, self.num_experts
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for mt in self.mlp_types:
            total += attn + h
            if mt == DENSE:
                total += 3 * h * self.dense_intermediate_size
            else:
                total += e * h + e * 3 * h * self.moe_intermediate_size
                total += 3 * h * self.moe_intermediate_size * self.num_shared_experts
        return total

    # ---- construction ------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        _check_supported(raw)
        hidden = _positive_int(raw, "hidden_size")
        num_layers = _positive_int(raw, "num_hidden_layers")
        num_heads = _positive_int(raw, "num_attention_heads")
        num_kv = _positive_int(raw, "num_key_value_heads", default=num_heads)
        head_dim = _positive_int(raw, "head_dim", default=hidden // num_heads)
        if num_heads % num_kv:
            raise ConfigError(
                f"config.json: 'num_attention_heads' ({num_heads}) must be a multiple of "
                f"'num_key_value_heads' ({num_kv})"
            )
        if head_dim % 2:
            raise ConfigError(f"config.json: 'head_dim' must be even for RoPE, got {head_dim}")
        num_experts = _positive_int(raw, "num_experts")
        top_k = _positive_int(raw, "num_experts_per_tok")
        if top_k > num_experts:
            raise ConfigError(
                f"config.json: 'num_experts_per_tok' ({top_k}) exceeds 'num_experts' ({num_experts})"
            )
        moe_inter = _positive_int(raw, "intermediate_size")
        mlp_types = _mlp_types(raw, num_layers)
        dense_inter = _positive_int(raw, "prefix_dense_intermediate_size", default=moe_inter)
        layer_types = _layer_types(raw, num_layers)
        window = raw.get("sliding_window")
        if SLIDING in layer_types:
            if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
                raise ConfigError(
                    f"config.json: 'sliding_window' must be a positive integer when any layer is "
                    f"sliding, got {window!r}"
                )
        else:
            window = None
        norm_kind, norm_eps = _norm(raw)
        selection = raw.get("expert_selection_fn", "softmax")
        if selection not in ("sigmoid", "softmax"):
            raise ConfigError(
                f"config.json: 'expert_selection_fn' must be 'sigmoid' or 'softmax', got {selection!r}"
            )
        shared = raw.get("num_shared_experts", 0) or 0
        if not isinstance(shared, int) or shared < 0:
            raise ConfigError(f"config.json: 'num_shared_experts' must be >= 0, got {shared!r}")
        combination = raw.get("shared_expert_combination_strategy", "average")
        if combination not in ("average", "sum"):
            raise ConfigError(
                "config.json: 'shared_expert_combination_strategy' must be 'average' or 'sum', "
                f"got {combination!r}"
            )
        logit_scale = raw.get("logit_scale", 1.0)
        if not isinstance(logit_scale, (int, float)) or isinstance(logit_scale, bool) or not math.isfinite(logit_scale):
            raise ConfigError(f"config.json: 'logit_scale' must be a finite number, got {logit_scale!r}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=moe_inter,
            dense_intermediate_size=dense_inter,
            layer_types=layer_types,
            mlp_types=mlp_types,
            sliding_window=window,
            rope_theta=_rope_theta(raw),
            norm_kind=norm_kind,
            norm_eps=norm_eps,
            expert_selection=selection,
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            num_shared_experts=shared,
            shared_combination=combination,
            prefix_dense_sliding_window_pattern=_positive_int(
                raw, "prefix_dense_sliding_window_pattern", default=1
            ),
            logit_scale=float(logit_scale),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", default=8192),
            raw=dict(raw),
        )


def _check_supported(raw: dict[str, Any]) -> None:
    model_type = raw.get("model_type")
    if model_type not in (None, "cohere2_moe"):
        raise ConfigError(f"config.json: 'model_type' must be 'cohere2_moe', got {model_type!r}")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"config.json: 'hidden_act' must be 'silu', got {act!r}")
    if raw.get("attention_bias"):
        raise ConfigError("config.json: 'attention_bias' true is not supported")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"config.json: 'rope_parameters' must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"config.json: rope_type {rope_type!r} is not supported (only 'default')")


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"config.json: 'rope_theta' must be a positive number, got {theta!r}")
    return float(theta)


def _norm(raw: dict[str, Any]) -> tuple[str, float]:
    rms = raw.get("rms_norm_eps")
    if rms is not None:
        kind, eps, name = "rms", rms, "rms_norm_eps"
    else:
        kind, eps, name = "layer", raw.get("layer_norm_eps", 1e-5), "layer_norm_eps"
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ConfigError(f"config.json: '{name}' must be a positive number, got {eps!r}")
    return kind, float(eps)


def _mlp_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    explicit = raw.get("mlp_layer_types")
    if explicit is not None:
        if not isinstance(explicit, list) or len(explicit) != num_layers:
            raise ConfigError(
                f"config.json: 'mlp_layer_types' must list {num_layers} entries, got {explicit!r}"
            )
        bad = [t for t in explicit if t not in (DENSE, SPARSE)]
        if bad:
            raise ConfigError(f"config.json: 'mlp_layer_types' has unknown entries {bad}")
        return tuple(explicit)
    k = raw.get("first_k_dense_replace", 0) or 0
    if not isinstance(k, int) or not 0 <= k <= num_layers:
        raise ConfigError(f"config.json: 'first_k_dense_replace' must be in [0, {num_layers}], got {k!r}")
    return tuple(DENSE if i < k else SPARSE for i in range(num_layers))


def _layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    explicit = raw.get("layer_types")
    if explicit is not None:
        if not isinstance(explicit, list) or len(explicit) != num_layers:
            raise ConfigError(f"config.json: 'layer_types' must list {num_layers} entries, got {explicit!r}")
        bad = [t for t in explicit if t not in (FULL, SLIDING)]
        if bad:
            raise ConfigError(f"config.json: 'layer_types' has unknown entries {bad}")
        return tuple(explicit)
    # Derived exactly as the checkpoint's architecture does: the dense prefix follows its
    # own pattern, the remaining layers the main one (full on every pattern-th layer).
    k = raw.get("first_k_dense_replace", 0) or 0
    prefix_pattern = _positive_int(raw, "prefix_dense_sliding_window_pattern", default=1)
    pattern = _positive_int(raw, "sliding_window_pattern", default=4)
    prefix = [SLIDING if (i + 1) % prefix_pattern else FULL for i in range(k)]
    rest = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers - k)]
    return tuple(prefix + rest)
