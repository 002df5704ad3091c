"""Constrained decoding on a random-weight model: whatever it samples, the reply follows the
grammar. Replies run through the real engine (its sampler applies the processors) and are
read back with the Cohere parser, as the server does."""

import asyncio
import itertools
import json

import jsonschema
import pytest
import torch

from northmk.engine import AsyncEngine, EngineConfig, GenerationRequest, SamplingParams
from northmk.engine.constrained import (
    ConstraintError, GrammarLogitsProcessor, SuppressTokens, chat_grammar, chat_logits_processors, compile_grammar,
    ll_tokenizer,
)
from northmk.parsing import parse_reply
from northmk.server.schemas import ResponseFormat

CHOICES = 4  # one request, n choices: choice i samples with seed + i
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
REQUEST_NUMBERS = itertools.count()


@pytest.fixture
async def engine(tiny_checkpoint):
    engine = AsyncEngine.from_config(EngineConfig(model=tiny_checkpoint, max_batch=8))
    await engine.start()
    yield engine
    await engine.shutdown()


def prompt_ids(engine, reasoning, tools=None):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    return engine.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, reasoning=reasoning)


async def sample(engine, prompt, processors, seed=0, max_tokens=160, n=CHOICES):
    """Sampled replies (temperature 1) as (token ids, text with special tokens) per choice."""
    params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, skip_special_tokens=False,
                            logits_processors=processors)
    ids, text = {}, {}
    async for out in engine.generate(GenerationRequest(f"r{next(REQUEST_NUMBERS)}", prompt, params)):
        for c in out.outputs:
            ids.setdefault(c.index, []).extend(c.token_ids)
            text[c.index] = text.get(c.index, "") + c.text
    return [(ids[i], text[i]) for i in range(n)]


def grammar_processor(processors):
    [grammar] = [p for p in processors if isinstance(p, GrammarLogitsProcessor)]
    return grammar


def assert_complete(engine, processors, ids):
    assert ids[-1] in engine.eos_ids, "the reply must end on end-of-turn, not be cut by max_tokens"
    assert grammar_processor(processors).is_complete(ids)


@pytest.mark.parametrize("reasoning", [False, True])
async def test_json_schema_replies_parse_and_conform(engine, reasoning):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    processors = chat_logits_processors(engine.tokenizer, engine.eos_ids, response_format=response_format,
                                        reasoning=reasoning, max_reasoning_tokens=6)
    for ids, text in await sample(engine, prompt_ids(engine, reasoning), processors):
        assert_complete(engine, processors, ids)
        message = parse_reply(text, reasoning=reasoning)
        jsonschema.validate(json.loads(message.content), PERSON)
        assert message.tool_calls == []


async def test_json_object_replies_are_json_objects(engine):
    """(The server's msgspec ResponseFormat is accepted as is.)"""
    schema = {"type": "object", "maxProperties": 2, "additionalProperties": {"type": "integer", "maximum": 999}}
    formats = [ResponseFormat("json_object"), ResponseFormat("json_schema", {"name": "o", "schema": schema})]
    runs = [chat_logits_processors(engine.tokenizer, engine.eos_ids, response_format=f, reasoning=False)
            for f in formats]
    results = await asyncio.gather(*(
        sample(engine, prompt_ids(engine, False), processors, seed=0, max_tokens=512, n=3) for processors in runs
    ))
    for processors, replies, checked in zip(runs, results, [{"type": "object"}, schema]):
        complete = [(ids, text) for ids, text in replies if ids[-1] in engine.eos_ids]
        assert complete, "some replies must end within max_tokens"
        for ids, text in replies:
            if ids[-1] not in engine.eos_ids:  # an unbounded object may outgrow max_tokens: still a valid prefix
                assert not grammar_processor(processors).error(ids)
        for ids, text in complete:
            assert_complete(engine, processors, ids)
            jsonschema.validate(json.loads(parse_reply(text, reasoning=False).content), checked)


@pytest.mark.parametrize("reasoning", [False, True])
async def test_required_tool_choice_gives_valid_calls(engine, reasoning):
    processors = chat_logits_processors(engine.tokenizer, engine.eos_ids, tools=TOOLS, tool_choice="required",
                                        reasoning=reasoning, max_reasoning_tokens=6)
    prompt = prompt_ids(engine, reasoning, TOOLS)
    for ids, text in await sample(engine, prompt, processors, max_tokens=700):  # room for 8 calls
        assert_complete(engine, processors, ids)
        message = parse_reply(text, reasoning=reasoning)
        assert 1 <= len(message.tool_calls) <= 8
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


async def test_a_named_tool_is_called_exactly_once(engine):
    choice = {"type": "function", "function": {"name": "get_time"}}
    processors = chat_logits_processors(engine.tokenizer, engine.eos_ids, tools=TOOLS, tool_choice=choice,
                                        reasoning=False)
    for ids, text in await sample(engine, prompt_ids(engine, False, TOOLS), processors, seed=11):
        assert_complete(engine, processors, ids)
        [call] = parse_reply(text, reasoning=False).tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME)


async def test_each_choice_of_a_request_keeps_its_own_grammar_state(engine):
    processors = chat_logits_processors(engine.tokenizer, engine.eos_ids, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, reasoning=False)
    replies = await sample(engine, prompt_ids(engine, False, TOOLS), processors, seed=7)
    assert len({tuple(ids) for ids, _ in replies}) > 1  # the rows really differ
    for ids, text in replies:
        assert_complete(engine, processors, ids)
        [call] = parse_reply(text, reasoning=False).tool_calls
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


async def test_tool_choice_none_never_starts_an_action(engine, tokenizer):
    start_action = tokenizer.token_to_id("<|START_ACTION|>")
    [suppress] = chat_logits_processors(tokenizer, engine.eos_ids, tools=TOOLS, tool_choice="none")
    assert isinstance(suppress, SuppressTokens)
    logits = torch.zeros(tokenizer.vocab_size)
    logits[start_action] = 1e4  # the model wants nothing else
    out = suppress([], logits.clone())
    assert out[start_action] == float("-inf") and torch.isfinite(out[:start_action]).all()
    for ids, _ in await sample(engine, prompt_ids(engine, True, TOOLS), [suppress], seed=1, max_tokens=64):
        assert start_action not in ids


def grammar_walker(tokenizer, **grammar):
    """A function that feeds a text's tokens through a fresh processor for the grammar:
    False as soon as one is masked, else whether the reply is complete."""
    eos = (tokenizer.eos_token_id,)
    matcher = compile_grammar(chat_grammar(**grammar), tokenizer, eos)

    def walk(text):
        processor, out = GrammarLogitsProcessor(matcher, eos, tokenizer.vocab_size), []
        for token in tokenizer.encode(text):
            if processor(out, torch.zeros(tokenizer.vocab_size))[token] == float("-inf"):
                return False
            out.append(token)
        return processor.is_complete(out)

    return walk


CALL = '{"tool_call_id": "%s", "tool_name": "get_time", "parameters": {"zone": "UTC"}}'


def test_call_numbers_continue_from_earlier_turns(tokenizer):
    walk = grammar_walker(tokenizer, tools=TOOLS, tool_choice="required", reasoning=False, first_call_number=3)
    assert walk(f"<|START_ACTION|>[{CALL % 3}, {CALL % 4}]<|END_ACTION|><|END_OF_TURN_TOKEN|>")
    assert not walk(f"<|START_ACTION|>[{CALL % 0}]<|END_ACTION|>")
    assert not walk(f"<|START_ACTION|>[{CALL % 3}, {CALL % 3}]<|END_ACTION|>")


def test_one_call_only_when_parallel_calls_are_off(tokenizer):
    walk = grammar_walker(tokenizer, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, reasoning=False)
    assert walk(f"<|START_ACTION|>[{CALL % 0}]<|END_ACTION|><|END_OF_TURN_TOKEN|>")
    assert not walk(f"<|START_ACTION|>[{CALL % 0}, {CALL % 1}]<|END_ACTION|>")


def test_reasoning_is_free_text_until_end_thinking(tokenizer):
    walk = grammar_walker(tokenizer, response_format={"type": "json_object"}, reasoning=True)
    assert walk('Some thoughts,\nover lines.<|END_THINKING|><|START_TEXT|>{}<|END_TEXT|><|END_OF_TURN_TOKEN|>')
    assert not walk("thoughts<|START_TEXT|>")  # no answer before the reasoning ends
    assert not walk('<|END_THINKING|><|START_TEXT|>{}<|END_TEXT|><|START_TEXT|>')  # nothing after the answer


def test_plain_requests_need_no_processor(tokenizer):
    assert chat_logits_processors(tokenizer, (tokenizer.eos_token_id,)) == []
    assert chat_logits_processors(tokenizer, (tokenizer.eos_token_id,), tools=TOOLS, tool_choice="auto") == []
    assert chat_logits_processors(tokenizer, (tokenizer.eos_token_id,), response_format={"type": "text"}) == []


def test_auto_tools_with_a_response_format_allow_either_reply(tokenizer):
    walk = grammar_walker(tokenizer, tools=TOOLS, tool_choice="auto", response_format={"type": "json_object"},
                          reasoning=False)
    assert walk('<|START_TEXT|>{"a": 1}<|END_TEXT|><|END_OF_TURN_TOKEN|>')
    assert walk(f"<|START_ACTION|>[{CALL % 0}]<|END_ACTION|><|END_OF_TURN_TOKEN|>")
    assert not walk("<|START_TEXT|>not json<|END_TEXT|>")
    no_tools = grammar_walker(tokenizer, tools=TOOLS, tool_choice="none", response_format={"type": "json_object"},
                              reasoning=False)
    assert no_tools('<|START_TEXT|>{"a": 1}<|END_TEXT|><|END_OF_TURN_TOKEN|>')
    assert not no_tools(f"<|START_ACTION|>[{CALL % 0}]<|END_ACTION|>")


def test_a_forced_call_wins_over_the_response_format(tokenizer):
    walk = grammar_walker(tokenizer, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"},
                          reasoning=False)
    assert walk(f"<|START_ACTION|>[{CALL % 0}]<|END_ACTION|><|END_OF_TURN_TOKEN|>")
    assert not walk('<|START_TEXT|>{"a": 1}<|END_TEXT|>')


@pytest.mark.parametrize("kwargs, param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}], tool_choice="required"),
     "tools[0].function.name"),
    (dict(tools=["get_time"], tool_choice="required"), "tools[0]"),
    (dict(tools=TOOLS + TOOLS[:1], tool_choice="required"), "tools[2].function.name"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "string"}}),
     "response_format.json_schema.schema"),
])
def test_requests_that_cannot_be_enforced_are_rejected_clearly(tokenizer, kwargs, param):
    with pytest.raises(ConstraintError) as err:
        chat_logits_processors(tokenizer, (tokenizer.eos_token_id,), **kwargs)
    assert err.value.param == param


def test_an_unusable_schema_is_rejected_not_ignored(tokenizer):
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}
    with pytest.raises(ConstraintError, match="cannot enforce"):
        chat_logits_processors(tokenizer, (tokenizer.eos_token_id,), response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True},
        })


def test_the_llguidance_tokenizer_is_built_once_per_tokenizer(tokenizer):
    eos = (tokenizer.eos_token_id,)
    assert ll_tokenizer(tokenizer, eos) is ll_tokenizer(tokenizer, eos)
    assert ll_tokenizer(tokenizer, eos).vocab_size == tokenizer.vocab_size


def test_masks_cover_the_models_vocabulary_and_end_a_broken_row(tokenizer):
    eos = (tokenizer.eos_token_id,)
    lark = chat_grammar(response_format={"type": "json_object"}, reasoning=False)
    processor = GrammarLogitsProcessor(compile_grammar(lark, tokenizer, eos), eos, tokenizer.vocab_size)
    wider = processor([], torch.zeros(tokenizer.vocab_size + 64))  # a model with padded embedding rows
    assert torch.isinf(wider[tokenizer.vocab_size:]).all()
    assert torch.isfinite(wider).nonzero().flatten().tolist() == [tokenizer.token_to_id("<|START_TEXT|>")]
    out = [tokenizer.token_to_id("<|END_TEXT|>")]  # a token the grammar refuses (e.g. forced by ignore_eos)
    masked = processor(out, torch.zeros(tokenizer.vocab_size))
    assert torch.isfinite(masked).nonzero().flatten().tolist() == list(eos)
    assert not processor.is_complete(out)
