"""Per-row sampling: a pipeline of logits processors, then a draw.

Order for one row (logits [V], float32, already × logit_scale):

    raw log-softmax                      -> reported logprobs (vLLM's default "raw")
    logit_bias, repetition / presence / frequency penalties, min_tokens (EOS masked),
    SamplingParams.logits_processors     -> argmax when temperature == 0
    temperature, top_k, top_p, min_p     -> draw with the row's own torch.Generator

Each row draws from its own generator, so a seeded request samples the same tokens
whatever else shares the batch, and across preemption (the generator lives with the row).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from .types import LogitsProcessor, SamplingParams, TokenLogprob

NEG_INF = float("-inf")


# ---- processors: (output_ids, logits [V]) -> logits -------------------------------------
def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    if bias:
        ids = torch.tensor(list(bias.keys()), dtype=torch.long)
        logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: list[int], penalty: float) -> torch.Tensor:
    """Divide positive logits of seen tokens by `penalty`, multiply negative ones (CTRL)."""
    if penalty != 1.0 and seen_ids:
        ids = torch.tensor(sorted(set(seen_ids)), dtype=torch.long)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def apply_presence_frequency(
    logits: torch.Tensor, output_ids: list[int], presence: float, frequency: float
) -> torch.Tensor:
    """logit -= presence * [count > 0] + frequency * count, over generated tokens only."""
    if (presence or frequency) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=logits.shape[0])
        counts = counts[: logits.shape[0]].to(logits.dtype)
        logits -= presence * (counts > 0).to(logits.dtype) + frequency * counts
    return logits


def suppress_tokens(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    if ids:
        logits[torch.tensor(ids, dtype=torch.long)] = NEG_INF
    return logits


# ---- warpers: shape the distribution before the draw ------------------------------------
def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if 0 < k < logits.shape[0]:
        kth = torch.topk(logits, k).values[-1]
        logits[logits < kth] = NEG_INF
    return logits


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p."""
    if p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = mass_before >= p
        drop[0] = False
        logits[order[drop]] = NEG_INF
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p × the top token's probability."""
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits[probs < min_p * probs.max()] = NEG_INF
    return logits


# ---- one row ---------------------------------------------------------------------------
def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


@dataclass
class RowSampler:
    """Sampling state of one sequence (one choice of a request).

    `output_ids` is the sequence's generated ids, shared (not copied) with its record, so
    penalties always see the tokens drawn so far. `seed` keys the GPU draws
    (engine/gpu_sampling.py): the request's seed + choice index, else random 63 bits.
    """

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    eos_ids: tuple[int, ...]  # masked while fewer than min_tokens are generated
    generator: torch.Generator = field(default_factory=lambda: make_generator(None))
    seed: int = field(default_factory=lambda: secrets.randbits(63))

    @classmethod
    def create(
        cls, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
        eos_ids: tuple[int, ...], choice_index: int = 0,
    ) -> "RowSampler":
        # Choice i of a seeded request draws from seed + i: n > 1 gives n distinct samples.
        seed = None if params.seed is None else params.seed + choice_index
        return cls(params, prompt_ids, output_ids, eos_ids, make_generator(seed),
                   secrets.randbits(63) if seed is None else seed)

    def processors(self) -> list[LogitsProcessor]:
        p = self.params
        stages: list[LogitsProcessor] = [
            lambda out, lg: apply_logit_bias(lg, p.logit_bias),
            lambda out, lg: apply_repetition_penalty(lg, self.prompt_ids + out, p.repetition_penalty),
            lambda out, lg: apply_presence_frequency(lg, out, p.presence_penalty, p.frequency_penalty),
        ]
        if p.min_tokens:
            stopping = [] if p.ignore_eos else list(self.eos_ids)
            stopping += p.stop_token_ids
            stages.append(lambda out, lg: suppress_tokens(lg, stopping) if len(out) < p.min_tokens else lg)
        return stages + list(p.logits_processors)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> the logits the draw sees (greedy: argmax of these)."""
        for stage in self.processors():
            logits = stage(self.output_ids, logits)
        return logits

    def draw(self, logits: torch.Tensor) -> int:
        p = self.params
        logits = self.process(logits)
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        logits = apply_min_p(apply_top_p(apply_top_k(logits, p.top_k), p.top_p), p.min_p)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def token_logprob(logprobs: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    """logprobs [V] (raw log-softmax) -> the chosen token's logprob and the top alternatives."""
    top: list[tuple[int, float]] = []
    if num_top > 0:
        vals, ids = torch.topk(logprobs, min(num_top, logprobs.shape[0]))
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)


def sample_rows(logits: torch.Tensor, rows: list[RowSampler]) -> list[tuple[int, TokenLogprob | None]]:
    """logits [B, V] float32, one row per sampler -> (token, logprob or None) per row.

    Does not append to the rows' output_ids: the caller owns the sequence records.
    """
    assert logits.shape[0] == len(rows), (logits.shape, len(rows))
    # Sampling runs on the host whatever device ran the model: the rows' seeded generators
    # and the processors' token masks live there, so a seed draws the same tokens on any device.
    logits = logits.float().cpu()
    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
    out = []
    for i, row in enumerate(rows):
        token = row.draw(logits[i].clone())
        lp = token_logprob(raw[i], token, row.params.logprobs) if want_logprobs[i] else None
        out.append((token, lp))
    return out
