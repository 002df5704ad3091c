"""Streaming parser of a Cohere (cmd4) chat reply, built on cohere-melody's filter.

The reply is fed as decoded text WITH special tokens. melody's filter splits it into
reasoning (`...<|END_THINKING|>`), content (`<|START_TEXT|>...<|END_TEXT|>`) and tool calls
(`<|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}...]<|END_ACTION|>`); this
module turns its per-call pieces into OpenAI tool-call deltas:

- a call is announced (index, `call_...` id, type, whole name) once its name is complete:
  when its arguments begin, the next call begins, or the reply ends; arguments follow in
  chunks as melody releases them;
- `index` counts announced calls 0, 1, ...; `call_ids` maps the model's own numbering
  ("0", "1", ...) to the OpenAI ids handed out;
- arguments melody leaves empty (`"parameters": {}`) become "{}" at the end;
- an action block that yields no call at all (malformed JSON) is returned as content at
  the end, so nothing the model wrote is lost and nothing raises.
"""

from __future__ import annotations

import re
import secrets
import string
from dataclasses import dataclass
from typing import Callable

from cohere_melody import FilterAggregatedResult, PyFilter, PyFilterOptions

from ..server.output_parser import ParsedDelta
from ..server.schemas import ChatCompletionRequest, ToolCallDelta

CALL_ID_ALPHABET = string.ascii_letters + string.digits
CALL_ID_LENGTH = 24  # random characters after "call_", as OpenAI's ids
ACTION_BLOCK = re.compile(r"<\|START_ACTION\|>(.*?)(?:<\|END_ACTION\|>|$)", re.DOTALL)
EMPTY_ARGUMENTS = "{}"


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(CALL_ID_ALPHABET) for _ in range(CALL_ID_LENGTH))


@dataclass
class _Call:
    """One call as melody reports it (by melody's index), and what was emitted of it."""

    model_id: str = ""
    name: str = ""
    arguments: str = ""
    index: int | None = None  # OpenAI index once announced
    openai_id: str = ""
    emitted_arguments: int = 0  # characters of `arguments` already sent


class CohereOutputParser:
    """Implements the server's OutputParser protocol for one choice.

    `reasoning`: whether the generation prompt left `<|START_THINKING|>` open (reasoning
    on), so the reply starts as reasoning; off, it starts in the answer.
    """

    def __init__(self, reasoning: bool = True, make_call_id: Callable[[], str] = new_call_id):
        options = PyFilterOptions().cmd4()
        self._filter = PyFilter(options if reasoning else options.start_in_answer())
        self._make_call_id = make_call_id
        self._calls: dict[int, _Call] = {}  # melody's index -> call
        self._num_announced = 0
        self._text: list[str] = []  # the raw reply, for malformed action blocks
        self._finished = False

    @property
    def has_tool_calls(self) -> bool:
        return self._num_announced > 0

    @property
    def call_ids(self) -> dict[str, str]:
        """The model's tool_call_id ("0", "1", ...) -> the OpenAI id given to that call."""
        return {c.model_id: c.openai_id for c in self._calls.values() if c.index is not None and c.model_id}

    def feed(self, text: str) -> ParsedDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._text.append(text)
        return self._convert(self._filter.write_decoded(text), final=False)

    def finish(self) -> ParsedDelta:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        delta = self._convert(self._filter.flush_partials(), final=True)
        if not self.has_tool_calls:
            delta.content += "".join(m.group(1) for m in ACTION_BLOCK.finditer("".join(self._text)))
        return delta

    # ---- melody's pieces -> OpenAI deltas ---------------------------------------------
    def _convert(self, result: FilterAggregatedResult, final: bool) -> ParsedDelta:
        delta = ParsedDelta(content=result.content or "", reasoning=result.reasoning or "")
        for piece in result.tool_calls:
            if piece.index not in self._calls:
                # A new call: the ones before it are complete, announce any still pending.
                for earlier in self._calls.values():
                    delta.tool_calls += self._emit(earlier, ready=True)
            call = self._calls.setdefault(piece.index, _Call())
            call.model_id += piece.id
            call.name += piece.name
            call.arguments += piece.arguments
            delta.tool_calls += self._emit(call, ready=bool(call.arguments))
        if final:
            for call in self._calls.values():
                if call.index is None or not call.arguments:
                    if call.name and not call.arguments:
                        call.arguments = EMPTY_ARGUMENTS
                    delta.tool_calls += self._emit(call, ready=True)
        return delta

    def _emit(self, call: _Call, ready: bool) -> list[ToolCallDelta]:
        """The deltas `call` has to send now: its announcement when ready, then new arguments."""
        if call.index is None:
            if not (ready and call.name):
                return []
            call.index, call.openai_id = self._num_announced, self._make_call_id()
            self._num_announced += 1
            call.emitted_arguments = len(call.arguments)
            fn = {"name": call.name, "arguments": call.arguments}
            return [ToolCallDelta(index=call.index, id=call.openai_id, type="function", function=fn)]
        new = call.arguments[call.emitted_arguments:]
        if not new:
            return []
        call.emitted_arguments = len(call.arguments)
        return [ToolCallDelta(index=call.index, function={"arguments": new})]


def cohere_parser_factory(request: ChatCompletionRequest) -> CohereOutputParser:
    """The app's `parser_factory`: reasoning follows the request's template switches."""
    effort = getattr(request, "reasoning_effort", None)
    kwargs = {"reasoning_effort": effort, **(request.chat_template_kwargs or {})}
    return CohereOutputParser(reasoning=reasoning_enabled(kwargs))


def reasoning_enabled(template_kwargs: dict | None) -> bool:
    """Whether the built-in template leaves <|START_THINKING|> open, from the same variables
    it reads: `reasoning`, then `enable_thinking`, then `reasoning_effort` ("none" = off)."""
    kwargs = template_kwargs or {}
    for name in ("reasoning", "enable_thinking"):
        if kwargs.get(name) is not None:
            return bool(kwargs[name])
    effort = kwargs.get("reasoning_effort")
    return not (isinstance(effort, str) and effort.lower() == "none")
