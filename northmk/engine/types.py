"""The messages between the HTTP layer and the engine.

The server builds a `GenerationRequest` (token ids + `SamplingParams`) and iterates
`AsyncEngine.generate(request)`, which yields one `RequestOutput` per engine step that
produced something for the request: per choice, the *delta* since the previous output
(new token ids, their logprobs and the newly releasable text) plus running counts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch


class EngineError(Exception):
    """Base of errors the engine raises to its caller."""


class RequestRejected(EngineError):
    """The request is invalid for this engine (bad ids, too long for the context); HTTP 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineOverloaded(EngineError):
    """The waiting queue is full; HTTP 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDead(EngineError):
    """The engine stopped after an internal failure; HTTP 503."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS / end-of-turn / stop string / stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled (client went away, shutdown)
    TOOL_CALLS = "tool_calls"  # set by the HTTP layer when the reply was a tool call


class LogitsProcessor(Protocol):
    """One stage of the per-row sampling pipeline.

    Called with the ids generated so far for this row and its logits `[V]` (float32);
    returns the logits to sample from (may modify in place). Constrained decoding plugs in
    here as a processor that masks disallowed tokens.
    """

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor: ...


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the context limit; 0: prefill only (scores the prompt)
    min_tokens: int = 0
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; k >= 0: chosen token plus top-k alternatives
    # None: none; k >= 0: each prompt token's logprob plus its top-k alternatives (the prompt
    # is prefilled without the prefix cache, whose pages hold KV but no logits)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    # Opaque per-request context carried to engine spans/logs (e.g. an OpenTelemetry
    # context); the engine never interprets it.
    trace_context: Any = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int | None = None  # 1 + tokens strictly more likely; set for prompt tokens


@dataclass
class CompletionOutput:
    """One choice's delta since the previous RequestOutput."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    num_generated: int = 0  # running total for this choice

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What one engine step produced for a request: deltas of the choices that changed.

    `generate()`'s iterator ends after the output in which the last choice finished.
    """

    request_id: str
    outputs: list[CompletionOutput]
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    first_token_time: float | None = None  # time.monotonic() of the first generated token
    scheduled_time: float | None = None  # time.monotonic() when the prompt's first prefill chunk began
    # SamplingParams.prompt_logprobs: one entry per prompt token (None first: no context), in
    # the request's first output only
    prompt_logprobs: list[TokenLogprob | None] | None = None


OnTokenCallback = Callable[[RequestOutput], None]
