"""Sampling on the GPU (one nmk_sample launch per step) and its exact CPU twin.

    draw_params(row) -> DrawParams | None       None: the row needs the host path (sampling.py)
    GpuSampler(device).draw(logits, params)     tokens int32 [B], logprobs float32 [B] on the device
    reference_draw(logits, params)              the same draw on the CPU: the kernel's oracle
    kept_tokens(logits, params)                 bool [B, V]: what the filters leave to each row

The draw (cuda/sample/sample.cu): s_i = logit_i * (1 / temperature) (NaN logits count as -inf);
top_k, top_p and min_p each keep the tokens with s at or above a threshold:
    top_k   the k-th largest s (ties all kept)
    top_p   the smallest kept s whose kept mass strictly above is < top_p, masses being the
            integers trunc(exp(s - max s) * 2^39) (0 below exp(-28)), so sums are exact
    min_p   max s + log(min_p)
and the token is the argmax over kept i of s_i + gumbel_i (lowest id on ties), gumbel_i a
hash of (seed, counter, i). Everything deciding the token is correctly rounded fp32 + - * /
(log and exp below are built from them), so the twin equals the kernel bit for bit; the
logprob (raw log-softmax of the chosen token) agrees to float accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from ..native.sample import MAX_ROWS, MAX_VOCAB, SampleRow, rows_array, sample
from .sampling import RowSampler

F32 = torch.float32
U64 = (1 << 64) - 1
MIN_TEMPERATURE = 2.0**-126  # the least positive temperature (FLT_MIN): 1 / it is finite in fp32

# The fp32 constants of cuda/sample/sample.cu, spelled as there (a test compares the two).
CUDA_CONSTANTS = {
    "kLn2": "0x1.62e430p-1", "kLog2e": "0x1.715476p+0", "kLn2Hi": "0x1.62e000p-1", "kLn2Lo": "0x1.0bfbe8p-15",
    "kInv3": "0x1.555556p-2", "kInv5": "0x1.99999ap-3", "kInv7": "0x1.24924ap-3", "kInv9": "0x1.c71c72p-4",
    "kInv6": "0x1.555556p-3", "kInv24": "0x1.555556p-5", "kInv120": "0x1.111112p-7",
    "kInv720": "0x1.6c16c2p-10", "kInv5040": "0x1.a01a02p-13", "kMassScale": "0x1p39",
    "kMassCut": "-28.0", "kMaxGumbel": "17.0",
}
_C = {name: float.fromhex(v) if "x" in v else float(v) for name, v in CUDA_CONSTANTS.items()}
MASS_CUT, MASS_SCALE, MAX_GUMBEL = _C["kMassCut"], _C["kMassScale"], _C["kMaxGumbel"]


# ---- the deterministic math (each line one correctly rounded fp32 operation per element) ----
def det_log(x: torch.Tensor) -> torch.Tensor:
    """log(x) for finite x > 0 (float32): x = 2^k m, log m = 2 atanh((m - 1) / (m + 1))."""
    sub = x < 2.0**-126
    x = torch.where(sub, x * 2.0**24, x)
    b = x.view(torch.int32) - 0x3F3504F3
    k = torch.where(sub, -24, 0).to(torch.int32) + (b >> 23)
    f = ((b & 0x007FFFFF) + 0x3F3504F3).view(F32) - 1.0
    s = f / (2.0 + f)
    z = s * s
    p = _C["kInv7"] + z * _C["kInv9"]
    p = _C["kInv5"] + z * p
    p = _C["kInv3"] + z * p
    p = 1.0 + z * p
    return k.to(F32) * _C["kLn2"] + (2.0 * s) * p


def det_exp(d: torch.Tensor) -> torch.Tensor:
    """exp(d) for d in [MASS_CUT, 0] (float32)."""
    n = torch.round(d * _C["kLog2e"])  # half to even, like rintf
    r = (d - n * _C["kLn2Hi"]) - n * _C["kLn2Lo"]
    p = _C["kInv720"] + r * _C["kInv5040"]
    for c in (_C["kInv120"], _C["kInv24"], _C["kInv6"], 0.5, 1.0, 1.0):
        p = c + r * p
    return p * ((n.to(torch.int32) + 127) << 23).view(F32)


def token_mass(d: torch.Tensor) -> torch.Tensor:
    """int64 top_p weights of tokens at d = s - max s."""
    keep = d >= MASS_CUT
    e = det_exp(torch.where(keep, d, torch.zeros_like(d)))
    return torch.where(keep, (e * MASS_SCALE).to(torch.int64), 0)


def splitmix64(z):
    """splitmix64 on a Python int or a numpy uint64 array (wrapping)."""
    if isinstance(z, int):
        z = (z + 0x9E3779B97F4A7C15) & U64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
        return z ^ (z >> 31)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draw_key(seed: int, counter: int) -> int:
    return splitmix64((seed & U64) ^ splitmix64(counter & U64))


def gumbel(keys: list[int], vocab: int) -> torch.Tensor:
    """float32 [len(keys), vocab]: -log(-log(u)), u = (23 bits of splitmix64(key ^ i) + 1/2) / 2^23."""
    h = splitmix64(np.array(keys, dtype=np.uint64)[:, None] ^ np.arange(vocab, dtype=np.uint64))
    u = torch.from_numpy((h >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) * 2.0**-23
    return -det_log(-det_log(u))


# ---- parameters ----------------------------------------------------------------------------
def _f32(x: float) -> float:
    with np.errstate(over="ignore"):  # beyond float32: inf, refused where it matters
        return float(np.float32(x))


@dataclass(frozen=True)
class DrawParams:
    """One row of nmk_sample: temperature <= 0 is greedy; top_k <= 0, top_p == 1, min_p == 0 are off.
    temperature, top_p and min_p are kept as their float32 values."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    counter: int  # tokens the sequence generated before this draw

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p"):  # the fp32 values the kernel sees
            object.__setattr__(self, name, _f32(getattr(self, name)))
        if not (math.isfinite(self.temperature) and (self.temperature <= 0 or self.temperature >= MIN_TEMPERATURE)):
            raise ValueError(f"temperature must be <= 0 (greedy) or in [{MIN_TEMPERATURE}, inf), "
                             f"got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -(1 << 31) <= self.top_k < 1 << 31:
            raise ValueError(f"top_k must fit in int32, got {self.top_k}")
        if not 0 <= self.counter <= U64:
            raise ValueError(f"counter must be in [0, 2^64), got {self.counter}")

    def native(self) -> SampleRow:
        return SampleRow(self.temperature, self.top_k, self.top_p, self.min_p, self.seed & U64, self.counter)


def draw_params(row: RowSampler, ahead: int = 0) -> DrawParams | None:
    """The GPU draw of the row's next token (with ahead = 1, of the token after it), or None
    when it needs the host path: logit_bias, penalties, min_tokens still suppressing stops,
    logits processors (grammars), top logprobs (and a positive temperature below
    MIN_TEMPERATURE)."""
    p = row.params
    generated = len(row.output_ids) + ahead
    if (p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
            or generated < p.min_tokens or p.logits_processors or (p.logprobs or 0) > 0
            or 0 < p.temperature < MIN_TEMPERATURE):
        return None
    return DrawParams(p.temperature, p.top_k, p.top_p, p.min_p, row.seed, generated)


# ---- the CPU twin --------------------------------------------------------------------------
def _top_p_cut(s: torch.Tensor, mass: torch.Tensor, cut: float, top_p: float) -> float:
    keep = s >= cut
    kept, mass = s[keep], mass[keep]
    total = int(mass.sum())
    if total == 0:
        return float(s.max())
    limit = math.ceil(Fraction(top_p) * total)
    values, inverse = torch.unique(kept, return_inverse=True)  # ascending
    above = total - torch.cumsum(torch.zeros(len(values), dtype=torch.int64).scatter_add_(0, inverse, mass), 0)
    return float(values[above < limit][0])


def _cuts(s: torch.Tensor, max_s: torch.Tensor, params: list[DrawParams]) -> torch.Tensor:
    """Per row of s [R, V], the threshold: tokens with s >= it are kept."""
    mass = token_mass(s - max_s[:, None]) if any(p.top_p < 1.0 for p in params) else None
    min_cut = max_s + det_log(torch.tensor([p.min_p if p.min_p > 0 else 1.0 for p in params]))
    cuts = []
    for j, p in enumerate(params):
        cut = float("-inf")
        if 0 < p.top_k < s.shape[1]:
            cut = float(torch.topk(s[j], p.top_k).values[-1])
        if p.top_p < 1.0:
            cut = max(cut, _top_p_cut(s[j], mass[j], cut, p.top_p))
        if p.min_p > 0:
            cut = max(cut, float(min_cut[j]))
        cuts.append(cut)
    return torch.tensor(cuts)


def _first_max(x: torch.Tensor) -> torch.Tensor:
    """Per row of x [B, V], the lowest index holding the row's max."""
    return torch.argmax((x == x.max(dim=1, keepdim=True).values).to(torch.uint8), dim=1)


def _filtered(logits: torch.Tensor, params: list[DrawParams]):
    """-> (x: the logits on the CPU with NaN as -inf, the greedy tokens, the sampled rows, their
    scaled logits s [R, V] and thresholds [R]: the kept tokens have s >= threshold)."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or logits.dtype != F32:
        raise ValueError(f"need float32 logits [len(params)={len(params)}, V], "
                         f"got {logits.dtype} {tuple(logits.shape)}")
    x = logits.detach().cpu()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    top = _first_max(x)
    rows = [b for b, p in enumerate(params) if p.temperature > 0]
    inv_t = torch.tensor([1.0 / params[b].temperature for b in rows], dtype=F32)  # correctly rounded
    s = x[rows] * inv_t[:, None]
    s = torch.where(s == 0, 0.0, s)  # -0 -> +0
    cuts = _cuts(s, s.gather(1, top[rows, None])[:, 0], [params[b] for b in rows]) if rows else torch.zeros(0)
    return x, top, rows, s, cuts


def kept_tokens(logits: torch.Tensor, params: list[DrawParams]) -> torch.Tensor:
    """bool [B, V]: the tokens each row may draw (a greedy row: its argmax only)."""
    x, top, rows, s, cuts = _filtered(logits, params)
    kept = torch.zeros(x.shape, dtype=torch.bool)
    kept[torch.arange(len(params)), top] = True
    kept[rows] = s >= cuts[:, None]
    return kept


def reference_draw(logits: torch.Tensor, params: list[DrawParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 (any device) -> (tokens int64 [B], logprobs float32 [B]) on the CPU,
    the tokens exactly those of nmk_sample."""
    x, tokens, rows, s, cuts = _filtered(logits, params)
    if rows:
        keys = [draw_key(params[b].seed, params[b].counter) for b in rows]
        # A kept token always beats a dropped one: the row's max is kept and scores above -inf
        # unless every s is -inf, when every token is kept.
        scores = torch.where(s >= cuts[:, None], s + gumbel(keys, x.shape[1]), float("-inf"))
        tokens[rows] = _first_max(scores)
    logprobs = torch.log_softmax(x.double(), dim=-1).gather(1, tokens[:, None])[:, 0].float()
    return tokens, logprobs


# ---- the GPU -------------------------------------------------------------------------------
class GpuSampler:
    """nmk_sample on one CUDA device: one kernel launch per draw, no host synchronization."""

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"GpuSampler needs a CUDA device, got {device}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)

    def draw(self, logits: torch.Tensor, params: list[DrawParams]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: float32 [B, V] contiguous on this device -> (tokens int32 [B], logprobs float32
        [B]) on it, enqueued on torch's current stream."""
        if logits.device != self.device or logits.dtype != F32 or logits.dim() != 2 or not logits.is_contiguous():
            raise ValueError(f"need contiguous float32 [B, V] logits on {self.device}, "
                             f"got {logits.dtype} {tuple(logits.shape)} on {logits.device}")
        rows, vocab = logits.shape
        if rows != len(params) or not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"need 1..{MAX_ROWS} rows with one DrawParams each, got {rows} rows, {len(params)} params")
        if not 1 <= vocab <= MAX_VOCAB:
            raise ValueError(f"vocab must be in [1, {MAX_VOCAB}], got {vocab}")
        tokens = torch.empty(rows, dtype=torch.int32, device=self.device)
        logprobs = torch.empty(rows, dtype=F32, device=self.device)
        with torch.cuda.device(self.device):
            sample(logits.data_ptr(), rows, vocab, rows_array([p.native() for p in params]), tokens.data_ptr(),
                   logprobs.data_ptr(), torch.cuda.current_stream(self.device).cuda_stream)
        return tokens, logprobs
