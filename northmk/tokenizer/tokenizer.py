"""The runtime tokenizer: a checkpoint's tokenizer.json plus its chat template.

The chat template comes from, in order: `chat_template.jinja` beside tokenizer.json,
tokenizer_config.json's `chat_template` (a string, or a list of named templates of which
"default" is used), else northmk's built-in Cohere template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from .chat_template import BUILTIN_TEMPLATE_PATH, ChatTemplateError, render, select_template

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, or ids it cannot decode."""


class Tokenizer:
    def __init__(self, backend: Backend, special_tokens: dict[str, str], chat_template: str, template_origin: str):
        self.backend = backend
        self.special_tokens = special_tokens  # bos_token/eos_token/... -> token text
        self.chat_template = chat_template
        self.template_origin = template_origin  # "chat_template.jinja" | "tokenizer_config.json" | "builtin"
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.all_special_ids = sorted(i for i, t in added.items() if t.special)
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")
        self.pad_token_id = self._id_of("pad_token")

    # ---- loading -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerError(f"tokenizer directory {directory} does not exist")
        backend = _load_backend(directory / "tokenizer.json")
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        special_tokens = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token_text(config.get(name, special_map.get(name)), name)
            if token is not None:
                special_tokens[name] = token
        template, origin = _find_template(directory, config)
        return cls(backend, special_tokens, template, origin)

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{name} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    # ---- tokens --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; ids past the tokenizer's vocabulary (rows a model pads its
        embedding with) have no text and decode to nothing."""
        self.check_ids(ids)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def check_ids(self, ids: list[int]) -> None:
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise TokenizerError(f"token id {i!r} is not a non-negative integer")

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---- chat ----------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render the conversation; with tokenize=True, its ids (the template writes the BOS itself).

        Extra kwargs reach the template as variables (e.g. `reasoning=False`,
        `enable_thinking=False`, `documents=[...]`) and override the special-token variables.
        """
        if tools is not None and not isinstance(tools, list):
            raise ChatTemplateError("tools must be a list of tool specs")
        variables = {**self.special_tokens, **kwargs}
        text = render(
            chat_template or self.chat_template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return self.encode(text) if tokenize else text


def _load_backend(path: Path) -> Backend:
    if not path.is_file():
        raise TokenizerError(f"no tokenizer.json at {path}")
    try:
        return Backend.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise TokenizerError(f"{path}: not a valid tokenizer file ({exc})") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return value


def _token_text(value: Any, name: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"tokenizer config: {name} must be a string or {{'content': ...}}, got {value!r}")


def _find_template(directory: Path, config: dict[str, Any]) -> tuple[str, str]:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), "chat_template.jinja"
    template = select_template(config.get("chat_template"))
    if template is not None:
        return template, "tokenizer_config.json"
    return BUILTIN_TEMPLATE_PATH.read_text(encoding="utf-8"), "builtin"
