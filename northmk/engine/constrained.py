"""Constrained decoding with llguidance: token masks that make a reply follow a grammar.

What a chat request can constrain, and how the reply is shaped (Cohere's format):

    reasoning on:  <free reasoning> <|END_THINKING|> REPLY <EOS>
    reasoning off: REPLY <EOS>          (the prompt already closed the thinking block)

    json reply:    <|START_TEXT|> JSON <|END_TEXT|>
    action reply:  <|START_ACTION|>[{"tool_call_id": "N", "tool_name": "f", "parameters": ARGS}, ...]<|END_ACTION|>

Reasoning is kept (free text without special tokens, optionally capped at
`max_reasoning_tokens`) rather than switched off: the constraint applies to what follows
`<|END_THINKING|>`. `response_format` json_object / json_schema constrains the text reply;
`tool_choice` "required" (one or more calls, one when parallel_tool_calls is false) or a
named function (exactly one call) constrains the action reply, each tool's arguments by its
own JSON schema; with tools, tool_choice "auto" and a response_format, either reply is
allowed. `tool_choice: "none"` only masks `<|START_ACTION|>`. Whitespace inside JSON is
bounded (an answer may be compact or pretty-printed, tool arguments are in the template's
single-space form; a weak model cannot loop on blanks); a reply longer than max_tokens is
cut there.

`GrammarLogitsProcessor` is a `LogitsProcessor`: it runs in the sampling step (the decode
thread, off the event loop), keeps one matcher per choice row, advances it with the
row's sampled tokens and masks the rest to -inf. Compiling a grammar can take a while for
big schemas: build processors with `asyncio.to_thread(chat_logits_processors, ...)`.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from typing import Any, Mapping

import llguidance as llg
import msgspec
import torch

from ..tokenizer import Tokenizer
from .types import LogitsProcessor

END_THINKING, START_TEXT, END_TEXT = "<|END_THINKING|>", "<|START_TEXT|>", "<|END_TEXT|>"
START_ACTION, END_ACTION = "<|START_ACTION|>", "<|END_ACTION|>"
MAX_PARALLEL_CALLS = 8  # calls one "required" reply may hold
# Between JSON tokens of an answer: a space or two, or one line break and its indentation.
JSON_WHITESPACE = r"[\x20\x09]{0,2}(\x0D?\x0A[\x20\x09]{0,24})?"
# Between JSON tokens of tool arguments: the chat template's own `tojson` form, one space at most.
ARGUMENTS_WHITESPACE = r"\x20?"
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
NEG_INF = float("-inf")
BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # mask word -> its 32 token bits, low bit first


class ConstraintError(ValueError):
    """The request's response_format / tools / tool_choice cannot be enforced (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---- grammars (Lark, as llguidance reads it) -----------------------------------------------
def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_rule(name: str, schema: Any, strict: bool, param: str, whitespace: str = JSON_WHITESPACE) -> str:
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise ConstraintError(f"{param} must be a JSON schema object", param)
    options = {"whitespace_pattern": whitespace, "lenient": not strict}
    schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}
    return f"{name}: %json {json.dumps(schema, ensure_ascii=False)}"


def response_format_rules(response_format: Mapping[str, Any]) -> list[str] | None:
    """`text_reply` rules for a response_format, or None for plain text."""
    body = response_format_json(response_format)
    if body is None:
        return None
    return [f"text_reply: {START_TEXT} text_json {END_TEXT}", body]


def response_format_json(response_format: Mapping[str, Any]) -> str | None:
    """The `text_json` rule a response_format asks for, or None for plain text."""
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        body = _json_rule("text_json", {"type": "object"}, strict=True, param="response_format")
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConstraintError("response_format json_schema needs a 'json_schema' object with a 'schema'",
                                  "response_format.json_schema")
        strict = bool(spec.get("strict")) if spec.get("strict") is not None else False
        body = _json_rule("text_json", spec["schema"], strict, "response_format.json_schema.schema")
    else:
        raise ConstraintError(f"unsupported response_format type {kind!r}", "response_format.type")
    return body


def tool_specs(tools: list[dict[str, Any]] | None) -> dict[str, tuple[Any, bool]]:
    """name -> (parameters schema, strict) of the request's function tools."""
    specs: dict[str, tuple[Any, bool]] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or tool.get("type", "function") != "function":
            raise ConstraintError("every tool must be {'type': 'function', 'function': {'name': ...}}", f"tools[{i}]")
        if not TOOL_NAME.match(name):
            raise ConstraintError(f"tool name {name!r} must match {TOOL_NAME.pattern}", f"tools[{i}].function.name")
        if name in specs:
            raise ConstraintError(f"tool {name!r} is declared twice", f"tools[{i}].function.name")
        specs[name] = (fn.get("parameters") or {"type": "object"}, bool(fn.get("strict")))
    return specs


def action_rules(
    specs: dict[str, tuple[Any, bool]], names: list[str], max_calls: int, first_call_number: int
) -> list[str]:
    """`action_reply` rules: 1..max_calls calls numbered from first_call_number, each to one
    of `names` with arguments that satisfy that tool's schema."""
    assert names and max_calls >= 1
    rules = [
        f'action_reply: {START_ACTION} "[" WS? calls_0 WS? "]" {END_ACTION}',
        r"WS: /[ \t\n]{1,16}/",
    ]
    for k in range(max_calls):
        rest = f' ("," WS? calls_{k + 1})?' if k + 1 < max_calls else ""
        rules.append(f"calls_{k}: call_{k}{rest}")
        head = _lark_str(f'{{"tool_call_id": "{first_call_number + k}", "tool_name": ')
        rules.append(f"call_{k}: {head} tool_args \"}}\"")
    choices = " | ".join(f"tool_{i}" for i in range(len(names)))
    rules.append(f"tool_args: {choices}")
    for i, name in enumerate(names):
        rules.append(f"tool_{i}: {_lark_str(json.dumps(name) + ', ' + json.dumps('parameters') + ': ')} args_{i}")
        schema, strict = specs[name]
        param = f"tools[{name}].function.parameters"
        rules.append(_json_rule(f"args_{i}", schema, strict, param, ARGUMENTS_WHITESPACE))
    return rules


def chat_grammar(
    *,
    response_format: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    reasoning: bool = True,
    max_reasoning_tokens: int | None = None,
    first_call_number: int = 0,
) -> str | None:
    """The Lark grammar a chat reply must follow, or None when nothing is constrained."""
    specs = tool_specs(tools)
    text_rules = response_format_rules(response_format or {})
    forced = _forced_tools(specs, tool_choice)
    if forced is not None:  # a forced call wins over the answer's format
        text_rules, callable_names = None, forced
    elif text_rules is not None and specs and tool_choice != "none":
        callable_names = list(specs)  # either a formatted answer or a call
    elif text_rules is not None:
        callable_names = []
    else:
        return None
    max_calls = 1 if parallel_tool_calls is False or isinstance(tool_choice, Mapping) else MAX_PARALLEL_CALLS
    replies, rules = [], []
    if text_rules is not None:
        replies.append("text_reply")
        rules += text_rules
    if callable_names:
        replies.append("action_reply")
        rules += action_rules(specs, callable_names, max_calls, first_call_number)
    head = ["start: reply"]
    if reasoning:
        cap = "" if max_reasoning_tokens is None else f"[max_tokens={int(max_reasoning_tokens)}]"
        head = [f"start: reasoning {END_THINKING} reply", f"reasoning{cap}: /(.|\\n)*/"]
    return "\n".join([*head, f"reply: {' | '.join(replies)}", *rules])


def _forced_tools(
    specs: dict[str, tuple[Any, bool]], tool_choice: str | Mapping[str, Any] | None
) -> list[str] | None:
    """The tools a reply must call (tool_choice "required" or a named function), else None."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        if not specs:
            raise ConstraintError("tool_choice 'required' needs at least one tool", "tool_choice")
        return list(specs)
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ConstraintError("tool_choice must be 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in specs:
            raise ConstraintError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return [name]
    raise ConstraintError(f"unsupported tool_choice {tool_choice!r}", "tool_choice")


# ---- tokenizer and matchers ----------------------------------------------------------------
# Tokenizer -> {eos ids: LLTokenizer}; dropped with the Tokenizer.
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer: Tokenizer, eos_ids: tuple[int, ...]) -> llg.LLTokenizer:
    """llguidance's view of a tokenizer (built once per tokenizer and EOS set; ~0.1-1 s)."""
    with _tokenizers_lock:
        per_eos = _tokenizers.setdefault(tokenizer, {})
        if eos_ids not in per_eos:
            per_eos[eos_ids] = llg.LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=list(eos_ids)
            )
        return per_eos[eos_ids]


def compile_grammar(lark: str, tokenizer: Tokenizer, eos_ids: tuple[int, ...]) -> llg.LLMatcher:
    """A matcher at the start of the reply; ConstraintError when the grammar/schema is unusable."""
    lltok = ll_tokenizer(tokenizer, eos_ids)
    grammar = llg.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if is_error:
        raise ConstraintError(f"cannot enforce this schema: {messages[0].splitlines()[0]}")
    matcher = llg.LLMatcher(lltok, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"cannot enforce this schema: {matcher.get_error().splitlines()[0]}")
    return matcher


class _Row:
    """One choice row's matcher and how many of its output ids it has consumed."""

    def __init__(self, matcher: llg.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.consumed = 0
        self.words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # bitmask, 1 bit per token

    def advance(self, output_ids: list[int]) -> None:
        for token in output_ids[self.consumed:]:
            self.matcher.consume_token(token)  # a refused token leaves the matcher in its error state
        self.consumed = len(output_ids)

    def allowed(self) -> torch.Tensor:
        """bool [tokenizer vocab]: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)  # drops the GIL
        bits = (self.words.unsqueeze(1) >> BIT_SHIFTS) & 1  # [W, 32]
        return bits.view(-1).bool()


class GrammarLogitsProcessor:
    """Masks what the grammar forbids. One instance per request; one matcher per choice row
    (rows are told apart by their output-id lists, which the sampler shares, not copies)."""

    def __init__(self, matcher: llg.LLMatcher, eos_ids: tuple[int, ...], vocab_size: int):
        self._start = matcher
        self._eos_ids = list(eos_ids)
        self._vocab_size = vocab_size
        self._rows: dict[int, tuple[list[int], _Row]] = {}  # id(output_ids) -> (the list, kept alive; row)

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        row = self._row(output_ids)
        row.advance(output_ids)
        if row.matcher.is_error():
            allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
            allowed[self._eos_ids] = True  # end the reply rather than sample from nothing
        else:
            allowed = _fit(row.allowed(), logits.shape[0])
        return logits.masked_fill_(~allowed, NEG_INF)

    def is_complete(self, output_ids: list[int]) -> bool:
        """True when the row's tokens (its EOS included) form a whole reply of the grammar."""
        row = self._row(output_ids)
        row.advance(output_ids)
        return not row.matcher.is_error() and row.matcher.is_accepting()

    def error(self, output_ids: list[int]) -> str:
        """Why the row's tokens left the grammar ("" while they follow it)."""
        row = self._row(output_ids)
        row.advance(output_ids)
        return row.matcher.get_error()

    def _row(self, output_ids: list[int]) -> _Row:
        entry = self._rows.get(id(output_ids))
        if entry is None:
            entry = self._rows[id(output_ids)] = (output_ids, _Row(self._start.deep_copy(), self._vocab_size))
        return entry[1]


def _fit(allowed: torch.Tensor, size: int) -> torch.Tensor:
    """The tokenizer's mask over the model's vocabulary: ids past the tokenizer are never allowed."""
    if allowed.shape[0] >= size:
        return allowed[:size]
    return torch.cat([allowed, torch.zeros(size - allowed.shape[0], dtype=torch.bool)])


class SuppressTokens:
    """Never sample the given ids (tool_choice "none": no <|START_ACTION|>)."""

    def __init__(self, ids: list[int]):
        self.ids = torch.tensor(ids, dtype=torch.long)

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.ids] = NEG_INF
        return logits


def chat_logits_processors(
    tokenizer: Tokenizer,
    eos_ids: tuple[int, ...],
    *,
    response_format: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    reasoning: bool = True,
    max_reasoning_tokens: int | None = None,
    first_call_number: int = 0,
) -> list[LogitsProcessor]:
    """The processors a chat request needs (possibly none). Blocking: grammar compilation.

    The request fields may be plain JSON values or the server's msgspec structs."""
    response_format, tools, tool_choice = (_plain(v) for v in (response_format, tools, tool_choice))
    processors: list[LogitsProcessor] = []
    if tool_choice == "none":
        processors.append(SuppressTokens([_special_id(tokenizer, START_ACTION)]))
    lark = chat_grammar(
        response_format=response_format, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls, reasoning=reasoning,
        max_reasoning_tokens=max_reasoning_tokens, first_call_number=first_call_number,
    )
    if lark is not None:
        for token in (END_THINKING, START_TEXT, END_TEXT, START_ACTION, END_ACTION):
            _special_id(tokenizer, token)
        matcher = compile_grammar(lark, tokenizer, eos_ids)
        processors.append(GrammarLogitsProcessor(matcher, eos_ids, tokenizer.vocab_size))
    return processors


def completion_logits_processors(
    tokenizer: Tokenizer, eos_ids: tuple[int, ...], *, response_format: Mapping[str, Any] | None = None
) -> list[LogitsProcessor]:
    """The processors a text completion needs: its whole output is the JSON a response_format
    asks for (no chat wrapper), then EOS. Blocking: grammar compilation."""
    body = response_format_json(_plain(response_format) or {})
    if body is None:
        return []
    matcher = compile_grammar("\n".join(["start: text_json", body]), tokenizer, eos_ids)
    return [GrammarLogitsProcessor(matcher, eos_ids, tokenizer.vocab_size)]


def _plain(value: Any) -> Any:
    return msgspec.to_builtins(value) if value is not None else None


def _special_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ConstraintError(f"this model's tokenizer has no {token} token; structured output is unavailable")
    return token_id
