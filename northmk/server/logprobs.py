"""Engine `TokenLogprob`s in OpenAI's two shapes (chat and legacy completions), and prompt
logprobs as echoed completions list them and as vLLM's `prompt_logprobs` extra does."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

from ..engine.types import TokenLogprob
from .schemas import ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob

TokenText = Callable[[int], str]
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clients expect a finite number


def token_text_fn(tokenizer, cache_size: int = 1 << 16) -> TokenText:
    """id -> the token's own text (special tokens included), cached. Ids the model has
    but the tokenizer lacks (a vocabulary padded for the GPU) have no text: ''."""
    vocab_size = tokenizer.vocab_size

    @lru_cache(maxsize=cache_size)
    def text(token_id: int) -> str:
        if token_id >= vocab_size:
            return ""
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return text


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def chat_logprobs(items: list[TokenLogprob], text: TokenText) -> list[ChatTokenLogprob]:
    def top(token_id: int, logprob: float) -> TopLogprob:
        t = text(token_id)
        return TopLogprob(t, _finite(logprob), list(t.encode()))

    out = []
    for item in items:
        t = text(item.token_id)
        out.append(ChatTokenLogprob(
            t, _finite(item.logprob), list(t.encode()), [top(i, lp) for i, lp in item.top]
        ))
    return out


def completion_logprobs(items: list[TokenLogprob], text: TokenText, offset: int) -> CompletionLogprobs:
    """`offset`: characters of the choice's text before these tokens (text_offset starts there)."""
    result = CompletionLogprobs([], [], [], [])
    for item in items:
        t = text(item.token_id)
        result.tokens.append(t)
        result.token_logprobs.append(_finite(item.logprob))
        result.top_logprobs.append({text(i): _finite(lp) for i, lp in item.top})
        result.text_offset.append(offset)
        offset += len(t)
    return result


def extend(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset


def echo_logprobs(prompt_ids: list[int], items: list[TokenLogprob | None], text: TokenText,
                  num_top: int) -> CompletionLogprobs:
    """The prompt's part of an echoed choice's logprobs: null for the first token (it has no
    context), text_offset counted from 0 over the prompt's token texts."""
    assert len(prompt_ids) == len(items), (len(prompt_ids), len(items))
    result = CompletionLogprobs([], [], [], [])
    offset = 0
    for token_id, item in zip(prompt_ids, items):
        t = text(token_id)
        result.tokens.append(t)
        result.token_logprobs.append(None if item is None else _finite(item.logprob))
        result.top_logprobs.append(None if item is None else {text(i): _finite(lp) for i, lp in item.top[:num_top]})
        result.text_offset.append(offset)
        offset += len(t)
    return result


def prompt_logprobs(items: list[TokenLogprob | None], text: TokenText, num_top: int) -> PromptLogprobs:
    """vLLM's shape: per position the prompt's own token, then the top-`num_top` alternatives."""
    def entry(item: TokenLogprob) -> dict[int, PromptLogprob]:
        out = {item.token_id: PromptLogprob(_finite(item.logprob), item.rank, text(item.token_id))}
        for rank, (token_id, logprob) in enumerate(item.top[:num_top], start=1):
            out.setdefault(token_id, PromptLogprob(_finite(logprob), rank, text(token_id)))
        return out

    return [None if item is None else entry(item) for item in items]
