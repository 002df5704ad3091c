"""The megakernel's oracle on the CPU: it is the reference step, it accepts a kernel's expert
choice only within bf16 noise of the top-k on the kernel's own input, and its per-layer
report finds the first divergence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from northmk.checkpoint import synthetic_weights
from northmk.checkpoint_writer import config_dict
from northmk.config import PAGE_SIZE, ModelConfig
from northmk.megakernel import MegakernelTrace
from northmk.megakernel_oracle import (LOGIT_NOISE, clear_argmax, expert_sum, first_divergence, layer_report,
                                      post_scaled, reference_step, tie_band)
from northmk.model.kv import BatchLayout, PagedKVCache
from northmk.model.reference import ReferenceModel, rms_norm, swiglu
from northmk.model.weights import to_tiled


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_dict(config_dict("tiny"))
    return config, synthetic_weights(config, dtype=torch.bfloat16, seed=5)


def cache_and_layout(config, contexts, seed=0):
    per_row = -(-max(contexts) // PAGE_SIZE)
    kv = PagedKVCache(config, [len(contexts) * per_row] * len(config.attention_groups), torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for pages in kv.pages:
        pages.normal_(generator=gen)
    table = torch.arange(len(contexts) * per_row, dtype=torch.int32).view(len(contexts), per_row)
    layout = BatchLayout([1] * len(contexts), [c - 1 for c in contexts], [table] * len(kv.pages))
    return kv, layout


def copy(config, kv):
    out = PagedKVCache(config, kv.num_pages, torch.bfloat16, "cpu")
    for a, b in zip(out.pages, kv.pages):
        a.copy_(b)
    return out


def sparse_layer(config):
    return next(i for i, t in enumerate(config.mlp_types) if t != "dense")


def test_unguided_oracle_is_the_reference_step(tiny):
    config, weights = tiny
    kv, layout = cache_and_layout(config, [3, 70])
    tokens = torch.tensor([4, 9])
    want = ReferenceModel(config, weights).step(tokens, layout, copy(config, kv))
    for fp32_sums in (False, True):  # the same step up to rounding, whichever kernels sum
        got = reference_step(config, weights, tokens, layout, copy(config, kv), fp32_sums=fp32_sums)
        assert not got.routing_errors
        assert torch.nn.functional.cosine_similarity(got.logits, want, dim=-1).min() > 0.9999
        assert torch.equal(got.logits.argmax(-1), want.argmax(-1))
    assert got.x.shape == (config.num_layers + 1, 2, config.hidden_size)
    assert torch.equal(got.x[0], weights.embed[tokens].float())
    assert (got.experts[sparse_layer(config)] >= 0).all()
    assert (got.experts[[i for i, t in enumerate(config.mlp_types) if t == "dense"]] == -1).all()


def test_a_kernel_routing_outside_the_noise_is_reported(tiny):
    config, weights = tiny
    kv, layout = cache_and_layout(config, [5])
    tokens = torch.tensor([7])
    own = reference_step(config, weights, tokens, layout, copy(config, kv))
    layer = sparse_layer(config)
    wrong = own.experts.clone()
    unpicked = [e for e in range(config.num_experts) if e not in own.experts[layer, 0].tolist()]
    wrong[layer, 0, 0] = unpicked[-1]
    wrong[layer, 0] = wrong[layer, 0].sort().values
    trace = MegakernelTrace(own.x, own.attn, own.mlp, wrong)
    guided = reference_step(config, weights, tokens, layout, kv, trace=trace)
    assert len(guided.routing_errors) >= 1 and f"layer {layer} row 0" in guided.routing_errors[0]


def test_a_kernel_routing_within_the_noise_is_followed(tiny, monkeypatch):
    config, weights = tiny
    kv, layout = cache_and_layout(config, [5])
    tokens = torch.tensor([7])
    layer = sparse_layer(config)
    own = reference_step(config, weights, tokens, layout, copy(config, kv))
    h = ReferenceModel(config, weights).norm(own.x[layer].to(torch.bfloat16), weights.layers[layer].norm)
    logits = (h @ weights.layers[layer].router.T).float()[0]
    order = logits.argsort(descending=True)
    swapped = own.experts.clone()  # the k-th expert swapped for the (k+1)-th
    swapped[layer, 0] = torch.cat((order[:config.top_k - 1], order[config.top_k:config.top_k + 1])).sort().values
    monkeypatch.setattr("northmk.megakernel_oracle.ROUTER_NOISE", 1e9)  # any gap counts as noise
    guided = reference_step(config, weights, tokens, layout, kv, trace=MegakernelTrace(own.x, own.attn, own.mlp, swapped))
    assert not guided.routing_errors
    assert torch.equal(guided.experts[layer], swapped[layer])


def test_the_report_names_the_first_layer_that_diverges(tiny):
    config, weights = tiny
    kv, layout = cache_and_layout(config, [2, 9])
    tokens = torch.tensor([1, 2])
    oracle = reference_step(config, weights, tokens, layout, kv)
    trace = MegakernelTrace(oracle.x.clone(), oracle.attn.clone(), oracle.mlp.clone(), oracle.experts.clone())
    assert first_divergence(layer_report(trace, oracle)) is None
    trace.mlp[2] = torch.randn_like(trace.mlp[2])  # layer 1's mlp output is wrong
    trace.x[2:] = torch.randn_like(trace.x[2:])
    assert first_divergence(layer_report(trace, oracle)).startswith("layer 1 mlp")


def test_a_teacher_trace_measures_each_layer_alone(tiny):
    config, weights = tiny
    kv, layout = cache_and_layout(config, [4])
    tokens = torch.tensor([3])
    oracle = reference_step(config, weights, tokens, layout, copy(config, kv))
    trace = MegakernelTrace(oracle.x.clone(), oracle.attn.clone(), oracle.mlp.clone(), oracle.experts.clone())
    trace.x[1] += 0.5  # a wrong residual entering layer 1: layer 1 alone still agrees with itself
    local = reference_step(config, weights, tokens, layout, kv, trace=trace, teacher=True)
    assert torch.equal(local.x[0], trace.x[0])
    assert not torch.allclose(local.attn[2], oracle.attn[2])  # layer 1 ran on the teacher's input


def test_routing_is_judged_on_the_kernels_own_input(tiny):
    config, weights = tiny
    kv, layout = cache_and_layout(config, [6])
    tokens = torch.tensor([2])
    layer = sparse_layer(config)
    own = reference_step(config, weights, tokens, layout, copy(config, kv))
    drifted = own.x.clone()
    drifted[layer] += torch.randn(drifted[layer].shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    h = ReferenceModel(config, weights).norm(drifted[layer].to(torch.bfloat16), weights.layers[layer].norm)
    theirs = own.experts.clone()
    theirs[layer] = (h @ weights.layers[layer].router.T).float().topk(config.top_k).indices.sort().values
    assert not torch.equal(theirs[layer], own.experts[layer])  # the drift changed the top-k
    guided = reference_step(config, weights, tokens, layout, kv, trace=MegakernelTrace(drifted, own.attn, own.mlp, theirs))
    assert not guided.routing_errors
    assert torch.equal(guided.experts[layer], theirs[layer])


@pytest.mark.parametrize("tiled", [False, True])
def test_experts_are_added_one_at_a_time_in_ascending_id(tiny, tiled):
    config, weights = tiny
    layer = weights.layers[sparse_layer(config)]
    if tiled:  # the same experts held in the tiled layout (as the megakernel holds them)
        layer = dataclasses.replace(layer, experts_gate_up=to_tiled(layer.experts_gate_up),
                                    experts_down=to_tiled(layer.experts_down), experts_tiled=True)
    h = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    experts = torch.tensor([[3, 0], [1, 3], [2, 0]])[:, :config.top_k]
    w = torch.rand(3, config.top_k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = torch.zeros_like(h)
    for e in sorted(set(experts.flatten().tolist())):  # bf16 rounding after every expert's add
        for t, k in zip(*(experts == e).nonzero(as_tuple=True)):
            y = swiglu(h[t:t + 1], *weights.layers[sparse_layer(config)].expert(e)) * w[t, k]
            want[t] = (want[t].float() + y[0].float()).to(torch.bfloat16)
    got = expert_sum(h, w, experts, layer)
    assert torch.equal(got, want)


def test_an_argmax_two_bf16_spacings_ahead_is_a_tie():
    # Top logit 9.1875 (bf16 spacing 0.0625 in [8, 16)): the band is 1% of it plus 0.125.
    logits = torch.tensor([9.1875, 9.0625, -3.0, 1.0], dtype=torch.bfloat16).float()
    assert tie_band(logits) == pytest.approx(LOGIT_NOISE * 9.1875 + 0.125)
    assert not clear_argmax(logits)
    logits[1] = 8.9375  # 0.25 behind: clear
    assert clear_argmax(logits)
    # The band scales with the top logit's binade, not the largest magnitude's.
    low = torch.tensor([0.75, 0.5, -20.0])
    assert tie_band(low) == pytest.approx(LOGIT_NOISE * 20.0 + 2 * 2.0**-8)


def test_post_scaled_projections_apply_the_rms_to_the_gemvs_sums():
    """Up to two rows the kernel's QKV and ROUTER tasks multiply bf16(x * norm) by the weights
    and the fp32 sums by each row's rms: within half a bf16 ulp of the exact product, and not
    the normed input's GEMV (which rounds x * rms first) bit for bit."""
    gen = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(2, 512, generator=gen)).to(torch.bfloat16)
    norm = (1 + 0.2 * torch.randn(512, generator=gen)).to(torch.bfloat16)
    w = torch.randn(256, 512, generator=gen).to(torch.bfloat16)
    got = post_scaled(x, norm, w, 1e-6)
    xd = x.double()
    exact = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * ((xd * norm.double()).to(torch.bfloat16).double()
                                                                    @ w.double().T)
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs())) - 7)
    assert ((got.double() - exact).abs() <= 0.5 * ulp + 1e-4 * exact.abs()).all()
    normed = (rms_norm(x, norm, 1e-6).float() @ w.float().T).to(torch.bfloat16)
    assert not torch.equal(got, normed)
    assert torch.nn.functional.cosine_similarity(got.float(), normed.float(), dim=-1).min() > 0.9999
