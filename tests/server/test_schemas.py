"""Request bodies: what decodes, what is refused and how the refusal names the field."""

import json

import msgspec
import pytest

from northmk.engine.types import EngineDead, EngineOverloaded, RequestRejected
from northmk.server import schemas
from northmk.server.errors import APIError, InvalidRequest, NotFound, from_decode_error, from_engine_error
from northmk.server.schemas import ChatCompletionRequest, CompletionRequest
from northmk.server.validation import (
    check_chat, check_completion, check_model, fit_max_tokens, prompt_batches, sampling_params,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
VOCAB = 1000


def chat(**fields) -> ChatCompletionRequest:
    req = schemas.decode(json.dumps({**CHAT, **fields}).encode(), ChatCompletionRequest)
    check_chat(req)
    return req


def completion(**fields) -> CompletionRequest:
    req = schemas.decode(json.dumps({"model": "m", "prompt": "x", **fields}).encode(), CompletionRequest)
    check_completion(req)
    return req


def refusal(call) -> APIError:
    try:
        call()
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        return from_decode_error(error)
    except APIError as error:
        return error
    raise AssertionError("the request was accepted")


@pytest.mark.parametrize("field,value", [
    ("temperature", 2.5), ("temperature", -0.1), ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5),
    ("n", 0), ("n", schemas.MAX_N + 1), ("max_tokens", 0), ("presence_penalty", 3),
    ("frequency_penalty", -2.5), ("stop", ["a", "b", "c", "d", "e"]), ("stop", 5), ("top_k", -2),
    ("min_p", 1.5), ("repetition_penalty", 0), ("seed", 2**64), ("logit_bias", {"5": 101}),
    ("top_logprobs", 21), ("stop_token_ids", [-1]), ("stream", "yes"), ("messages", "hi"),
    ("min_tokens", -1),
])
def test_out_of_range_or_mistyped_chat_fields_are_400_naming_the_field(field, value):
    error = refusal(lambda: chat(**{field: value}))
    assert error.status == 400
    assert error.param.startswith(field)
    assert field in error.message


@pytest.mark.parametrize("fields,param", [
    ({"messages": []}, "messages"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"response_format": {"type": "json_object"}, "add_generation_prompt": False}, "add_generation_prompt"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"max_reasoning_tokens": 8}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": 0, "response_format": {"type": "json_object"}}, "max_reasoning_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_inconsistent_or_unsupported_chat_requests_are_400(fields, param):
    error = refusal(lambda: chat(**fields))
    assert (error.status, error.param) == (400, param)


def test_missing_messages_and_unknown_role_are_400():
    assert refusal(lambda: schemas.decode(b'{"model": "m"}', ChatCompletionRequest)).status == 400
    error = refusal(lambda: chat(messages=[{"role": "wizard", "content": "x"}]))
    assert error.param == "messages[0].role"


def test_malformed_json_and_invalid_utf8_are_400_invalid_json():
    for body in (b'{"model": ', b"\xff\xfe", b'{"model": "\xff"}'):
        error = refusal(lambda: schemas.decode(body, ChatCompletionRequest))
        assert (error.status, error.code) == (400, "invalid_json")


def test_unknown_fields_are_ignored_and_vllm_extras_are_read():
    req = chat(frobnicate=True, top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True,
               stop_token_ids=[7], min_tokens=2, include_stop_str_in_output=True,
               skip_special_tokens=False, chat_template_kwargs={"reasoning": False})
    params = sampling_params(req, 10, None, VOCAB)
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.1, 1.2)
    assert params.ignore_eos and params.include_stop_str_in_output and not params.skip_special_tokens
    assert (params.stop_token_ids, params.min_tokens) == ([7], 2)
    assert req.chat_template_kwargs == {"reasoning": False}


def test_sampling_defaults_follow_openai():
    params = sampling_params(chat(), 7, None, VOCAB)
    assert (params.temperature, params.top_p, params.top_k, params.n, params.max_tokens) == (1.0, 1.0, 0, 1, 7)
    assert params.stop == [] and params.logit_bias == {} and params.seed is None
    params = sampling_params(chat(temperature=0, stop="x", seed=3, top_k=-1, logit_bias={"9": -100}), 1, 2, VOCAB)
    assert params.greedy and params.stop == ["x"] and params.seed == 3 and params.top_k == 0
    assert params.logit_bias == {9: -100.0} and params.logprobs == 2


@pytest.mark.parametrize("bias", [{"x": 1}, {str(VOCAB): 1}, {"-1": 1}])
def test_logit_bias_keys_must_be_token_ids_in_the_vocabulary(bias):
    error = refusal(lambda: sampling_params(chat(logit_bias=bias), 1, None, VOCAB))
    assert error.param == "logit_bias"


def test_stop_token_ids_beyond_the_vocabulary_are_400():
    error = refusal(lambda: sampling_params(chat(stop_token_ids=[VOCAB]), 1, None, VOCAB))
    assert error.param == "stop_token_ids"


@pytest.mark.parametrize("prompt,expected", [
    ("abc", ["abc"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_shapes(prompt, expected):
    assert prompt_batches(completion(prompt=prompt).prompt) == expected


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "echo": True}, "echo"),
    ({"prompt": []}, "prompt"), ({"prompt": ["a", 1]}, "prompt"), ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"), ({"prompt": [-3]}, "prompt"), ({"prompt": None}, "prompt"),
    ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1.5}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "logprobs": 2}, "max_tokens"),
])
def test_bad_completion_requests_are_400(fields, param):
    error = refusal(lambda: completion(**fields))
    assert error.status == 400 and error.param.startswith(param)


@pytest.mark.parametrize("fields", [
    {"echo": True, "logprobs": 1}, {"echo": True, "max_tokens": 0}, {"prompt_logprobs": 0, "max_tokens": 0},
    {"echo": True, "logprobs": 2, "stream": True}, {"prompt_logprobs": 20},
])
def test_prompt_scoring_completion_requests_are_accepted(fields):
    req = completion(**fields)
    params = sampling_params(req, req.max_tokens, req.logprobs, VOCAB, req.prompt_logprobs)
    assert params.max_tokens == fields.get("max_tokens", 16) and params.prompt_logprobs == fields.get("prompt_logprobs")


@pytest.mark.parametrize("fields", [{"prompt_logprobs": 21}, {"prompt_logprobs": 2, "stream": True}])
def test_chat_prompt_logprobs_out_of_range_or_streamed_are_400(fields):
    error = refusal(lambda: chat(**fields))
    assert error.status == 400 and error.param == "prompt_logprobs"


def test_unknown_model_is_404_and_no_model_means_the_first_served_name():
    names = ("north", "alias")
    assert check_model(None, names) == "north" and check_model("alias", names) == "alias"
    error = refusal(lambda: check_model("gpt-4", names))
    assert isinstance(error, NotFound) and (error.status, error.code, error.param) == (404, "model_not_found", "model")


def test_prompt_plus_max_tokens_beyond_the_context_is_400():
    assert fit_max_tokens(10, 5, 16) == 5
    assert fit_max_tokens(10, None, 16) == 6  # unspecified: up to the context limit
    for prompt_len, max_tokens in ((10, 7), (16, None), (20, 1)):
        error = refusal(lambda: fit_max_tokens(prompt_len, max_tokens, 16))
        assert (error.status, error.code) == (400, "context_length_exceeded")
    assert isinstance(refusal(lambda: fit_max_tokens(0, 1, 16)), InvalidRequest)


def test_engine_errors_map_to_http_statuses():
    assert (from_engine_error(RequestRejected("bad", param="prompt")).status) == 400
    overloaded = from_engine_error(EngineOverloaded("full", retry_after_s=2.4))
    assert overloaded.status == 503 and overloaded.headers["Retry-After"] == "2"
    assert from_engine_error(EngineDead("boom")).status == 503


def test_error_body_is_openai_shaped():
    body = json.loads(schemas.encode(InvalidRequest("nope", param="n", code="c").body()))
    assert body == {"error": {"message": "nope", "type": "invalid_request_error", "param": "n", "code": "c"}}
