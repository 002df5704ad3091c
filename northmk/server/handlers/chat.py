"""POST /v1/chat/completions: messages -> chat template -> engine -> message or SSE chunks.

The reply is decoded with its special tokens and split by the app's parser (Cohere's by
default) into reasoning, content and tool calls. response_format / tool_choice become
grammar masks in the sampler (`engine.constrained`), compiled off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ...engine.constrained import ConstraintError, chat_logits_processors
from ...engine.types import CompletionOutput, FinishReason, GenerationRequest, RequestOutput
from ...parsing.cohere import reasoning_enabled
from .. import schemas
from ..errors import InvalidRequest
from ..logprobs import chat_logprobs, prompt_logprobs
from ..output_parser import OutputParser, ParsedDelta, SpecialTextParser
from ..schemas import (
    UNSET, UnsetType, given,
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
    ChatCompletionRequest, ChatDelta, ChatLogprobs, PromptLogprobs, ToolCall, ToolCallFunction,
)
from ..state import PARSER_FACTORY, TOKENS
from ..streaming import serve_events
from ..validation import check_chat, fit_max_tokens, sampling_params
from .common import engine_of, iterate, model_name, new_id, now, read_request, start, trace_generation


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    parser: OutputParser
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, ToolCall] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_generated: int = 0

    def parse(self, out: CompletionOutput) -> ParsedDelta:
        """Feed one engine delta to the parser; record it; return the parsed delta."""
        parsed = self.parser.feed(out.text) if out.text else ParsedDelta()
        if out.finished:
            tail = self.parser.finish()
            parsed = ParsedDelta(parsed.content + tail.content, parsed.reasoning + tail.reasoning,
                                 parsed.tool_calls + tail.tool_calls)
            reason = out.finish_reason
            if reason == FinishReason.STOP and self.parser.has_tool_calls:
                reason = FinishReason.TOOL_CALLS
            self.finish_reason, self.stop_reason = reason.value, out.stop_reason
        self.content.append(parsed.content)
        self.reasoning.append(parsed.reasoning)
        for call in parsed.tool_calls:
            self._merge_tool_call(call)
        self.token_ids += out.token_ids
        self.num_generated = out.num_generated
        return parsed

    def _merge_tool_call(self, call: schemas.ToolCallDelta) -> None:
        fn = call.function or {}
        known = self.tool_calls.get(call.index)
        if known is None:
            self.tool_calls[call.index] = ToolCall(
                call.id or f"call_{call.index}", ToolCallFunction(fn.get("name", ""), fn.get("arguments", ""))
            )
        else:
            known.function.arguments += fn.get("arguments", "")


class ChatRun:
    """One chat request on the engine: its prompt, choices and response shapes."""

    def __init__(self, request: web.Request, req: ChatCompletionRequest, call_numbers: dict[str, str]):
        self.engine = engine_of(request)
        self.tokens = request.app[TOKENS]
        self.req = req
        self.model = model_name(request, req.model)
        self.id = new_id("chatcmpl")
        self.created = now()
        self.call_numbers = call_numbers
        self.template_kwargs = template_kwargs(req)
        self.reasoning = reasoning_enabled(self.template_kwargs)
        self.prompt_ids = self.tokens.render_chat(
            req.messages, req.tools, req.add_generation_prompt, req.continue_final_message, self.template_kwargs,
        )
        self.max_tokens = fit_max_tokens(
            len(self.prompt_ids), req.max_completion_tokens or req.max_tokens, self.engine.max_model_len,
            param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        )
        self.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        factory = request.app[PARSER_FACTORY]
        self.choices = [ChoiceState(SpecialTextParser(factory(req), self.tokens.special_texts))
                        for _ in range(req.n)]
        self.num_prompt_tokens = len(self.prompt_ids)
        self.num_cached_tokens = 0
        self.prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's extra, top-level in the reply
        self.generation: GenerationRequest | None = None
        self.last: RequestOutput | None = None

    async def generation_request(self) -> GenerationRequest:
        vocab = self.engine.model_config.vocab_size
        params = sampling_params(self.req, self.max_tokens, self.logprobs, vocab, self.req.prompt_logprobs)
        params.skip_special_tokens = False  # the parser reads the reply's structure from them
        params.logits_processors = await self._constraints()
        self.generation = GenerationRequest(self.id, self.prompt_ids, params)
        return self.generation

    async def _constraints(self) -> list:
        req = self.req
        if req.tools is None and req.tool_choice is None and req.response_format is None:
            return []
        try:
            return await asyncio.to_thread(
                chat_logits_processors, self.engine.tokenizer, self.engine.eos_ids,
                response_format=req.response_format, tools=req.tools, tool_choice=req.tool_choice,
                parallel_tool_calls=req.parallel_tool_calls, reasoning=self.reasoning,
                max_reasoning_tokens=req.max_reasoning_tokens, first_call_number=len(self.call_numbers),
            )
        except ConstraintError as error:
            raise InvalidRequest(str(error), param=error.param) from None

    def usage(self) -> schemas.Usage:
        completion = sum(c.num_generated for c in self.choices)
        details = schemas.PromptTokensDetails(self.num_cached_tokens) if self.num_cached_tokens else UNSET
        return schemas.Usage(self.num_prompt_tokens, completion, self.num_prompt_tokens + completion, details)

    def observe(self, output: RequestOutput) -> None:
        self.last = output
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs(output.prompt_logprobs, self.tokens.token_text,
                                                   self.req.prompt_logprobs)

    def trace(self, request: web.Request) -> None:
        if self.generation is not None:
            completion = sum(c.num_generated for c in self.choices)
            trace_generation(request, self.generation, self.last, completion, self.choices[0].finish_reason)

    def reasoning_of(self, text: str) -> str:
        return text if self.req.include_reasoning else ""

    def logprobs_of(self, out: CompletionOutput) -> ChatLogprobs | None:
        if self.logprobs is None:
            return None
        return ChatLogprobs(chat_logprobs(out.logprobs or [], self.tokens.token_text))

    # ---- non-streamed ------------------------------------------------------------

    def completion(self) -> ChatCompletion:
        choices = [self._choice(i, c) for i, c in enumerate(self.choices)]
        return ChatCompletion(self.id, self.created, self.model, choices, self.usage(),
                              prompt_token_ids=self.prompt_ids if self.req.return_token_ids else UNSET,
                              prompt_logprobs=self.prompt_logprobs)

    def _choice(self, index: int, state: ChoiceState) -> ChatChoice:
        message = AssistantMessage(
            content="".join(state.content) if not state.tool_calls or any(state.content) else None,
            reasoning_content=given(self.reasoning_of("".join(state.reasoning))),
            tool_calls=given([state.tool_calls[k] for k in sorted(state.tool_calls)]),
        )
        logprobs = ChatLogprobs(state.logprobs) if self.logprobs is not None else None
        return ChatChoice(index, message, logprobs, state.finish_reason, state.stop_reason,
                          token_ids=state.token_ids if self.req.return_token_ids else UNSET)

    # ---- streamed ----------------------------------------------------------------

    def chunk(self, choices: list[ChatChunkChoice], usage: schemas.Usage | None = None) -> bytes:
        return schemas.encode(ChatCompletionChunk(self.id, self.created, self.model, choices, usage=usage))

    def role_chunks(self) -> list[bytes]:
        """One chunk per choice announcing the assistant role (the first also carries the
        prompt's token ids when asked for)."""
        chunks = []
        for i in range(self.req.n):
            choice = ChatChunkChoice(i, ChatDelta(role="assistant", content=""), None, None)
            prompt_ids = self.prompt_ids if self.req.return_token_ids and i == 0 else UNSET
            chunks.append(schemas.encode(ChatCompletionChunk(
                self.id, self.created, self.model, [choice], usage=self._running_usage(),
                prompt_token_ids=prompt_ids)))
        return chunks

    def delta_chunks(self, out: CompletionOutput) -> list[bytes]:
        state = self.choices[out.index]
        parsed = state.parse(out)
        events = []
        token_ids = out.token_ids if self.req.return_token_ids else UNSET
        logprobs = self.logprobs_of(out)
        reasoning = self.reasoning_of(parsed.reasoning)
        if parsed.content or reasoning or parsed.tool_calls or token_ids or (logprobs and logprobs.content):
            delta = ChatDelta(content=given(parsed.content), reasoning_content=given(reasoning),
                              tool_calls=given(parsed.tool_calls))
            choice = ChatChunkChoice(out.index, delta, logprobs, None, token_ids=token_ids)
            events.append(self.chunk([choice], self._running_usage()))
        if state.finish_reason is not None:
            choice = ChatChunkChoice(out.index, ChatDelta(), None, state.finish_reason, state.stop_reason)
            events.append(self.chunk([choice], self._running_usage()))
        return events

    def _running_usage(self) -> schemas.Usage | None:
        options = self.req.stream_options
        return self.usage() if options and options.continuous_usage_stats else None

    def usage_chunk(self) -> list[bytes]:
        options = self.req.stream_options
        return [self.chunk([], self.usage())] if options and options.include_usage else []


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """The template's variables: top-level reasoning_effort, overridden by chat_template_kwargs."""
    kwargs: dict[str, Any] = {} if req.reasoning_effort is None else {"reasoning_effort": req.reasoning_effort}
    return {**kwargs, **(req.chat_template_kwargs or {})}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await read_request(request, ChatCompletionRequest)
    run = ChatRun(request, req, check_chat(req))
    try:
        first, index, rest = await start(run.engine, [await run.generation_request()])
        outputs = iterate(first, index, rest)
        if req.stream:
            return await _stream(request, run, outputs)
        async with contextlib.aclosing(outputs):
            async for _, output in outputs:
                run.observe(output)
                for out in output.outputs:
                    run.choices[out.index].parse(out)
                    if out.logprobs:
                        run.choices[out.index].logprobs += run.logprobs_of(out).content
    finally:
        run.trace(request)
    return web.Response(body=schemas.encode(run.completion()), content_type="application/json")


async def _stream(request: web.Request, run: ChatRun, outputs) -> web.StreamResponse:
    async def events():
        yield run.role_chunks()
        async for _, output in outputs:
            run.observe(output)
            yield [e for out in output.outputs for e in run.delta_chunks(out)]
        yield run.usage_chunk()

    return await serve_events(request, outputs, events())
