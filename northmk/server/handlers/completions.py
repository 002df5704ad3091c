"""POST /v1/completions: prompt(s) -> engine -> text choices or SSE chunks.

A request with P prompts and n choices each runs as P engine requests; choice
`p * n + j` is choice j of prompt p, as in OpenAI's API. A JSON response_format makes each
choice's whole text that JSON (grammar masks, no chat wrapper). `echo` with `logprobs`
lists the prompt's tokens first; the engine scores the prompt (prompt logprobs), which
arrive with each prompt's first output, so a stream sends a prompt's echo chunk then.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from aiohttp import web

from ...engine.constrained import ConstraintError, completion_logits_processors
from ...engine.types import CompletionOutput, GenerationRequest, RequestOutput
from .. import schemas
from ..schemas import UNSET
from ..errors import InvalidRequest
from ..logprobs import completion_logprobs, echo_logprobs, extend, prompt_logprobs
from ..schemas import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, PromptLogprobs
from ..state import TOKENS
from ..streaming import serve_events
from ..validation import check_completion, fit_max_tokens, prompt_batches, sampling_params
from .common import engine_of, iterate, model_name, new_id, now, read_request, start, trace_generation


@dataclass
class ChoiceState:
    prompt: int  # which prompt this choice continues
    text: list[str] = field(default_factory=list)
    text_len: int = 0  # characters so far (text_offset of the next token)
    token_ids: list[int] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_generated: int = 0


class CompletionRun:
    def __init__(self, request: web.Request, req: CompletionRequest):
        self.engine = engine_of(request)
        self.tokens = request.app[TOKENS]
        self.req = req
        self.model = model_name(request, req.model)
        self.id = new_id("cmpl")
        self.created = now()
        self.prompt_ids = [self._prompt_ids(p) for p in prompt_batches(req.prompt)]
        self.max_tokens = [fit_max_tokens(len(ids), req.max_tokens, self.engine.max_model_len)
                           for ids in self.prompt_ids]
        self.choices = [ChoiceState(p) for p in range(len(self.prompt_ids)) for _ in range(req.n)]
        self.cached_tokens: dict[int, int] = {}  # prompt -> tokens served from the prefix cache
        self.echoed_logprobs: dict[int, CompletionLogprobs] = {}  # prompt -> its part of echoed logprobs
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # prompt -> vLLM's prompt_logprobs
        self.generations: list[GenerationRequest] = []
        self.last: dict[int, RequestOutput] = {}  # prompt -> its latest output

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokens.encode(prompt, add_special_tokens=self.req.add_special_tokens)
        return self.tokens.check_ids(prompt, "prompt")

    async def generation_requests(self) -> list[GenerationRequest]:
        vocab = self.engine.model_config.vocab_size
        many = len(self.prompt_ids) > 1
        self.generations = [
            GenerationRequest(f"{self.id}-{p}" if many else self.id, ids,
                              sampling_params(self.req, self.max_tokens[p], self.req.logprobs, vocab,
                                              self._num_prompt_top()))
            for p, ids in enumerate(self.prompt_ids)
        ]
        if self.req.response_format is not None:
            for generation in self.generations:  # one grammar state per request
                generation.params.logits_processors = await self._constraints()
        return self.generations

    def _num_prompt_top(self) -> int | None:
        """Alternatives per prompt token the engine must score: the most either use asks for."""
        asked = [self.req.prompt_logprobs, self.req.logprobs if self.req.echo else None]
        return max((k for k in asked if k is not None), default=None)

    async def _constraints(self) -> list:
        try:
            return await asyncio.to_thread(completion_logits_processors, self.engine.tokenizer, self.engine.eos_ids,
                                           response_format=self.req.response_format)
        except ConstraintError as error:
            raise InvalidRequest(str(error), param=error.param) from None

    def trace(self, request: web.Request) -> None:
        n = self.req.n
        for p, generation in enumerate(self.generations):
            choices = self.choices[p * n: (p + 1) * n]
            trace_generation(request, generation, self.last.get(p), sum(c.num_generated for c in choices),
                             choices[0].finish_reason)

    def prompt_text(self, prompt: int) -> str:
        original = prompt_batches(self.req.prompt)[prompt]
        if isinstance(original, str):
            return original
        return self.tokens.decode(original, skip_special_tokens=False, param="prompt")

    def usage(self) -> schemas.Usage:
        prompt = sum(len(ids) for ids in self.prompt_ids)
        completion = sum(c.num_generated for c in self.choices)
        cached = sum(self.cached_tokens.values())
        details = schemas.PromptTokensDetails(cached) if cached else UNSET
        return schemas.Usage(prompt, completion, prompt + completion, details)

    def record(self, prompt: int, output: RequestOutput) -> list[tuple[int, CompletionOutput, CompletionLogprobs | None]]:
        """Fold one engine output into the choices; returns (choice index, delta, its logprobs)."""
        self.cached_tokens[prompt] = output.num_cached_tokens
        self.last[prompt] = output
        if output.prompt_logprobs is not None:
            self._record_prompt(prompt, output.prompt_logprobs)
        changed = []
        for out in output.outputs:
            index = prompt * self.req.n + out.index
            state = self.choices[index]
            logprobs = None
            if self.req.logprobs is not None:
                logprobs = completion_logprobs(out.logprobs or [], self.tokens.token_text, state.text_len)
                state.logprobs = state.logprobs or CompletionLogprobs([], [], [], [])
                extend(state.logprobs, logprobs)
            state.text.append(out.text)
            state.text_len += len(out.text)
            state.token_ids += out.token_ids
            state.num_generated = out.num_generated
            if out.finished:
                state.finish_reason, state.stop_reason = out.finish_reason.value, out.stop_reason
            changed.append((index, out, logprobs))
        return changed

    def _record_prompt(self, prompt: int, items: list) -> None:
        """The prompt's logprobs open each echoed choice's logprobs, and fill prompt_logprobs."""
        req = self.req
        if req.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = prompt_logprobs(items, self.tokens.token_text, req.prompt_logprobs)
        if req.echo and req.logprobs is not None:
            echoed = echo_logprobs(self.prompt_ids[prompt], items, self.tokens.token_text, req.logprobs)
            self.echoed_logprobs[prompt] = echoed
            for state in self.choices[prompt * req.n: (prompt + 1) * req.n]:
                state.logprobs = CompletionLogprobs([], [], [], [])
                extend(state.logprobs, echoed)

    def echo(self) -> None:
        if self.req.echo:
            for state in self.choices:
                text = self.prompt_text(state.prompt)
                state.text.append(text)
                state.text_len += len(text)

    # ---- responses ---------------------------------------------------------------

    def completion(self) -> Completion:
        ids = self.req.return_token_ids
        choices = [
            CompletionChoice(i, "".join(c.text), c.logprobs, c.finish_reason, c.stop_reason,
                             token_ids=c.token_ids if ids else UNSET,
                             prompt_token_ids=self.prompt_ids[c.prompt] if ids else UNSET,
                             prompt_logprobs=self.prompt_logprobs.get(c.prompt, UNSET))
            for i, c in enumerate(self.choices)
        ]
        return Completion(self.id, self.created, self.model, choices, usage=self.usage())

    def chunk(self, choices: list[CompletionChoice], usage: schemas.Usage | None = None) -> bytes:
        options = self.req.stream_options
        if usage is None and options and options.continuous_usage_stats:
            usage = self.usage()
        return schemas.encode(Completion(self.id, self.created, self.model, choices, usage=usage))

    def first_chunks(self, prompt: int) -> list[bytes]:
        """Per choice of `prompt`: the echoed prompt (with its logprobs) and/or its token ids, when asked for."""
        req = self.req
        if not (req.echo or req.return_token_ids):
            return []
        text = self.prompt_text(prompt) if req.echo else ""
        return [
            self.chunk([CompletionChoice(
                index, text, self.echoed_logprobs.get(prompt), None,
                prompt_token_ids=self.prompt_ids[prompt] if req.return_token_ids else UNSET,
            )])
            for index in range(prompt * req.n, (prompt + 1) * req.n)
        ]

    def delta_chunks(self, prompt: int, output: RequestOutput) -> list[bytes]:
        first = prompt not in self.last
        changed = self.record(prompt, output)  # first: it brings the prompt's logprobs
        events = self.first_chunks(prompt) if first else []
        for index, out, logprobs in changed:
            token_ids = out.token_ids if self.req.return_token_ids else UNSET
            if out.text or out.token_ids:
                events.append(self.chunk([CompletionChoice(index, out.text, logprobs, None, token_ids=token_ids)]))
            if out.finished:
                state = self.choices[index]
                events.append(self.chunk([CompletionChoice(index, "", None, state.finish_reason, state.stop_reason)]))
        return events

    def usage_chunk(self) -> list[bytes]:
        options = self.req.stream_options
        return [self.chunk([], self.usage())] if options and options.include_usage else []


async def completions(request: web.Request) -> web.StreamResponse:
    req = await read_request(request, CompletionRequest)
    check_completion(req)
    run = CompletionRun(request, req)
    run.echo()
    try:
        first, index, rest = await start(run.engine, await run.generation_requests())
        outputs = iterate(first, index, rest)
        if req.stream:
            return await _stream(request, run, outputs)
        async with contextlib.aclosing(outputs):
            async for prompt, output in outputs:
                run.record(prompt, output)
    finally:
        run.trace(request)
    return web.Response(body=schemas.encode(run.completion()), content_type="application/json")


async def _stream(request: web.Request, run: CompletionRun, outputs) -> web.StreamResponse:
    async def events():
        async for prompt, output in outputs:
            yield run.delta_chunks(prompt, output)
        yield run.usage_chunk()

    return await serve_events(request, outputs, events())
