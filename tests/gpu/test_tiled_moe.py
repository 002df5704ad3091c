"""The experts' grouped GEMM on the tiled layout (model.tiled_moe, Triton) against torch's
grouped GEMM on the same experts row-major, at North Mini Code's expert shapes."""

from __future__ import annotations

import pytest
import torch

from northmk.model.reference import moe_experts, route
from northmk.model.weights import to_tiled

EXPERTS, HIDDEN, INTER = 128, 2048, 768


@pytest.fixture(scope="module")
def experts():
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16) / 45
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen).to(torch.bfloat16) / 28
    return gate_up, down, to_tiled(gate_up), to_tiled(down)


def grouped_reference(x, counts, w):
    offsets = counts.cumsum(0).to(torch.int32)
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)


def assert_near(got, want):
    # fp32 sums in another order, each rounded to bf16: a bf16 spacing or two of the largest
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1e-2 * want.float().abs().max().item(), err


@pytest.mark.parametrize("rows_per_expert", ["one row", "ragged", "skewed", "many"])
def test_grouped_gemm_on_tiled_experts_equals_torchs_on_row_major(experts, rows_per_expert):
    from northmk.model.tiled_moe import grouped_gemm_tiled

    gate_up, down, gate_up_t, down_t = experts
    gen = torch.Generator().manual_seed(1)
    counts = {"one row": torch.zeros(EXPERTS, dtype=torch.int64).index_fill_(0, torch.tensor([5]), 1),
              "ragged": torch.randint(0, 40, (EXPERTS,), generator=gen),
              "skewed": torch.tensor([0] * 64 + [700] + [0] * 62 + [3]),
              "many": torch.full((EXPERTS,), 130)}[rows_per_expert].cuda()
    rows = int(counts.sum())
    x = torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16)
    assert_near(grouped_gemm_tiled(x, counts, gate_up_t), grouped_reference(x, counts, gate_up))
    a = torch.randn(rows, INTER, device="cuda").to(torch.bfloat16)
    assert_near(grouped_gemm_tiled(a, counts, down_t), grouped_reference(a, counts, down))
    gate_and_up = torch.randn(rows, 2 * INTER, device="cuda").to(torch.bfloat16)
    gate, up = gate_and_up.chunk(2, dim=-1)
    assert_near(grouped_gemm_tiled(gate_and_up, counts, down_t, swiglu=True),
                grouped_reference(torch.nn.functional.silu(gate) * up, counts, down))


@pytest.mark.parametrize("tokens", [1, 9, 600])
def test_moe_on_tiled_experts_equals_the_row_major_moe(experts, tokens):
    gate_up, down, gate_up_t, down_t = experts
    h = torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16)
    weights, ids = route(torch.randn(tokens, EXPERTS, device="cuda"), 8, "sigmoid", False)
    weights = weights.to(torch.bfloat16)
    want = moe_experts(h, weights, ids, gate_up, down)
    assert_near(moe_experts(h, weights, ids, gate_up_t, down_t, tiled=True), want)


def test_wrong_shapes_are_refused(experts):
    from northmk.model.tiled_moe import grouped_gemm_tiled

    _, _, gate_up_t, _ = experts
    with pytest.raises(ValueError, match="do not match"):
        grouped_gemm_tiled(torch.zeros(4, HIDDEN + 32, device="cuda", dtype=torch.bfloat16),
                           torch.zeros(EXPERTS, device="cuda", dtype=torch.int64), gate_up_t)
