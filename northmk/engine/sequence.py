"""The engine's records: one Sequence per choice, one RequestState per request.

A Sequence is the unit the scheduler moves (waiting -> prefill -> decode row -> finished)
and the native pool tracks (`kv_seq`). Two views of its tokens exist while it decodes:
`output_ids` is appended on the loop thread as tokens are sampled (penalties read it),
`output` (a ChoiceOutput) on the event loop as the loop's events arrive.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import time
from dataclasses import dataclass, field

from .output import ChoiceOutput
from .sampling import RowSampler
from .types import CompletionOutput, GenerationRequest, RequestOutput, TokenLogprob


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # new, or preempted (its KV freed, recomputed on re-admission)
    PREFILLING = "prefilling"
    RUNNING = "running"  # a row of the decode loop
    FINISHED = "finished"


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    request: "RequestState"
    index: int  # choice index
    sampler: RowSampler
    output: ChoiceOutput
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    kv_seq: int | None = None  # native pool id while it holds KV
    slot: int | None = None  # decode-loop row while RUNNING
    num_preemptions: int = 0
    last_token_time: float | None = None
    # Logprobs of tokens the loop sampled, not yet matched with their ring events (FIFO).
    pending_logprobs: collections.deque = field(default_factory=collections.deque)
    order: int = field(default_factory=lambda: next(_seq_counter))  # admission priority: lower first

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.request.prompt_token_ids

    @property
    def recompute_ids(self) -> list[int]:
        """Tokens whose KV a (re-)admitted sequence must hold before decoding resumes."""
        return self.prompt_ids + self.output_ids[:-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def remaining(self) -> int:
        """Tokens this sequence may still generate (max_tokens and the context limit)."""
        return self.output.max_len - len(self.output_ids)


class RequestState:
    """One generate() call: its choices, and the queue its RequestOutputs go through."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.request_id = request.request_id
        self.seqs: list[Sequence] = []
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.arrival = request.arrival_time or time.monotonic()
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.scheduled_time: float | None = None  # the first prefill chunk began (end of the queue wait)
        self.prefilled = False  # the prompt's KV was computed once (n > 1 forks from it)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # scored, not yet published
        self.done = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def all_finished(self) -> bool:
        return all(s.output.finished for s in self.seqs)

    def publish(self) -> None:
        """Queue one RequestOutput holding every choice's delta since the last publish."""
        if self.done:
            return
        deltas: list[CompletionOutput] = [d for s in self.seqs if (d := s.output.take_delta())]
        if not deltas:
            return
        self.done = self.all_finished
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None  # sent once
        self.queue.put_nowait(RequestOutput(
            request_id=self.request_id,
            outputs=deltas,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            first_token_time=self.first_token_time,
            scheduled_time=self.scheduled_time,
            prompt_logprobs=prompt_logprobs,
        ))
