"""The CPU twin of the GPU draw (northmk/engine/gpu_sampling.py): its filters against their
definitions written out by brute force, its randomness, its distribution, and which rows
may take the GPU path. tests/gpu/test_sampling.py holds the kernel to this twin."""

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from northmk.engine.gpu_sampling import (CUDA_CONSTANTS, MAX_GUMBEL, DrawParams, GpuSampler, det_exp, det_log,
                                         draw_key, draw_params, gumbel, kept_tokens, reference_draw, splitmix64)
from northmk.engine.sampling import RowSampler
from northmk.engine.types import SamplingParams

KERNEL = Path(__file__).resolve().parents[2] / "cuda" / "sample" / "sample.cu"
NEG = float("-inf")


def params(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0) -> DrawParams:
    return DrawParams(temperature, top_k, top_p, min_p, seed, counter)


def kept(logits: list[float], p: DrawParams) -> list[int]:
    return torch.nonzero(kept_tokens(torch.tensor([logits]), [p])[0]).squeeze(1).tolist()


def draws(logits: list[float], p: DrawParams, n: int) -> torch.Tensor:
    """Tokens of draws 0..n-1 of one sequence (p's seed) on the same logits."""
    rows = [dataclasses.replace(p, counter=c) for c in range(n)]
    return reference_draw(torch.tensor([logits]).expand(n, -1), rows)[0]


# ---- brute-force definitions, one token at a time, in float64 ----
def brute_kept(logits: list[float], p: DrawParams) -> set[int]:
    s = [x / p.temperature for x in logits]
    keep = set(range(len(s)))
    if 0 < p.top_k < len(s):
        kth = sorted(s, reverse=True)[p.top_k - 1]
        keep = {i for i in keep if s[i] >= kth}
    if p.top_p < 1:
        z = sum(math.exp(s[j]) for j in keep)
        keep = {i for i in keep if sum(math.exp(s[j]) for j in keep if s[j] > s[i]) / z < p.top_p}
    if p.min_p > 0:
        keep = {i for i in keep if s[i] >= max(s) + math.log(p.min_p)}
    return keep


def brute_probs(logits: list[float], p: DrawParams) -> list[float]:
    keep = brute_kept(logits, p)
    w = [math.exp(x / p.temperature) if i in keep else 0.0 for i, x in enumerate(logits)]
    return [v / sum(w) for v in w]


# ---- the shared arithmetic ----
def test_constants_are_those_of_the_kernel():
    source = KERNEL.read_text()
    found = dict(re.findall(r"\b(k[A-Z]\w*) = (-?[0-9][0-9a-fx.p+-]*)f\b", source))
    assert found.keys() >= CUDA_CONSTANTS.keys()
    for name, spelled in CUDA_CONSTANTS.items():
        parse = lambda v: float.fromhex(v) if "x" in v else float(v)
        assert parse(found[name]) == parse(spelled) == float(np.float32(parse(spelled))), name


def test_det_log_and_det_exp_are_accurate_float32():
    x = torch.from_numpy(np.geomspace(1e-44, 3e38, 50001).astype(np.float32))
    x = x[x > 0]
    exact = torch.log(x.double())
    assert ((det_log(x).double() - exact).abs() <= 3e-7 * exact.abs() + 1e-44).all()
    assert det_log(torch.tensor([1.0])).item() == 0.0
    u = torch.linspace(0.5, 1.0 - 2**-24, 20001)  # near 1 the result is tiny: relative accuracy
    assert (((det_log(u).double() - torch.log(u.double())) / torch.log(u.double())).abs() < 3e-7).all()
    d = torch.linspace(-28.0, 0.0, 100001)
    assert (((det_exp(d).double() - torch.exp(d.double())) / torch.exp(d.double())).abs() < 2e-7).all()
    assert det_exp(torch.tensor([0.0])).item() == 1.0


def test_splitmix64_matches_the_reference_stream_and_wraps():
    # the reference generator seeded with 1234567: x += golden ratio, then this mix, per output
    assert splitmix64(1234567) == 6457827717110365317
    z = np.array([0, 1, 1234567, (1 << 64) - 1], dtype=np.uint64)
    assert [int(v) for v in splitmix64(z)] == [splitmix64(int(v)) for v in z]
    assert draw_key(-1, 5) == draw_key((1 << 64) - 1, 5)  # seeds are taken mod 2^64


def test_gumbel_noise_is_bounded_and_gumbel_distributed():
    g = gumbel([draw_key(1, 2)], 1 << 20)[0].double()
    assert g.max() < MAX_GUMBEL and g.min() > -3.0
    assert g.mean().item() == pytest.approx(0.5772, abs=0.005)  # Euler-Mascheroni
    assert g.std().item() == pytest.approx(math.pi / math.sqrt(6), abs=0.005)
    top = -det_log(-det_log(torch.tensor([(2**23 - 0.5) * 2**-23])))  # the largest u
    assert 16.0 < top.item() < MAX_GUMBEL


# ---- filters against their definitions ----
TIES = [2.0, 1.0, 2.0, 0.5, 1.0, -1.0, 1.0, 3.0, -4.0, 0.0]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 9, 10, 11, 0, -1])
def test_top_k_keeps_every_token_tied_with_the_kth(k):
    p = params(top_k=k)
    assert set(kept(TIES, p)) == brute_kept(TIES, p)
    if k == 3:  # 3.0, 2.0, 2.0: the third is tied with the second
        assert kept(TIES, p) == [0, 2, 7]
    if k == 4:  # 1.0 is the fourth largest: all three ones stay
        assert kept(TIES, p) == [0, 1, 2, 4, 6, 7]


@pytest.mark.parametrize("top_p", [0.01, 0.3, 0.5, 0.6, 0.75, 0.8, 0.95, 0.999, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_top_p_keeps_the_tokens_with_less_than_top_p_mass_above(top_p, temperature):
    p = params(temperature=temperature, top_p=top_p)
    assert set(kept(TIES, p)) == brute_kept(TIES, p)
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(v) for v in probs]
    assert set(kept(logits, params(top_p=top_p))) == brute_kept(logits, params(top_p=top_p))


def test_top_p_counts_tied_tokens_together_and_always_keeps_the_top():
    logits = [math.log(v) for v in (0.4, 0.2, 0.2, 0.2)]
    # 0.4 above each 0.2: all three stay, though a sorted cumulative sum would keep one
    assert kept(logits, params(top_p=0.41)) == [0, 1, 2, 3]
    assert kept(logits, params(top_p=0.39)) == [0]
    assert kept(logits, params(top_p=1e-6)) == [0]
    assert kept([1.0, 1.0, 0.0], params(top_p=1e-6)) == [0, 1]  # tied tops: nothing above either


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.2, 0.37, 0.5, 1.0])
def test_min_p_keeps_tokens_within_log_min_p_of_the_top(min_p):
    for temperature in (1.0, 0.5):
        p = params(temperature=temperature, min_p=min_p)
        assert set(kept(TIES, p)) == brute_kept(TIES, p)
    assert kept(TIES, params(min_p=1.0)) == [7]


def test_filters_compose_in_order_top_k_top_p_min_p():
    rng = np.random.default_rng(0)
    for _ in range(200):
        logits = np.round(rng.normal(0, 2, 16), 1).tolist()  # rounding makes ties
        p = params(temperature=float(rng.uniform(0.3, 2.0)), top_k=int(rng.integers(0, 18)),
                   top_p=float(rng.choice([1.0, rng.uniform(0.05, 1.0)])),
                   min_p=float(rng.choice([0.0, rng.uniform(0.0, 0.5)])))
        assert set(kept(logits, p)) == brute_kept(logits, p), (logits, p)


def test_filters_match_their_definitions_at_full_vocabulary():
    logits = torch.randn(1, 262144, generator=torch.Generator().manual_seed(0)) * 3
    s = logits[0].double()
    for p in (params(top_k=40), params(top_p=0.9, temperature=0.7), params(min_p=0.1)):
        got = kept_tokens(logits, [p])[0]
        t = s / p.temperature
        if p.top_k:
            want = t >= torch.topk(t, p.top_k).values[-1]
        elif p.top_p < 1:
            probs = torch.softmax(t, 0)
            order = torch.argsort(t, descending=True)
            above = torch.zeros_like(probs)
            above[order] = torch.cumsum(probs[order], 0) - probs[order]  # no ties in random floats
            want = above < p.top_p
        else:
            want = t >= t.max() + math.log(p.min_p)
        assert torch.equal(got, want)


# ---- the draw ----
def test_same_seed_and_counter_draw_the_same_token_and_others_differ():
    logits = torch.zeros(1, 1000)
    one = lambda seed, counter: int(reference_draw(logits, [params(seed=seed, counter=counter)])[0][0])
    assert one(5, 9) == one(5, 9)
    assert len({one(5, c) for c in range(20)}) > 15
    assert len({one(s, 9) for s in range(20)}) > 15
    batch = reference_draw(logits.expand(3, -1), [params(seed=5, counter=9), params(seed=6), params(seed=5, counter=9)])
    assert batch[0][0] == batch[0][2] == one(5, 9)  # independent of what shares the batch


CASES = [
    params(temperature=1.0),
    params(temperature=0.6),
    params(temperature=1.5, top_k=4),
    params(temperature=1.2, top_p=0.7),
    params(temperature=1.0, min_p=0.15),
    params(temperature=0.9, top_k=6, top_p=0.85, min_p=0.05),
]


@pytest.mark.parametrize("p", CASES, ids=lambda p: f"T{p.temperature:.1f}-k{p.top_k}-p{p.top_p:.2f}-m{p.min_p:.2f}")
def test_draws_follow_the_filtered_softmax(p):
    logits = [1.2, 0.1, -1.0, 0.5, -0.3, 0.9, 0.0, 1.0, -2.0, 0.4, -0.6, 0.2]
    n = 3000
    freq = torch.bincount(draws(logits, p, n), minlength=len(logits)).double() / n
    for token, (f, q) in enumerate(zip(freq.tolist(), brute_probs(logits, p))):
        assert abs(f - q) <= 4.5 * math.sqrt(q * (1 - q) / n) + 1e-12, (token, f, q)  # q == 0: never drawn


def test_statistics_tell_a_wrong_temperature_apart():
    logits = [1.2, 0.1, -1.0, 0.5, -0.3, 0.9, 0.0, 1.0, -2.0, 0.4, -0.6, 0.2]
    freq = torch.bincount(draws(logits, params(temperature=0.6), 3000), minlength=12).double() / 3000
    wrong = brute_probs(logits, params(temperature=1.0))
    assert max(abs(f - q) / math.sqrt(q * (1 - q) / 3000) for f, q in zip(freq.tolist(), wrong)) > 4.5


def test_greedy_takes_the_lowest_id_of_the_raw_max_and_ignores_the_filters():
    logits = torch.tensor([[1.0, 3.0, float("nan"), 3.0, 2.0]])
    for p in (params(temperature=0.0), params(temperature=-1.0, top_k=1, min_p=1.0, top_p=0.1, seed=9, counter=4)):
        tokens, logprobs = reference_draw(logits, [p])
        assert tokens.tolist() == [1]
        clean = torch.tensor([1.0, 3.0, NEG, 3.0, 2.0])
        assert logprobs[0].item() == pytest.approx(torch.log_softmax(clean, 0)[1].item(), abs=1e-6)


def test_logprob_is_the_raw_log_softmax_whatever_the_temperature():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    ps = [params(temperature=t, seed=i) for i, t in enumerate((0.3, 1.0, 2.0, 0.0))]
    tokens, logprobs = reference_draw(logits, ps)
    want = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs.double(), want, atol=1e-6)


def test_masked_and_nan_logits_are_never_drawn():
    logits = torch.tensor([[NEG, 0.0, float("nan"), 0.0, NEG]]).expand(200, -1)
    tokens = reference_draw(logits, [params(seed=1, counter=c) for c in range(200)])[0]
    assert set(tokens.tolist()) == {1, 3}
    only_neg = torch.full((1, 4), NEG)
    assert reference_draw(only_neg, [params(top_p=0.5, min_p=0.5)])[0].tolist() == [0]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="float32 logits"):
        reference_draw(torch.zeros(2, 5), [params()])
    with pytest.raises(ValueError, match="float32 logits"):
        reference_draw(torch.zeros(1, 5, dtype=torch.float64), [params()])
    for bad, match in ((dict(temperature=float("nan")), "temperature"), (dict(temperature=1e39), "temperature"),
                       (dict(temperature=1e-39), "temperature"),
                       (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(min_p=-0.1), "min_p"),
                       (dict(min_p=float("nan")), "min_p"), (dict(top_k=1 << 31), "top_k"),
                       (dict(counter=-1), "counter")):
        with pytest.raises(ValueError, match=match):
            params(**bad)
    with pytest.raises(ValueError, match="CUDA device"):
        GpuSampler("cpu")


def test_draw_params_are_float32_values():
    p = params(temperature=0.1, top_p=0.9, min_p=0.05)
    assert (p.temperature, p.top_p, p.min_p) == tuple(float(np.float32(v)) for v in (0.1, 0.9, 0.05))


# ---- which rows the GPU may draw ----
def sampler(out=(), choice=0, **kw) -> RowSampler:
    return RowSampler.create(SamplingParams(**kw), [1, 2, 3], list(out), (0,), choice)


def test_plain_rows_draw_on_the_gpu_with_their_seed_and_position():
    row = sampler(out=[5, 6], temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=11, logprobs=0)
    got = draw_params(row)
    assert got == DrawParams(0.7, 20, 0.9, 0.02, 11, 2)
    assert draw_params(sampler(temperature=0.0)).temperature == 0.0
    assert draw_params(sampler(seed=11, choice=2)).seed == 13
    assert draw_params(sampler(min_tokens=2, out=[4, 4])) is not None  # suppression over


@pytest.mark.parametrize("host_only", [
    dict(logit_bias={3: 1.0}), dict(repetition_penalty=1.1), dict(presence_penalty=0.5),
    dict(frequency_penalty=-0.5), dict(min_tokens=3), dict(logits_processors=[lambda out, lg: lg]),
    dict(logprobs=2), dict(temperature=1e-39),
])
def test_rows_needing_host_processing_stay_on_the_host(host_only):
    assert draw_params(sampler(out=[7], **host_only)) is None


def test_unseeded_rows_get_a_random_seed_once():
    a, b = sampler(), sampler()
    assert a.seed != b.seed and 0 <= a.seed < 1 << 63
    assert draw_params(a).seed == draw_params(a).seed == a.seed
