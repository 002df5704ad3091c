"""Reasoning, tool calls and structured output through the real app and engine (random weights:
the grammar, not the model, is what makes the replies well-formed)."""

import json

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from northmk.server.output_parser import SpecialTextFilter
from northmk.server.state import TOKENS

from .helpers import MODEL, PERSON, TIME, TOOL_SCHEMAS, TOOLS, assert_clean, post, special_texts, stream

USER = {"role": "user", "content": "What is the weather in Paris?"}
BODY = {"model": MODEL, "messages": [USER], "seed": 3, "max_tokens": 160}
MAX_MODEL_LEN = 1024
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
REQUIRED = {**BODY, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_reasoning_tokens": 4}


@pytest.fixture
async def client(make_client):
    return await make_client(engine={"max_model_len": MAX_MODEL_LEN})  # room for the tools' prompt


@pytest.fixture(scope="module")
def specials(tiny_checkpoint):
    return special_texts(tiny_checkpoint)


def assert_valid_calls(calls):
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_SCHEMAS[call["function"]["name"]])


def streamed_message(events):
    """What a client assembles from a streamed choice 0: (content, reasoning, tool calls, finish)."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content", "")
            reasoning += delta.get("reasoning_content", "")
            for piece in delta.get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"id": piece.get("id"), "type": piece.get("type"),
                                                         "function": {"name": "", "arguments": ""}})
                call["function"]["name"] += piece["function"].get("name", "")
                call["function"]["arguments"] += piece["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


async def test_required_tool_choice_returns_valid_calls_streamed_and_not(client, specials):
    choice = (await post(client, "/v1/chat/completions", REQUIRED))["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None
    assert len(message["tool_calls"]) == 1
    assert_valid_calls(message["tool_calls"])
    assert_clean(message.get("reasoning_content"), specials)
    content, reasoning, calls, finish = streamed_message(await stream(client, "/v1/chat/completions", REQUIRED))
    assert finish == "tool_calls" and content == ""
    assert_valid_calls(calls)
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]  # same seed
    assert reasoning == message.get("reasoning_content", "")


async def test_a_named_tool_is_the_one_called(client):
    body = {**BODY, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "reasoning_effort": "none", "n": 2}
    for choice in (await post(client, "/v1/chat/completions", body))["choices"]:
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        jsonschema.validate(json.loads(call["function"]["arguments"]), TIME)


async def test_json_schema_content_and_reasoning_arrive_in_their_own_fields(client, specials):
    body = {**BODY, "response_format": JSON_SCHEMA, "max_reasoning_tokens": 5}
    choice = (await post(client, "/v1/chat/completions", body))["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in message
    jsonschema.validate(json.loads(message["content"]), PERSON)
    assert message["reasoning_content"]  # the grammar let the model think (free text) first
    assert_clean(message["reasoning_content"], specials)
    assert_clean(message["content"], specials)
    content, reasoning, calls, _ = streamed_message(await stream(client, "/v1/chat/completions", body))
    assert (content, reasoning, calls) == (message["content"], message["reasoning_content"], [])
    hidden = (await post(client, "/v1/chat/completions", {**body, "include_reasoning": False}))["choices"][0]
    assert "reasoning_content" not in hidden["message"] and hidden["message"]["content"] == message["content"]
    events = await stream(client, "/v1/chat/completions", {**body, "include_reasoning": False})
    assert streamed_message(events)[:2] == (message["content"], "")


def prompt_text(client, reply) -> str:
    return client.server.app[TOKENS].decode(reply["prompt_token_ids"], skip_special_tokens=False)


async def test_reasoning_effort_none_closes_the_thinking_block_and_the_reply_is_all_answer(client):
    body = {**BODY, "response_format": {"type": "json_object"}, "reasoning_effort": "none", "max_tokens": 60,
            "return_token_ids": True, "n": 2}
    reply = await post(client, "/v1/chat/completions", body)
    assert prompt_text(client, reply).endswith("<|START_THINKING|><|END_THINKING|>")
    for choice in reply["choices"]:
        assert "reasoning_content" not in choice["message"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
    on = await post(client, "/v1/chat/completions", {**BODY, "max_tokens": 1, "return_token_ids": True})
    assert prompt_text(client, on).endswith("<|START_THINKING|>")
    kwargs_win = {**body, "chat_template_kwargs": {"reasoning": True}, "max_tokens": 1}
    assert prompt_text(client, await post(client, "/v1/chat/completions", kwargs_win)).endswith(
        "<|START_THINKING|>")


async def test_a_tool_result_turn_round_trips_and_numbers_continue(client):
    first = (await post(client, "/v1/chat/completions", REQUIRED))["choices"][0]["message"]
    [call] = first["tool_calls"]
    conversation = [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "22 C, sunny"}]
    body = {**REQUIRED, "messages": conversation, "seed": 4, "return_token_ids": True}
    reply = await post(client, "/v1/chat/completions", body)
    [second] = reply["choices"][0]["message"]["tool_calls"]
    assert second["id"] != call["id"]
    assert_valid_calls([second])
    text = prompt_text(client, reply)
    assert '{"tool_call_id": "0", "tool_name": "%s"' % call["function"]["name"] in text
    assert '"tool_call_id": "0",\n        "results"' in text and "22 C, sunny" in text
    answer = {**BODY, "messages": conversation, "tools": TOOLS, "max_tokens": 2}
    assert (await post(client, "/v1/chat/completions", answer))["choices"][0]["message"]


@pytest.mark.parametrize("messages,param", [
    ([USER, {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "launch", "arguments": "{}"}}]}],
     "messages[1].tool_calls[0].function.name"),
    ([USER, {"role": "tool", "tool_call_id": "c9", "content": "x"}], "messages[1].tool_call_id"),
    ([USER, {"role": "tool", "tool_call_id": "c1", "content": "x"},
      {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_time", "arguments": "{}"}}]}],
     "messages[1].tool_call_id"),
    ([USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "get_time"}}, {"id": "c1", "function": {"name": "get_time"}}]}],
     "messages"),
    ([{"role": "user", "content": "x", "tool_calls": [{"id": "c1", "function": {"name": "get_time"}}]}],
     "messages[0].tool_calls"),
])
async def test_calls_to_undeclared_tools_and_unanswerable_tool_messages_are_400(client, messages, param):
    response = await client.post("/v1/chat/completions", json={**BODY, "messages": messages, "tools": TOOLS})
    assert response.status == 400
    assert (await response.json())["error"]["param"] == param


async def test_an_unenforceable_schema_is_400_naming_it(client):
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}
    body = {**BODY, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 400 and "cannot enforce" in (await response.json())["error"]["message"]


async def test_completions_with_a_json_schema_return_only_that_json(client):
    body = {"model": MODEL, "prompt": "A person:", "max_tokens": 80, "seed": 1, "n": 2,
            "response_format": JSON_SCHEMA}
    for choice in (await post(client, "/v1/completions", body))["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), PERSON)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "<", "|", "<|END_TEXT|>", "<PAD>", "x<", "|>"]), max_size=12), st.data())
def test_special_texts_are_removed_wherever_the_stream_is_cut(pieces, data):
    specials = ["<|END_TEXT|>", "<PAD>"]
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    filt = SpecialTextFilter(specials)
    out = "".join(filt.push(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])) + filt.flush()
    assert out == text.replace("<|END_TEXT|>", "").replace("<PAD>", "")
