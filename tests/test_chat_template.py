"""The built-in Cohere chat template and checkpoint templates, rendered as transformers does.

Oracles: transformers' `apply_chat_template` on the same files, and Cohere's own renderer
(cohere-melody `render_cmd4`) for the same conversations; melody's cmd4 parser must read
model output written in this format.
"""

import json

import cohere_melody
import pytest

from northmk.tokenizer import BUILTIN_TEMPLATE_PATH, ChatTemplateError, IncrementalDetokenizer, Tokenizer
from northmk.tokenizer_files import write_tokenizer_files

GEN_PROMPT = "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Weather for a "city", in °C',
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "user only": ([{"role": "user", "content": "Hello!"}], None),
    "system and unicode": (
        [{"role": "system", "content": "Be brief. Réponds en français 🎉"}, {"role": "user", "content": "Ça va?\nOui."}],
        None,
    ),
    "multi turn": (
        [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Sum a list."},
            {"role": "assistant", "content": "Use `sum(xs)`."},
            {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "squares?"}]},
        ],
        None,
    ),
    "reasoning in history": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6", "reasoning": "Three and three."},
            {"role": "user", "content": "Thanks"},
        ],
        None,
    ),
    "tools, calls and results": (
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "I will look both up.",
                "tool_calls": [
                    call("call_a", "get_weather", {"city": "Paris"}),
                    call("call_b", "get_weather", {"city": "Rome"}),
                ],
            },
            {"role": "tool", "tool_call_id": "call_b", "content": "rainy"},
            {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 24°C"},
            {"role": "assistant", "content": "Paris is sunny, Rome is rainy."},
            {"role": "user", "content": "Search the news."},
            {"role": "assistant", "tool_calls": [call("call_c", "search", {"query": "news", "n": 3})]},
            {"role": "tool", "tool_call_id": "call_c", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        ],
        [WEATHER, SEARCH],
    ),
    "tools offered, not used": ([{"role": "user", "content": "Hi"}], [WEATHER]),
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat")
    write_tokenizer_files(directory, 4096)
    return directory


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


# ---- against transformers --------------------------------------------------------------
@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("reasoning", [{}, {"reasoning": False}, {"enable_thinking": False}, {"reasoning": True}])
def test_renders_like_transformers(tok, hf_tok, name, add_generation_prompt, reasoning):
    messages, tools = CONVERSATIONS[name]
    ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, **reasoning)
    theirs = hf_tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **reasoning
    )
    assert ours == theirs
    ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **reasoning)
    assert ids == hf_tok.encode(theirs, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_checkpoint_templates_use_transformers_globals_and_filters(tok, hf_tok):
    template = (
        "{% for m in messages %}{{ m | tojson(indent=2, sort_keys=True) }}{% generation %}<{{ m.role }}>{% endgeneration %}"
        "{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}{% endfor %}"
        "{{ bos_token }}{{ eos_token }}{{ strftime_now('%Y') | length }}{% if add_generation_prompt %}GO{% endif %}"
    )
    messages = [{"role": "user", "content": "<b>&é</b>", "extra": None}]
    ours = tok.apply_chat_template(messages, chat_template=template)
    assert ours == hf_tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": ""}], chat_template=template)


# ---- against Cohere's own renderer -------------------------------------------------------
def melody_messages(messages):
    """The same conversation in melody's message shape."""
    out = []
    for m in messages:
        content = m.get("content") or []
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        role = "chatbot" if m["role"] == "assistant" else m["role"]
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning:
            parts = [{"type": "thinking", "thinking": reasoning}, *parts]
        item = {"role": role, "content": parts}
        if m.get("tool_calls"):
            item["tool_calls"] = [
                {"id": c["id"], "name": c["function"]["name"], "parameters": json.dumps(c["function"]["arguments"])}
                for c in m["tool_calls"]
            ]
        if "tool_call_id" in m:
            item["tool_call_id"] = m["tool_call_id"]
        out.append(item)
    return out


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("reasoning", [True, False])
def test_renders_like_cohere_melody(tok, name, reasoning):
    messages, tools = CONVERSATIONS[name]
    config = {"messages": melody_messages(messages), "grounding": "disabled"}
    if tools:
        config["available_tools"] = [t["function"] | {"description": t["function"].get("description", "")} for t in tools]
    expected = cohere_melody.render_cmd4(config) + "<|START_THINKING|>" + ("" if reasoning else "<|END_THINKING|>")
    assert tok.apply_chat_template(messages, tools=tools, reasoning=reasoning) == expected


# ---- the generation prompt and the reasoning switch ----------------------------------------
@pytest.mark.parametrize(
    "kwargs, suffix",
    [
        ({}, GEN_PROMPT),
        ({"reasoning": True}, GEN_PROMPT),
        ({"reasoning": False}, GEN_PROMPT + "<|END_THINKING|>"),
        ({"enable_thinking": False}, GEN_PROMPT + "<|END_THINKING|>"),
        ({"reasoning_effort": "none"}, GEN_PROMPT + "<|END_THINKING|>"),
        ({"reasoning_effort": "high"}, GEN_PROMPT),
    ],
)
def test_generation_prompt_ends_as_the_model_expects(tok, kwargs, suffix):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], **kwargs)
    assert text.endswith("<|END_OF_TURN_TOKEN|>" + suffix)


def test_without_generation_prompt_the_text_ends_after_the_last_turn(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert text.endswith("<|USER_TOKEN|><|START_TEXT|>Hi<|END_TEXT|><|END_OF_TURN_TOKEN|>")


def test_tool_calls_and_results_use_the_model_numbering(tok):
    messages, tools = CONVERSATIONS["tools, calls and results"]
    text = tok.apply_chat_template(messages, tools=tools)
    assert '{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert '{"tool_call_id": "2", "tool_name": "search", "parameters": {"query": "news", "n": 3}}' in text
    assert text.count("<|START_TOOL_RESULT|>") == 2, "consecutive tool messages share one system turn"
    rome = text.index('"tool_call_id": "1",\n        "results": {\n            "0": {"content": "rainy"}')
    paris = text.index('"tool_call_id": "0",\n        "results": {\n            "0": {"content": "sunny, 24°C"}')
    assert rome < paris


def test_json_string_arguments_render_like_parsed_ones(tok):
    def conversation(arguments):
        return [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call("c", "f", arguments)]}]

    assert tok.apply_chat_template(conversation('{"a": [1, 2]}')) == tok.apply_chat_template(conversation({"a": [1, 2]}))


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "narrator", "content": "x"}], 'role "narrator"'),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], "only text content parts"),
        ([{"role": "user", "content": {"text": "x"}}], "string or a list of parts"),
        ([{"role": "tool", "content": "x"}], "needs a tool_call_id"),
        ([{"content": "no role"}], "needs a string 'role'"),
        (["just a string"], "must be an object"),
        ("Hello", "must be a list"),
    ],
)
def test_messages_it_cannot_render_are_clear_errors(tok, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)


# ---- where the template comes from -------------------------------------------------------
def checkpoint_without_template(src, dst, config_extra=None):
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text()) | (config_extra or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_template_file_wins(tok):
    assert tok.template_origin == "chat_template.jinja"


def test_template_from_tokenizer_config_string(tok_dir, tmp_path):
    d = checkpoint_without_template(tok_dir, tmp_path / "c", {"chat_template": "{{ messages[0].content }}!"})
    tok = Tokenizer.from_pretrained(d)
    assert tok.template_origin == "tokenizer_config.json"
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"


def test_template_from_a_list_of_named_templates_uses_default(tok_dir, tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    d = checkpoint_without_template(tok_dir, tmp_path / "c", {"chat_template": named})
    assert Tokenizer.from_pretrained(d).apply_chat_template([]) == "D"


def test_malformed_template_list_is_a_clear_error(tok_dir, tmp_path):
    d = checkpoint_without_template(tok_dir, tmp_path / "c", {"chat_template": [{"name": "x"}]})
    with pytest.raises(ChatTemplateError, match="list of"):
        Tokenizer.from_pretrained(d)


def test_no_template_falls_back_to_the_builtin(tok_dir, tmp_path):
    tok = Tokenizer.from_pretrained(checkpoint_without_template(tok_dir, tmp_path / "c"))
    assert tok.template_origin == "builtin"
    assert tok.chat_template == BUILTIN_TEMPLATE_PATH.read_text()


def test_template_syntax_error_is_a_clear_error(tok):
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        tok.apply_chat_template([], chat_template="{% if %}")


# ---- melody reads model output in this format ----------------------------------------------
def parse_with_melody(tok, output):
    """Tokenize a model output, stream it through the detokenizer into melody's cmd4 parser."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    parser = cohere_melody.PyFilter.cmd4()
    results = [parser.write_decoded(d) for d in map(detok.push, tok.encode(output)) if d]
    results += [parser.write_decoded(detok.flush()), parser.flush_partials()]
    content = "".join(r.content or "" for r in results)
    reasoning = "".join(r.reasoning or "" for r in results)
    calls = {}
    for r in results:
        for c in r.tool_calls:
            entry = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += c.id or ""
            entry["name"] += c.name or ""
            entry["arguments"] += c.arguments or ""
    return reasoning, content, [calls[i] for i in sorted(calls)]


def test_melody_parses_a_text_reply(tok):
    output = "The user greets me in French.<|END_THINKING|><|START_TEXT|>Bonjour ! Ça va ? 🎉<|END_TEXT|><|END_OF_TURN_TOKEN|>"
    assert parse_with_melody(tok, output) == ("The user greets me in French.", "Bonjour ! Ça va ? 🎉", [])


def test_melody_parses_tool_calls(tok):
    output = (
        "Look up both cities.<|END_THINKING|><|START_ACTION|>[\n"
        '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}},\n'
        '    {"tool_call_id": "1", "tool_name": "get_weather", "parameters": {"city": "Zürich"}}\n'
        "]<|END_ACTION|><|END_OF_TURN_TOKEN|>"
    )
    reasoning, content, calls = parse_with_melody(tok, output)
    assert (reasoning, content) == ("Look up both cities.", "")
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("0", "get_weather", {"city": "Paris"}),
        ("1", "get_weather", {"city": "Zürich"}),
    ]


def test_prompt_plus_output_is_one_well_formed_turn(tok):
    """What melody parses is exactly what follows our generation prompt."""
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    output = "Greet back.<|END_THINKING|><|START_TEXT|>Hello!<|END_TEXT|><|END_OF_TURN_TOKEN|>"
    history = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}],
        add_generation_prompt=False,
    )
    assert prompt + output == history
