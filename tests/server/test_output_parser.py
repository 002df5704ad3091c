"""The chat response path takes reasoning and tool calls from a pluggable per-choice parser."""

from northmk.server.output_parser import ParsedDelta, plain_text_parser
from northmk.server.schemas import ToolCallDelta

from .helpers import MODEL, post, stream

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "ignore_eos": True, "temperature": 0}


class ThinkThenCall:
    """All text is reasoning; at the end the choice calls `lookup` with the text's length."""

    has_tool_calls = False

    def __init__(self) -> None:
        self.length = 0

    def feed(self, text: str) -> ParsedDelta:
        self.length += len(text)
        return ParsedDelta(reasoning=text)

    def finish(self) -> ParsedDelta:
        self.has_tool_calls = True
        call = ToolCallDelta(0, id="call_0", type="function",
                             function={"name": "lookup", "arguments": f'{{"n": {self.length}}}'})
        return ParsedDelta(tool_calls=[call])


async def test_a_parser_turns_text_into_reasoning_and_tool_calls(make_client):
    plain = await make_client(parser_factory=plain_text_parser)
    text = (await post(plain, "/v1/chat/completions", BODY))["choices"][0]["message"]["content"]
    client = await make_client(parser_factory=lambda request: ThinkThenCall())
    message = (await post(client, "/v1/chat/completions", BODY))["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] == text
    assert message["tool_calls"] == [{"id": "call_0", "type": "function",
                                      "function": {"name": "lookup", "arguments": f'{{"n": {len(text)}}}'}}]
    events = await stream(client, "/v1/chat/completions", BODY)
    deltas = [c["choices"][0]["delta"] for c in events[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == text
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["lookup"]
