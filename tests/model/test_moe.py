"""The grouped-GEMM expert path equals one GEMM per expert."""

import pytest
import torch

from northmk.model import reference
from northmk.model.reference import moe_experts, route, swiglu
from northmk.model.weights import to_tiled


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (37, 16, 4), (5, 64, 8)])
def test_grouped_experts_equal_the_per_expert_sum(tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens)
    h = torch.randn(tokens, 32, generator=gen)
    gate_up = torch.randn(experts, 48, 32, generator=gen) / 6
    down = torch.randn(experts, 32, 24, generator=gen) / 5
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, "sigmoid", False)
    want = torch.zeros_like(h)
    for t in range(tokens):
        for k in range(top_k):
            e = ids[t, k]
            want[t] += weights[t, k] * swiglu(h[t:t + 1], gate_up[e], down[e])[0]
    torch.testing.assert_close(moe_experts(h, weights, ids, gate_up, down), want, rtol=1e-5, atol=1e-5)


def test_the_per_expert_fallback_gives_the_same_result(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(11, 32, generator=gen)
    gate_up, down = torch.randn(6, 40, 32, generator=gen) / 6, torch.randn(6, 32, 20, generator=gen) / 5
    weights, ids = route(torch.randn(11, 6, generator=gen), 3, "softmax", False)
    grouped = moe_experts(h, weights, ids, gate_up, down)
    monkeypatch.setattr(reference, "_grouped_mm_supported", lambda *a: False)
    torch.testing.assert_close(moe_experts(h, weights, ids, gate_up, down), grouped, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens, top_k", [(1, 2), (29, 4)])
def test_experts_in_the_tiled_layout_give_the_same_result(tokens, top_k):
    gen = torch.Generator().manual_seed(tokens)
    h = torch.randn(tokens, 64, generator=gen)
    gate_up, down = torch.randn(8, 128, 64, generator=gen) / 8, torch.randn(8, 64, 64, generator=gen) / 8
    weights, ids = route(torch.randn(tokens, 8, generator=gen), top_k, "sigmoid", False)
    want = moe_experts(h, weights, ids, gate_up, down)
    got = moe_experts(h, weights, ids, to_tiled(gate_up), to_tiled(down), tiled=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
