"""Checkpoint loading: layouts, dtypes, and errors that name the bad tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from northmk.checkpoint import CheckpointError, load_checkpoint, synthetic_weights
from northmk.checkpoint_writer import config_dict, write_weights
from northmk.config import ModelConfig


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_dict(config_dict("tiny", num_shared_experts=1))
    return config, synthetic_weights(config, dtype=torch.float32, seed=3)


def write(directory, config, weights, **kwargs):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.raw))
    write_weights(directory, config, weights, kwargs.pop("dtype", torch.float32), **kwargs)
    return directory


def assert_same_weights(a, b):
    assert torch.equal(a.embed, b.embed) and torch.equal(a.final_norm, b.final_norm)
    for la, lb in zip(a.layers, b.layers):
        ta, tb = la.tensors(), lb.tensors()
        assert ta.keys() == tb.keys()
        for k in ta:
            assert torch.equal(ta[k], tb[k]), k


@pytest.mark.parametrize("layout", [dict(), dict(shards=3), dict(fused_experts=True), dict(shards=2, fused_experts=True)])
def test_every_layout_round_trips(tmp_path, tiny, layout):
    config, weights = tiny
    write(tmp_path, config, weights, **layout)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (layout.get("shards", 1) > 1)
    loaded_config, loaded = load_checkpoint(tmp_path)
    assert loaded_config == config
    assert_same_weights(loaded, weights)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_stored_dtype_is_converted_to_the_requested_one(tmp_path, tiny, stored):
    config, weights = tiny
    write(tmp_path, config, weights, dtype=stored)
    _, as_bf16 = load_checkpoint(tmp_path, dtype="bfloat16")
    _, as_fp32 = load_checkpoint(tmp_path, dtype=torch.float32)
    assert as_bf16.embed.dtype == torch.bfloat16 and as_fp32.layers[1].experts_down.dtype == torch.float32
    torch.testing.assert_close(as_fp32.embed, weights.embed.to(stored).float())


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path, tiny):
    config, weights = tiny
    write(tmp_path, config, weights)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.9.self_attn.q_proj.weight"] = torch.zeros(2, 2)
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert "missing tensors: model.layers.2.mlp.experts.3.up_proj.weight" in message
    assert "unexpected tensors: model.layers.9.self_attn.q_proj.weight" in message
    assert "model.layers.1.self_attn.o_proj.weight has shape [3, 3], expected [64, 64]" in message


def test_broken_directories_fail_clearly(tmp_path, tiny):
    config, _ = tiny
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps(config.raw))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard-9.safetensors"}}))
    with pytest.raises(CheckpointError, match="shard-9.safetensors"):
        load_checkpoint(tmp_path)


def test_synthetic_weights_are_deterministic_and_shaped_for_any_geometry():
    config = ModelConfig.from_dict(config_dict("tiny", hidden_size=80, num_experts=5, vocab_size=700))
    a = synthetic_weights(config, dtype=torch.bfloat16, seed=7)
    b = synthetic_weights(config, dtype=torch.bfloat16, seed=7)
    assert_same_weights(a, b)
    assert a.layers[1].experts_gate_up.shape == (5, 2 * config.moe_intermediate_size, 80)
    assert a.embed.dtype == torch.bfloat16 and a.lm_head is None
