"""Parsing Cohere chat replies (cohere-melody) into OpenAI reasoning, content and tool calls."""

from .cohere import CohereOutputParser, cohere_parser_factory, new_call_id
from .message import MessageAccumulator, ParsedMessage, conversation_call_numbers, parse_reply

__all__ = [
    "CohereOutputParser",
    "MessageAccumulator",
    "ParsedMessage",
    "cohere_parser_factory",
    "conversation_call_numbers",
    "new_call_id",
    "parse_reply",
]
