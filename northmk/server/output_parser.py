"""Per-choice parsing of a chat reply's text into reasoning, content and tool calls.

The chat handler gives each choice its own `OutputParser` and feeds it the text deltas
the engine releases; the parser returns what to put in the OpenAI delta/message. Today
the reply is plain content (`PlainTextParser`); a Cohere parser (cohere-melody) that
splits `<|START_THINKING|>` reasoning and `<|START_ACTION|>` tool calls plugs in through
the app's `parser_factory` without touching the handlers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

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
