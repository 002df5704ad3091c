"""Per-choice parsing of a chat reply's text into reasoning, content and tool calls.

The chat handler gives each choice its own `OutputParser` and feeds it the text deltas
the engine releases; the parser returns what to put in the OpenAI delta/message. Today
the default parser is Cohere's (`northmk.parsing`, cohere-melody), which splits reasoning
and `<|START_ACTION|>` tool calls; any other plugs in through the app's `parser_factory`.

The parser reads the reply WITH its special tokens; `SpecialTextParser` wraps it so that
no special-token text (a stray `<|USER_TOKEN|>` from a weak model) reaches a client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from .schemas import ChatCompletionRequest, ToolCallDelta


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class OutputParser(Protocol):
    def feed(self, text: str) -> ParsedDelta:
        """The next text delta of the choice; returns what became final."""

    def finish(self) -> ParsedDelta:
        """End of the choice: flush anything held back."""

    @property
    def has_tool_calls(self) -> bool:
        """True once the reply contained a tool call (finish_reason becomes tool_calls)."""


class PlainTextParser:
    """The whole reply is content."""

    has_tool_calls = False

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(content=text)

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


ParserFactory = Callable[[ChatCompletionRequest], OutputParser]


def plain_text_parser(request: ChatCompletionRequest) -> OutputParser:
    return PlainTextParser()


class SpecialTextFilter:
    """Drops every occurrence of the given texts from a stream, also when one is split
    across pushes (a tail that could begin one is held back until the next push)."""

    def __init__(self, texts: Iterable[str]):
        texts = sorted({t for t in texts if t}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._prefixes = {t[:k] for t in texts for k in range(1, len(t))}
        self._longest_prefix = max(map(len, texts), default=1) - 1
        self._held = ""

    def push(self, text: str) -> str:
        if self._pattern is None or not (text or self._held):
            return text
        text, previous = self._held + text, None
        while text != previous:  # removing one may join the pieces of another
            previous, text = text, self._pattern.sub("", text)
        keep = next((k for k in range(min(len(text), self._longest_prefix), 0, -1)
                     if text[-k:] in self._prefixes), 0)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class SpecialTextParser:
    """`parser` with special-token texts removed from its content and reasoning."""

    def __init__(self, parser: OutputParser, special_texts: Iterable[str]):
        self.parser = parser
        texts = list(special_texts)
        self._content, self._reasoning = SpecialTextFilter(texts), SpecialTextFilter(texts)

    @property
    def has_tool_calls(self) -> bool:
        return self.parser.has_tool_calls

    def feed(self, text: str) -> ParsedDelta:
        parsed = self.parser.feed(text)
        return ParsedDelta(self._content.push(parsed.content), self._reasoning.push(parsed.reasoning),
                           parsed.tool_calls)

    def finish(self) -> ParsedDelta:
        parsed = self.parser.finish()
        content = self._content.push(parsed.content) + self._content.flush()
        reasoning = self._reasoning.push(parsed.reasoning) + self._reasoning.flush()
        return ParsedDelta(content, reasoning, parsed.tool_calls)
