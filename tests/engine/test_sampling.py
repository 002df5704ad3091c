"""The sampling pipeline: each processor against hand-computed values, then the draw."""

import math

import pytest
import torch

from northmk.engine.sampling import (
    RowSampler,
    apply_logit_bias,
    apply_min_p,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    sample_rows,
    suppress_tokens,
    token_logprob,
)
from northmk.engine.types import SamplingParams

NEG = float("-inf")


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def test_logit_bias_adds_to_named_tokens_only():
    assert apply_logit_bias(t(1, 2, 3), {0: 5.0, 2: -1.5}).tolist() == [6, 2, 1.5]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    out = apply_repetition_penalty(t(2, -2, 4, -1), [0, 1, 1], 2.0)
    assert out.tolist() == [1, -4, 4, -1]


def test_presence_and_frequency_penalties_count_generated_tokens():
    # token 1 seen twice, token 3 once: 1 -> 5 - (0.5 + 2*0.25), 3 -> 5 - (0.5 + 0.25)
    out = apply_presence_frequency(t(5, 5, 5, 5), [1, 3, 1], 0.5, 0.25)
    assert out.tolist() == [5, 4, 5, 4.25]


def test_suppress_tokens_sets_minus_infinity():
    assert suppress_tokens(t(1, 2, 3), [1]).tolist() == [1, NEG, 3]


def test_top_k_keeps_the_k_largest():
    assert apply_top_k(t(1, 4, 3, 2), 2).tolist() == [NEG, 4, 3, NEG]
    assert apply_top_k(t(1, 2), 0).tolist() == [1, 2]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = t(0.5, 0.3, 0.15, 0.05)
    logits = probs.log()
    kept = apply_top_p(logits.clone(), 0.7)
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    kept = apply_top_p(logits.clone(), 0.8)  # 0.5 + 0.3 reaches 0.8 exactly
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    kept = apply_top_p(logits.clone(), 0.01)  # the top token always survives
    assert torch.isfinite(kept).tolist() == [True, False, False, False]


def test_min_p_drops_tokens_below_fraction_of_top_probability():
    logits = t(0.5, 0.3, 0.15, 0.05).log()
    kept = apply_min_p(logits, 0.5)  # threshold 0.25
    assert torch.isfinite(kept).tolist() == [True, True, False, False]


def test_logprobs_are_raw_log_softmax_with_top_alternatives_best_first():
    logits = t(1.0, 3.0, 2.0)
    lp = torch.log_softmax(logits, -1)
    out = token_logprob(lp, 2, 2)
    assert out.token_id == 2 and out.logprob == pytest.approx(lp[2].item())
    assert [i for i, _ in out.top] == [1, 2]


def row(params, prompt=(), out=None, eos=(0,), index=0):
    return RowSampler.create(params, list(prompt), out if out is not None else [], eos, index)


def test_greedy_takes_argmax_after_processors():
    params = SamplingParams(temperature=0.0, logit_bias={0: 10.0})
    [(tok, lp)] = sample_rows(t(1, 5, 2).unsqueeze(0), [row(params)])
    assert tok == 0 and lp is None


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    logits = t(9, 8, 1).unsqueeze(0)
    outputs: list[int] = []
    r = row(params, out=outputs, eos=(0,))
    assert sample_rows(logits, [r])[0][0] == 2
    outputs.extend([2, 2])
    assert sample_rows(logits, [r])[0][0] == 0


def test_logprobs_ignore_penalties_and_bias():
    params = SamplingParams(temperature=0.0, logit_bias={2: 100.0}, logprobs=1)
    logits = t(1.0, 3.0, 2.0)
    [(tok, lp)] = sample_rows(logits.unsqueeze(0), [row(params)])
    raw = torch.log_softmax(logits, -1)
    assert tok == 2
    assert lp.logprob == pytest.approx(raw[2].item())
    assert lp.top[0] == (1, pytest.approx(raw[1].item()))


def test_user_logits_processor_masks_tokens():
    only_two = lambda out, lg: torch.where(torch.arange(lg.shape[0]) == 2, lg, torch.full_like(lg, NEG))
    params = SamplingParams(temperature=1.0, logits_processors=[only_two])
    r = row(params)
    toks = [sample_rows(t(5, 5, -5).unsqueeze(0), [r])[0][0] for _ in range(5)]
    assert toks == [2] * 5


def test_temperature_sampling_follows_the_distribution():
    params = SamplingParams(temperature=0.5, seed=0)
    r = row(params)
    logits = t(0.0, math.log(3.0)).unsqueeze(0)  # at T=0.5: p = 1:9
    draws = [sample_rows(logits, [r])[0][0] for _ in range(2000)]
    assert 0.87 < sum(draws) / len(draws) < 0.93


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=1234, top_p=0.9)

    def draws(batch_rows, which):
        return [sample_rows(logits[: len(batch_rows)], batch_rows)[which][0] for _ in range(20)]

    alone = draws([row(params)], 0)
    other = SamplingParams(temperature=1.3, seed=7)
    in_batch = draws([row(other), row(params), row(SamplingParams(temperature=1.0))], 1)
    # row 1 sees logits[1] in the batch; compare against it alone on the same logits
    alone_same_logits = [sample_rows(logits[1:2], [r])[0][0] for r in [row(params)] for _ in range(20)]
    assert alone == draws([row(params)], 0)
    assert in_batch == alone_same_logits


def test_choices_of_a_seeded_request_draw_distinct_streams():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=3)
    a = [sample_rows(logits, [r])[0][0] for r in [row(params, index=0)] for _ in range(10)]
    b = [sample_rows(logits, [r])[0][0] for r in [row(params, index=1)] for _ in range(10)]
    assert a != b
