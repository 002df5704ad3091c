"""Checks that span fields or need the model, and requests -> engine `SamplingParams`.

msgspec has already checked each field's type and range (schemas.py); everything here
raises `InvalidRequest` / `NotFound` naming the offending field.
"""

from __future__ import annotations

import msgspec

from ..engine.constrained import ConstraintError, chat_grammar, response_format_json, tool_specs
from ..engine.types import SamplingParams
from ..parsing import conversation_call_numbers
from .errors import InvalidRequest, NotFound
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingFields


def check_model(requested: str | None, served_names: tuple[str, ...]) -> str:
    """The served name a request addresses (the first one when it names none)."""
    if requested is None or requested == "":
        return served_names[0]
    if requested not in served_names:
        raise NotFound(
            f"The model `{requested}` does not exist; this server serves {list(served_names)}",
            param="model",
            code="model_not_found",
        )
    return requested


def check_chat(req: ChatCompletionRequest) -> dict[str, str]:
    """Raises for an invalid chat request; returns its call numbers (OpenAI tool-call id ->
    the model's "0", "1", ...), see `parsing.conversation_call_numbers`."""
    if not req.messages:
        raise InvalidRequest("`messages` must contain at least one message", param="messages")
    for i, message in enumerate(req.messages):
        for part in message.content if isinstance(message.content, list) else ():
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"content part of type {part.type!r} is not supported (text only)",
                    param=f"messages[{i}].content",
                )
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("`top_logprobs` requires `logprobs: true`", param="top_logprobs")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise InvalidRequest(
                "`continue_final_message` needs `add_generation_prompt: false`",
                param="continue_final_message",
            )
        if req.messages[-1].role != "assistant":
            raise InvalidRequest(
                "`continue_final_message` needs an assistant message last",
                param="continue_final_message",
            )
    _check_common(req)
    declared = _check_constraints(req)
    return _check_tool_turns(req, declared)


def _check_constraints(req: ChatCompletionRequest) -> set[str] | None:
    """tools / tool_choice / response_format as the grammar reads them; the declared tool names."""
    try:
        tools = msgspec.to_builtins(req.tools) if req.tools is not None else None
        grammar = chat_grammar(
            response_format=msgspec.to_builtins(req.response_format) if req.response_format else None,
            tools=tools, tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
        )
        declared = set(tool_specs(tools)) if tools is not None else None
    except ConstraintError as error:
        raise InvalidRequest(str(error), param=error.param) from None
    if grammar is None and req.max_reasoning_tokens is not None:
        raise InvalidRequest("`max_reasoning_tokens` applies only to a constrained reply (a JSON response_format, "
                             "or tool_choice 'required' or a named function)", param="max_reasoning_tokens")
    if grammar is not None and not req.add_generation_prompt:
        raise InvalidRequest("a constrained reply (response_format, tool_choice) needs `add_generation_prompt: true`",
                             param="add_generation_prompt")
    return declared


def _check_tool_turns(req: ChatCompletionRequest, declared: set[str] | None) -> dict[str, str]:
    """Each tool call is an assistant's, to a declared tool (when tools are given), and each tool
    message answers a call made before it. Returns OpenAI call id -> the model's number."""
    try:
        numbers = conversation_call_numbers(req.messages)
    except ValueError as error:
        raise InvalidRequest(str(error), param="messages") from None
    made: set[str] = set()
    for i, message in enumerate(req.messages):
        for j, call in enumerate(message.tool_calls or ()):
            if message.role != "assistant":
                raise InvalidRequest("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
            if declared is not None and call.function.name not in declared:
                raise InvalidRequest(f"messages[{i}] calls {call.function.name!r}, which is not among the tools",
                                     param=f"messages[{i}].tool_calls[{j}].function.name")
            made.add(call.id)
        if message.role == "tool" and message.tool_call_id not in made:
            raise InvalidRequest(f"tool message answers tool_call_id {message.tool_call_id!r}, "
                                 "which no earlier assistant message made", param=f"messages[{i}].tool_call_id")
    return numbers


def check_completion(req: CompletionRequest) -> None:
    prompt = req.prompt
    if isinstance(prompt, list):
        if not prompt:
            raise InvalidRequest("`prompt` must not be empty", param="prompt")
        kinds = {type(item) for item in prompt}
        if len(kinds) > 1:
            raise InvalidRequest(
                "`prompt` must be a string, a list of strings, a list of token ids "
                "or a list of token-id lists, not a mixture",
                param="prompt",
            )
        if isinstance(prompt[0], list) and any(not ids for ids in prompt):
            raise InvalidRequest("a token-id prompt must not be empty", param="prompt")
    if req.suffix:
        raise InvalidRequest("`suffix` is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("`best_of` other than `n` is not supported", param="best_of")
    if req.response_format is not None:
        try:
            json_rule = response_format_json(msgspec.to_builtins(req.response_format))
        except ConstraintError as error:
            raise InvalidRequest(str(error), param=error.param) from None
        if json_rule is not None and req.echo:
            raise InvalidRequest("`echo` with a JSON response_format is not supported", param="echo")
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise InvalidRequest("`max_tokens: 0` returns only the prompt: it needs `echo` or `prompt_logprobs`",
                             param="max_tokens")
    _check_common(req)


def _check_common(req: SamplingFields) -> None:
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if any(s == "" for s in stops):
        raise InvalidRequest("stop strings must not be empty", param="stop")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("`stream_options` is only allowed with `stream: true`", param="stream_options")
    if req.stream and req.prompt_logprobs is not None:  # as vLLM; streamed echo + logprobs carries them
        raise InvalidRequest("`prompt_logprobs` is not available with `stream: true`", param="prompt_logprobs")


def prompt_batches(prompt: str | list) -> list[str] | list[list[int]]:
    """A completion prompt as a list of prompts: strings, or token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is out of range [0, {vocab_size})", param=param)


def fit_max_tokens(
    prompt_len: int, max_tokens: int | None, max_model_len: int, param: str = "max_tokens"
) -> int:
    """The number of tokens to generate; a 400 when the prompt and request overflow the context."""
    if prompt_len == 0:
        raise InvalidRequest("the prompt is empty after tokenization", param="prompt")
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; "
            f"the prompt has {prompt_len} tokens, leaving no room to generate",
            param="messages" if param == "max_completion_tokens" else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} to generate)",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def sampling_params(
    req: SamplingFields, max_tokens: int, logprobs: int | None, vocab_size: int, prompt_logprobs: int | None = None
) -> SamplingParams:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop_token_ids = list(req.stop_token_ids or [])
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    return SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        seed=req.seed,
        stop=stops,
        stop_token_ids=stop_token_ids,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    bias = {}
    for key, value in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"logit_bias token id {token} is out of range [0, {vocab_size})", param="logit_bias"
            )
        bias[token] = value
    return bias
