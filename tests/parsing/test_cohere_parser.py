"""The Cohere reply parser: reasoning, content and OpenAI tool calls, streamed in any cut."""

import codecs
import itertools
import json
import random

import msgspec
import pytest

from northmk.parsing import (
    CohereOutputParser, MessageAccumulator, cohere_parser_factory, conversation_call_numbers, parse_reply,
)
from northmk.server.schemas import ChatCompletionRequest

END_THINKING, START_TEXT, END_TEXT = "<|END_THINKING|>", "<|START_TEXT|>", "<|END_TEXT|>"
START_ACTION, END_ACTION, EOT = "<|START_ACTION|>", "<|END_ACTION|>", "<|END_OF_TURN_TOKEN|>"

TEXT_REPLY = (
    f"Let me think: 2 + 2 = 4 ✓.{END_THINKING}{START_TEXT}The answer is **4** — naïve 😀 maths.{END_TEXT}{EOT}"
)
TOOL_REPLY = (
    f"I need the weather in two cities.{END_THINKING}{START_ACTION}[\n"
    '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Zürich", "days": [1, 2]}},\n'
    '    {"tool_call_id": "1", "tool_name": "get_time", "parameters": {"zone": "UTC", "nested": {"a": "}]"}}}\n'
    f"]{END_ACTION}{EOT}"
)
EMPTY_ARGS_REPLY = (
    f"ok{END_THINKING}{START_ACTION}"
    '[{"tool_call_id": "0", "tool_name": "list_files", "parameters": {}}]'
    f"{END_ACTION}"
)
MALFORMED_REPLY = f"plan{END_THINKING}{START_ACTION}this is not json at all{END_ACTION}{EOT}"
REPLIES = [TEXT_REPLY, TOOL_REPLY, EMPTY_ARGS_REPLY, MALFORMED_REPLY]


def counter_ids():
    numbers = itertools.count()
    return lambda: f"call_test{next(numbers)}"


def stream(pieces, reasoning=True):
    """Feed pieces one by one; return the message a client assembles and the parser."""
    parser = CohereOutputParser(reasoning=reasoning, make_call_id=counter_ids())
    acc = MessageAccumulator()
    for piece in pieces:
        acc.add(parser.feed(piece))
    acc.add(parser.finish())
    return acc.message(), parser


def one_shot(text, reasoning=True):
    return parse_reply(text, reasoning=reasoning, make_call_id=counter_ids())


def test_reasoning_and_content_go_to_their_own_fields():
    message = one_shot(TEXT_REPLY)
    assert message.reasoning_content == "Let me think: 2 + 2 = 4 ✓."
    assert message.content == "The answer is **4** — naïve 😀 maths."
    assert message.tool_calls == []


def test_with_reasoning_off_the_reply_starts_in_the_answer():
    reply = f"{START_TEXT}Just the answer.{END_TEXT}{EOT}"
    assert one_shot(reply, reasoning=False).content == "Just the answer."
    assert one_shot(reply, reasoning=False).reasoning_content is None
    # Text before any marker is answer text when reasoning is off, reasoning when on.
    assert one_shot("bare words", reasoning=False).content == "bare words"
    assert one_shot("bare words", reasoning=True).reasoning_content == "bare words"


def test_several_tool_calls_in_one_turn_become_openai_calls():
    message, parser = stream([TOOL_REPLY])
    assert parser.has_tool_calls
    assert message.reasoning_content == "I need the weather in two cities."
    assert message.content is None
    assert [c.id for c in message.tool_calls] == ["call_test0", "call_test1"]
    assert [c.type for c in message.tool_calls] == ["function", "function"]
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Zürich", "days": [1, 2]}
    assert json.loads(message.tool_calls[1].function.arguments) == {"zone": "UTC", "nested": {"a": "}]"}}
    assert parser.call_ids == {"0": "call_test0", "1": "call_test1"}


def test_generated_call_ids_look_like_openai_ids_and_differ():
    first, second = parse_reply(TOOL_REPLY).tool_calls
    for call in (first, second):
        assert call.id.startswith("call_") and len(call.id) == len("call_") + 24 and call.id[5:].isalnum()
    assert first.id != second.id


def test_streamed_deltas_have_openai_shapes():
    parser = CohereOutputParser(make_call_id=counter_ids())
    deltas = [d for ch in TOOL_REPLY for d in parser.feed(ch).tool_calls] + parser.finish().tool_calls
    encoded = [json.loads(msgspec.json.encode(d)) for d in deltas]
    headers = [d for d in encoded if "id" in d]
    assert [(d["index"], d["id"], d["type"], d["function"]["name"]) for d in headers] == [
        (0, "call_test0", "function", "get_weather"), (1, "call_test1", "function", "get_time"),
    ]
    assert all(set(d) == {"index", "id", "type", "function"} for d in headers)
    assert all(set(d["function"]) == {"name", "arguments"} for d in headers)
    followers = [d for d in encoded if "id" not in d]
    assert followers and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in followers)
    # Each call is announced before any of its argument chunks.
    first_seen = {d["index"]: i for i, d in reversed(list(enumerate(encoded)))}
    assert all(encoded[first_seen[k]].get("id") for k in first_seen)


def test_empty_parameters_become_an_empty_json_object():
    message = one_shot(EMPTY_ARGS_REPLY)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("list_files", "{}")]


@pytest.mark.parametrize("reply", [MALFORMED_REPLY, f"x{END_THINKING}{START_ACTION}[{{oops"])
def test_a_malformed_action_block_degrades_to_content(reply):
    message, parser = stream(list(reply))
    assert not parser.has_tool_calls
    assert message.tool_calls == []
    assert message.content == reply.split(START_ACTION)[1].split(END_ACTION)[0]
    assert one_shot(reply) == message


def test_text_then_tool_call_keeps_both():
    reply = f"r{END_THINKING}{START_TEXT}Calling it now.{END_TEXT}{START_ACTION}" \
            f'[{{"tool_call_id": "0", "tool_name": "f", "parameters": {{"x": 1}}}}]{END_ACTION}'
    message = one_shot(reply)
    assert message.content == "Calling it now."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("f", {"x": 1})]


@pytest.mark.parametrize("reply", REPLIES)
def test_every_single_cut_gives_the_one_shot_result(reply):
    expected = one_shot(reply)
    for cut in range(len(reply) + 1):
        assert stream([reply[:cut], reply[cut:]])[0] == expected, cut


@pytest.mark.parametrize("reply", REPLIES)
def test_character_by_character_and_random_pieces_give_the_one_shot_result(reply):
    expected = one_shot(reply)
    assert stream(list(reply))[0] == expected
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(reply)), rng.randint(1, 12)))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
        assert stream(pieces)[0] == expected


@pytest.mark.parametrize("reply", REPLIES)
def test_every_byte_boundary_through_an_incremental_utf8_decoder(reply):
    """What a byte-level detokenizer hands over: text released only at character ends."""
    data = reply.encode()
    expected = one_shot(reply)
    for cut in range(len(data) + 1):
        decoder = codecs.getincrementaldecoder("utf-8")()
        pieces = [decoder.decode(data[:cut]), decoder.decode(data[cut:], final=True)]
        assert stream(pieces)[0] == expected, cut


def test_token_by_token_detokenized_output_gives_the_one_shot_result(tokenizer):
    from northmk.tokenizer import IncrementalDetokenizer

    for reply in REPLIES:
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        pieces = [detok.push(t) for t in tokenizer.encode(reply)] + [detok.flush()]
        assert "".join(pieces) == reply
        assert stream(pieces)[0] == one_shot(reply)


def test_feeding_after_finish_is_an_error():
    parser = CohereOutputParser()
    parser.feed("x")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("y")
    with pytest.raises(RuntimeError):
        parser.finish()


@pytest.mark.parametrize("kwargs, effort, expected", [
    (None, None, True),
    ({"reasoning": False}, None, False),
    ({"enable_thinking": False}, None, False),
    ({"reasoning_effort": "none"}, None, False),
    ({"reasoning_effort": "high"}, None, True),
    ({"reasoning": True, "reasoning_effort": "none"}, None, True),
])
def test_the_factory_follows_the_templates_reasoning_switches(kwargs, effort, expected):
    request = ChatCompletionRequest(messages=[], chat_template_kwargs=kwargs)
    parser = cohere_parser_factory(request)
    assert isinstance(parser, CohereOutputParser)
    message = MessageAccumulator()
    message.add(parser.feed("words"))
    message.add(parser.finish())
    assert (message.message().reasoning_content == "words") is expected


def test_call_numbers_match_what_the_template_renders(tokenizer):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "w", "arguments": '{"c": 1}'}},
            {"id": "call_b", "type": "function", "function": {"name": "w", "arguments": '{"c": 2}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_b", "content": "rainy"},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_c", "type": "function", "function": {"name": "w", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_c", "content": "foggy"},
    ]
    numbers = conversation_call_numbers(messages)
    assert numbers == {"call_a": "0", "call_b": "1", "call_c": "2"}
    prompt = tokenizer.apply_chat_template(messages, tools=[{"type": "function", "function": {"name": "w"}}])
    for message in messages:
        if message["role"] == "tool":
            number = numbers[message["tool_call_id"]]
            result = {"content": message["content"]}
            assert f'"tool_call_id": "{number}",\n        "results": {{\n            "0": {json.dumps(result)}' in prompt


def test_call_numbers_reject_missing_and_duplicate_ids():
    with pytest.raises(ValueError, match="non-empty string id"):
        conversation_call_numbers([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}])
    twice = [{"role": "assistant", "tool_calls": [{"id": "x"}]}, {"role": "assistant", "tool_calls": [{"id": "x"}]}]
    with pytest.raises(ValueError, match="more than one call"):
        conversation_call_numbers(twice)


def test_parsed_calls_render_back_as_the_model_wrote_them(tokenizer):
    """A multi-turn round trip: the OpenAI calls a client gets back, sent in the next
    request's history, render as the action block the model emitted."""
    message = parse_reply(TOOL_REPLY)
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "reasoning_content": message.reasoning_content, "tool_calls": [
            {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]},
        {"role": "tool", "tool_call_id": message.tool_calls[1].id, "content": "12:00"},
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"},
    ]
    prompt = tokenizer.apply_chat_template(history, tools=[])
    assert TOOL_REPLY.removesuffix(EOT) in prompt
    assert conversation_call_numbers(history) == {message.tool_calls[0].id: "0", message.tool_calls[1].id: "1"}
