"""Chat templates rendered with jinja2 the way transformers' `apply_chat_template` does.

Same environment (sandboxed, trim_blocks, lstrip_blocks, loop controls, a no-op
`{% generation %}` tag), same globals (`raise_exception`, `strftime_now`) and the same
`tojson` (no HTML escaping, `ensure_ascii=False`, indent/separators/sort_keys options), so a
checkpoint's template renders here exactly as it does there.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

BUILTIN_TEMPLATE_PATH = Path(__file__).resolve().parent.parent / "templates" / "cohere.jinja"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # first: the name templates read


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template raised, or the input is malformed)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from None


def plain(value: Any) -> Any:
    """Messages as plain JSON-like data: mappings and dataclasses to dicts, tuples to lists."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ChatTemplateError(f"cannot render a value of type {type(value).__name__} in a chat message")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Copies of the messages as transformers hands them to templates.

    Keys whose value is None are dropped (OpenAI clients send `content: null` beside tool
    calls); reasoning given under any of REASONING_FIELDS is visible under all of them.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (list, tuple)):
        raise ChatTemplateError("messages must be a list of message objects")
    normalized = []
    for i, message in enumerate(plain(list(messages))):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] needs a string 'role'")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def render(source: str, messages: Any, **variables: Any) -> str:
    """Render a chat template; template errors become ChatTemplateError with the template's message."""
    template = compile_template(source)
    try:
        return template.render(messages=normalize_messages(messages), **plain(variables))
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc.message or exc}") from None


def select_template(template: str | list | None, name: str | None = None) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of {"name", "template"}."""
    if template is None or isinstance(template, str):
        return template
    if not isinstance(template, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template
    ):
        raise ChatTemplateError("chat_template must be a string or a list of {'name', 'template'} objects")
    named = {t["name"]: t["template"] for t in template}
    if name is not None:
        if name not in named:
            raise ChatTemplateError(f"no chat template named {name!r} (have {sorted(named)})")
        return named[name]
    return named.get("default")
