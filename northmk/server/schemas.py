"""OpenAI-compatible request and response bodies (msgspec).

Per-field types and ranges are declared here and checked by msgspec while decoding;
checks that span fields or need the model live in `validation.py`. Unknown fields are
accepted and ignored, as OpenAI-compatible servers do; the vLLM extras we support
(top_k, min_p, repetition_penalty, ignore_eos, ...) are declared like any other field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]  # -1 and 0 turn it off
Choices = Annotated[int, Meta(ge=1, le=MAX_N)]
MaxTokens = Annotated[int, Meta(ge=1)]
ScoringMaxTokens = Annotated[int, Meta(ge=0)]  # completions: 0 returns the (echoed, scored) prompt alone
MinTokens = Annotated[int, Meta(ge=0)]
Seed = Annotated[int, Meta(ge=-MAX_SEED, le=MAX_SEED)]
TokenId = Annotated[int, Meta(ge=0)]
Stop = str | Annotated[list[str], Meta(max_length=MAX_STOP)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


# ---- requests ---------------------------------------------------------------------


class StreamOptions(Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(Struct):
    type: str
    text: str | None = None


class ToolCallFunction(Struct):
    name: str
    arguments: str = "{}"


class ToolCall(Struct):
    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(Struct, kw_only=True):
    """Fields shared by chat and text completions (OpenAI's and vLLM's)."""

    model: str | None = None
    n: Choices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    user: str | None = None
    # vLLM extras
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    # each prompt token's logprob + top-k: in each choice (completions), top-level (chat)
    prompt_logprobs: TopLogprobs | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None  # "none" turns reasoning off
    # vLLM extras
    include_reasoning: bool = True  # false: reasoning_content is left out of the reply
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # northmk extra: with a constrained reply, reasoning ends after this many tokens
    max_reasoning_tokens: MaxTokens | None = None


PromptItem = str | TokenId | list[TokenId]


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[PromptItem]
    max_tokens: ScoringMaxTokens | None = 16
    echo: bool = False
    logprobs: TopLogprobs | None = None  # with echo, the prompt's tokens come first (the first without one)
    suffix: str | None = None
    best_of: Choices | None = None
    add_special_tokens: bool = True
    response_format: ResponseFormat | None = None  # json: the whole text is that JSON


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


# ---- responses --------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class PromptLogprob(Struct):
    """vLLM's Logprob: one token of a prompt position (the prompt's own, or an alternative)."""

    logprob: float
    rank: int  # 1: the most likely token
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None first, then {token id: PromptLogprob}
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ToolCallDelta(Struct):
    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: dict[str, str] | UnsetType = UNSET


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class ChatDelta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


class ModelCard(Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "northmk"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | UnsetType = UNSET


class DetokenizeResponse(Struct):
    prompt: str


def given(value):
    """`value`, or UNSET (the field is left out of the JSON) when it is None or empty."""
    return value if value else UNSET


def decode(body: bytes, kind: type[Struct]) -> Any:
    """Decode a request body; raises msgspec.DecodeError / ValidationError on bad input."""
    return msgspec.json.decode(body, type=kind)


encode = msgspec.json.encode
