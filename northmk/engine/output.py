"""Turning one choice's sampled tokens into deltas: detokenize, stop checks, finish reasons."""

from __future__ import annotations

from typing import Protocol

from .stops import StopStringMatcher
from .types import CompletionOutput, FinishReason, SamplingParams, TokenLogprob


class Detokenizer(Protocol):
    """northmk.tokenizer.IncrementalDetokenizer: text deltas that never split UTF-8."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class ChoiceOutput:
    """The output side of one choice: what was generated, what was released, why it ended.

    `accept()` runs the stop checks in vLLM's order for each new token; `take_delta()`
    hands out everything accepted since the previous call as a CompletionOutput.
    """

    def __init__(
        self, index: int, params: SamplingParams, detokenizer: Detokenizer,
        eos_ids: tuple[int, ...], num_prompt_tokens: int, max_model_len: int,
    ):
        self.index = index
        self.params = params
        self.detokenizer = detokenizer
        self.eos_ids = () if params.ignore_eos else tuple(eos_ids)
        self.stop_ids = tuple(params.stop_token_ids)
        self.max_len = max_model_len - num_prompt_tokens  # the context limit, in new tokens
        if params.max_tokens is not None:
            self.max_len = min(self.max_len, params.max_tokens)
        self.matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.num_generated = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._text: list[str] = []
        self._reported_finish = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """One new token; returns True when it finished the choice."""
        assert not self.finished, "token after finish"
        self.num_generated += 1
        self._token_ids.append(token)
        if logprob is not None:
            self._logprobs.append(logprob)
        checking = self.num_generated > self.params.min_tokens
        if checking and (token in self.eos_ids or token in self.stop_ids):
            reason = token if token in self.stop_ids else None
            if self.params.include_stop_str_in_output:
                self._text.append(self.matcher.push(self.detokenizer.push(token), check=False))
            self._finish(FinishReason.STOP, reason)
            return True
        self._text.append(self.matcher.push(self.detokenizer.push(token), check=checking))
        if self.matcher.matched is not None:
            self._finish(FinishReason.STOP, self.matcher.matched)
        elif self.num_generated >= self.max_len:
            self._finish(FinishReason.LENGTH, None)
        return self.finished

    def finish_empty(self) -> None:
        """Finish before any token: max_tokens 0 asked for the prompt alone (to score it)."""
        assert self.max_len == 0 and not self.num_generated, "only a choice that may generate nothing"
        self._finish(FinishReason.LENGTH, None)

    def abort(self) -> None:
        if not self.finished:
            self._finish(FinishReason.ABORT, None)

    def take_delta(self) -> CompletionOutput | None:
        """Everything accepted since the last call, or None when nothing changed."""
        report_finish = self.finished and not self._reported_finish
        if not self._token_ids and not report_finish:
            return None
        self._reported_finish = self.finished
        delta = CompletionOutput(
            index=self.index,
            token_ids=self._token_ids,
            text="".join(self._text),
            logprobs=self._logprobs if self.params.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_generated=self.num_generated,
        )
        self._token_ids, self._logprobs, self._text = [], [], []
        return delta

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        if self.matcher.matched is None:
            held = self.detokenizer.flush()
            self._text.append(self.matcher.push(held, check=False) + self.matcher.flush())
