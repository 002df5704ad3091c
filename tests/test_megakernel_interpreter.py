"""The megakernel's instruction stream, interpreted on the CPU: the host-built schedule
computes the reference's decode step, layer by layer."""

from __future__ import annotations

import pytest
import torch

from northmk.checkpoint import synthetic_weights
from northmk.config import PAGE_SIZE, ModelConfig
from northmk.megakernel import Schedule
from northmk.megakernel_interpreter import run_schedule
from northmk.megakernel_oracle import AGREE, AGREE_LAYER, cosine, first_divergence, layer_report, reference_step
from northmk.model.kv import BatchLayout, PagedKVCache


@pytest.fixture(scope="module")
def small():
    """The narrowest geometry the kernel takes (head_dim 128, hidden a multiple of 256), full
    and sliding layers, a dense first layer and routed experts."""
    config = ModelConfig.from_dict({
        "model_type": "cohere2_moe", "hidden_size": 256, "num_hidden_layers": 5, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 128, "vocab_size": 512, "num_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 64, "prefix_dense_intermediate_size": 128, "first_k_dense_replace": 1,
        "sliding_window": 64, "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "expert_selection_fn": "sigmoid",
        "norm_topk_prob": False, "logit_scale": 1.0, "tie_word_embeddings": True,
    })
    return config, synthetic_weights(config, torch.bfloat16, "cpu", seed=11)


def cache(config, contexts, seed=3):
    per_row = -(-max(contexts) // PAGE_SIZE)
    kv = PagedKVCache(config, [len(contexts) * per_row] * len(config.attention_groups), torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for pages in kv.pages:
        pages.normal_(generator=gen)
    table = torch.arange(len(contexts) * per_row, dtype=torch.int32).flip(0).view(len(contexts), per_row)
    return kv, [table.clone() for _ in kv.pages]


def copy(config, kv):
    out = PagedKVCache(config, kv.num_pages, torch.bfloat16, "cpu")
    for a, b in zip(out.pages, kv.pages):
        a.copy_(b)
    return out


CONTEXTS = [1, 63, 64, 65, 200]
TOKENS = torch.tensor([5, 77, 300, 2, 511])


def interpret(config, weights, schedule_lens, num_sms=7):
    kv, tables = cache(config, CONTEXTS)
    before = copy(config, kv)
    schedule = Schedule(config, num_sms, schedule_lens)
    positions = [c - 1 for c in CONTEXTS]
    logits, trace = run_schedule(config, weights, schedule, TOKENS, positions, tables, kv)
    return logits, trace, kv, before, BatchLayout([1] * len(CONTEXTS), positions, tables)


def test_the_schedule_computes_the_reference_step_layer_by_layer(small):
    config, weights = small
    logits, trace, kv, before, layout = interpret(config, weights, CONTEXTS)
    oracle = reference_step(config, weights, TOKENS, layout, copy(config, before), trace=trace)
    assert not oracle.routing_errors, oracle.routing_errors[:3]
    assert first_divergence(layer_report(trace, oracle)) is None
    for r in range(len(CONTEXTS)):
        assert cosine(logits[r], oracle.logits[r]) >= AGREE
    local = reference_step(config, weights, TOKENS, layout, before, trace=trace, teacher=True)
    assert first_divergence(layer_report(trace, local), AGREE_LAYER) is None
    for layer in range(config.num_layers):  # k, v of the new tokens landed where the reference puts them
        a, b = kv.layer_view(layer).clone(), before.layer_view(layer).clone()
        for r, pos in enumerate(layout.start_positions):
            page, slot = layout.block_tables[config.layer_group[layer]][r, pos // PAGE_SIZE].item(), pos % PAGE_SIZE
            assert cosine(a[page, :, :, slot], b[page, :, :, slot]) >= AGREE_LAYER, (layer, r)
            a[page, :, :, slot] = b[page, :, :, slot] = 0
        assert torch.equal(a, b), layer


def test_a_schedule_sized_for_longer_contexts_gives_the_same_step(small):
    config, weights = small
    exact, *_ = interpret(config, weights, CONTEXTS)
    bucketed, *_ = interpret(config, weights, [256] * len(CONTEXTS), num_sms=13)
    assert torch.allclose(exact, bucketed, atol=1e-2, rtol=0)
    assert torch.equal(exact.argmax(-1), bucketed.argmax(-1))


def test_a_wait_nobody_can_satisfy_is_a_deadlock(small):
    config, weights = small
    kv, tables = cache(config, CONTEXTS)
    schedule = Schedule(config, 3, CONTEXTS)
    first_waiting = int((schedule.tasks["wait"] >= 0).argmax())
    schedule.tasks[first_waiting]["target"] += 1
    with pytest.raises(RuntimeError, match="deadlock"):
        run_schedule(config, weights, schedule, TOKENS, [c - 1 for c in CONTEXTS], tables, kv)
