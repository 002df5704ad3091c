"""config.json -> ModelConfig: every North field, both layouts, and clear errors."""

from __future__ import annotations

import json

import pytest

from northmk.checkpoint_writer import config_dict
from northmk.config import DENSE, FULL, SLIDING, SPARSE, ConfigError, ModelConfig


def north_raw(**overrides):
    raw = config_dict("north")
    raw.pop("layer_types")
    raw.pop("mlp_layer_types")
    raw.update(overrides)
    return raw


def test_north_geometry_derives_the_documented_layer_pattern():
    c = ModelConfig.from_dict(north_raw())
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2048, 49, 32, 4, 128)
    assert c.q_size == 4096 and c.gqa_group == 8
    assert [i for i, t in enumerate(c.layer_types) if t == FULL] == list(range(0, 49, 4))
    assert c.layer_types.count(SLIDING) == 36
    assert c.mlp_types[0] == DENSE and set(c.mlp_types[1:]) == {SPARSE}
    # RoPE on sliding layers and on the dense prefix (pattern 1): layer 0 rotated, other full layers not
    assert c.rope_layers[0] and not c.rope_layers[4] and c.rope_layers[1]
    assert c.norm_kind == "rms" and c.norm_eps == 1e-6
    assert c.expert_selection == "sigmoid" and not c.norm_topk_prob
    assert c.attention_groups == (FULL, SLIDING) and c.layers_per_group == (13, 36)


def test_north_active_parameter_count_matches_the_design_brief():
    c = ModelConfig.from_dict(north_raw())
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    active = c.num_params() - 48 * (c.num_experts - c.top_k) * per_expert
    assert abs(active - 3.305e9) / 3.305e9 < 0.01


def test_mlp_layer_types_form_equals_first_k_dense_replace_form():
    by_k = ModelConfig.from_dict(north_raw(first_k_dense_replace=1))
    explicit = north_raw(mlp_layer_types=["dense"] + ["sparse"] * 48, layer_types=list(by_k.layer_types))
    explicit.pop("first_k_dense_replace")
    assert ModelConfig.from_dict(explicit).mlp_types == by_k.mlp_types


def test_explicit_layer_types_win_over_the_pattern():
    types = ["sliding_attention"] * 48 + ["full_attention"]
    c = ModelConfig.from_dict(north_raw(layer_types=types))
    assert c.layer_types == tuple(types)
    assert c.layer_slot[48] == 0 and c.layer_group[48] == 0


def test_layer_norm_when_rms_eps_is_null():
    c = ModelConfig.from_dict(north_raw(rms_norm_eps=None, layer_norm_eps=1e-5))
    assert (c.norm_kind, c.norm_eps) == ("layer", 1e-5)


def test_rope_parameters_form_is_read():
    raw = north_raw(rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
    raw.pop("rope_theta")
    assert ModelConfig.from_dict(raw).rope_theta == 12345.0


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"num_attention_heads": 30}, "num_key_value_heads"),
        ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"layer_types": ["global"] * 49}, "layer_types"),
        ({"mlp_layer_types": ["moe"] * 49}, "mlp_layer_types"),
        ({"expert_selection_fn": "relu"}, "expert_selection_fn"),
        ({"shared_expert_combination_strategy": "max"}, "shared_expert_combination_strategy"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"model_type": "llama"}, "model_type"),
        ({"logit_scale": "big"}, "logit_scale"),
        ({"vocab_size": -5}, "vocab_size"),
        ({"head_dim": 127}, "head_dim"),
    ],
)
def test_broken_configs_fail_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(north_raw(**overrides))


def test_from_file_reports_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(north_raw()))
    assert ModelConfig.from_file(tmp_path).num_layers == 49
