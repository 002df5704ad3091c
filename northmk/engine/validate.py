"""Checks of a GenerationRequest against the engine: every failure is a RequestRejected naming its field."""

from __future__ import annotations

import math

from ..config import PAGE_SIZE
from .config import EngineConfig
from .types import GenerationRequest, RequestRejected

PENALTY_RANGE = 2.0  # OpenAI's bound on presence / frequency penalties


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestRejected(f"{name} must be a finite number, got {value!r}", name)
    return float(value)


def _integer(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRejected(f"{name} must be an integer, got {value!r}", name)
    return value


def _token_ids(ids: object, vocab_size: int, name: str) -> None:
    if not isinstance(ids, (list, tuple)):
        raise RequestRejected(f"{name} must be a list of token ids", name)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RequestRejected(f"{name}: token id {t!r} is outside the vocabulary [0, {vocab_size})", name)


def _check(ok: bool, message: str, name: str) -> None:
    if not ok:
        raise RequestRejected(message, name)


def validate_request(request: GenerationRequest, vocab_size: int, max_model_len: int, engine: EngineConfig,
                     kv_pages: int | None = None) -> None:
    """kv_pages: the pages of the KV group that holds every position (full attention), if any."""
    p, prompt = request.params, request.prompt_token_ids
    _token_ids(prompt, vocab_size, "prompt")
    _check(len(prompt) > 0, "the prompt is empty", "prompt")
    _check(len(prompt) < max_model_len,
           f"the prompt has {len(prompt)} tokens; the context holds {max_model_len} (prompt + at least 1 new)", "prompt")
    n = _integer(p.n, "n")
    _check(1 <= n <= engine.max_batch, f"n must be in [1, {engine.max_batch}], got {n}", "n")
    if p.max_tokens is not None:
        _check(_integer(p.max_tokens, "max_tokens") >= 0, f"max_tokens must be >= 0, got {p.max_tokens}", "max_tokens")
        _check(len(prompt) + p.max_tokens <= max_model_len,
               f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) exceeds the context of {max_model_len}",
               "max_tokens")
    if kv_pages is not None and p.max_tokens != 0:
        # To start, the choices share the prompt's full pages; each holds its own copy of a partly
        # filled last page, or takes a fresh page for its first new token (Scheduler._fork_choices).
        need = -(-len(prompt) // PAGE_SIZE) + (n - 1 if len(prompt) % PAGE_SIZE else n)
        _check(need <= kv_pages, f"{n} choices of a {len(prompt)}-token prompt need {need} KV pages to start; "
               f"the cache holds {kv_pages}", "n")
    _check(_integer(p.min_tokens, "min_tokens") >= 0, "min_tokens must be >= 0", "min_tokens")
    if p.max_tokens is not None:
        _check(p.min_tokens <= p.max_tokens, "min_tokens must not exceed max_tokens", "min_tokens")
    _check(_number(p.temperature, "temperature") >= 0, "temperature must be >= 0", "temperature")
    _check(0 < _number(p.top_p, "top_p") <= 1, f"top_p must be in (0, 1], got {p.top_p}", "top_p")
    _check(_integer(p.top_k, "top_k") >= 0, f"top_k must be >= 0 (0: off), got {p.top_k}", "top_k")
    _check(0 <= _number(p.min_p, "min_p") <= 1, f"min_p must be in [0, 1], got {p.min_p}", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(getattr(p, name), name)
        _check(-PENALTY_RANGE <= value <= PENALTY_RANGE, f"{name} must be in [-2, 2], got {value}", name)
    _check(_number(p.repetition_penalty, "repetition_penalty") > 0, "repetition_penalty must be > 0",
           "repetition_penalty")
    _token_ids(list(p.logit_bias), vocab_size, "logit_bias")
    for value in p.logit_bias.values():
        _number(value, "logit_bias")
    _token_ids(p.stop_token_ids, vocab_size, "stop_token_ids")
    _check(all(isinstance(s, str) and s for s in p.stop), "stop strings must be non-empty strings", "stop")
    if p.seed is not None:
        _integer(p.seed, "seed")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(p, name) is not None:
            k = _integer(getattr(p, name), name)
            _check(0 <= k <= engine.max_logprobs, f"{name} must be in [0, {engine.max_logprobs}], got {k}", name)
