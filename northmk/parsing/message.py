"""Whole-message views of a parsed reply, and the tool-call numbering across turns.

`MessageAccumulator` folds a choice's parsed deltas into the non-streamed message (and is
what a client does with the stream); `parse_reply` is the one-shot parse of a full reply.

Numbering: the chat template numbers the conversation's tool calls "0", "1", ... in the
order they appear (over all assistant messages), and renders each `tool` message's
`tool_call_id` as the number of the call it answers. `conversation_call_numbers` is that
same mapping, for validating a request (a tool message answering no call is a 400) and for
telling the grammar which number the model's next call gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..server.output_parser import ParsedDelta
from ..server.schemas import ToolCall, ToolCallFunction
from .cohere import CohereOutputParser, new_call_id


@dataclass
class ParsedMessage:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class MessageAccumulator:
    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, ToolCall] = {}

    def add(self, delta: ParsedDelta) -> None:
        self._content.append(delta.content)
        self._reasoning.append(delta.reasoning)
        for piece in delta.tool_calls:
            fn = piece.function if isinstance(piece.function, dict) else {}
            call = self._calls.get(piece.index)
            if call is None:
                if not isinstance(piece.id, str):
                    raise ValueError(f"tool call {piece.index} streamed arguments before its id")
                self._calls[piece.index] = ToolCall(
                    id=piece.id, function=ToolCallFunction(name=fn.get("name", ""), arguments=fn.get("arguments", ""))
                )
            else:
                call.function.name += fn.get("name", "")
                call.function.arguments += fn.get("arguments", "")

    def message(self) -> ParsedMessage:
        """Content is None when the reply was only tool calls (as OpenAI reports it)."""
        content = "".join(self._content)
        reasoning = "".join(self._reasoning)
        calls = [self._calls[i] for i in sorted(self._calls)]
        return ParsedMessage(
            content=content if content or not calls else None,
            reasoning_content=reasoning or None,
            tool_calls=calls,
        )


def parse_reply(text: str, reasoning: bool = True, make_call_id: Callable[[], str] = new_call_id) -> ParsedMessage:
    parser = CohereOutputParser(reasoning=reasoning, make_call_id=make_call_id)
    accumulator = MessageAccumulator()
    accumulator.add(parser.feed(text))
    accumulator.add(parser.finish())
    return accumulator.message()


def conversation_call_numbers(messages: Iterable[Any]) -> dict[str, str]:
    """OpenAI tool-call id -> the model's number for it ("0", "1", ...), as the template renders it.

    Messages may be dicts or structs with `tool_calls` whose items carry an `id`.
    Raises ValueError for a call without an id or an id used twice.
    """
    numbers: dict[str, str] = {}
    for message in messages:
        for call in _get(message, "tool_calls") or []:
            call_id = _get(call, "id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError("every assistant tool call needs a non-empty string id")
            if call_id in numbers:
                raise ValueError(f"tool call id {call_id!r} is used by more than one call")
            numbers[call_id] = str(len(numbers))
    return numbers


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
