"""The server's use of the tokenizer: chat rendering, prompts, token texts for logprobs."""

from __future__ import annotations

from typing import Any

import jinja2

from .errors import InvalidRequest
from .logprobs import token_text_fn
from .schemas import ChatMessage, ToolCall
from .validation import check_token_ids


class Tokens:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.token_text = token_text_fn(tokenizer)
        self.special_texts = [tokenizer.id_to_token(i) for i in tokenizer.all_special_ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True, param: str = "tokens") -> str:
        check_token_ids(ids, min(self.vocab_size, self.tokenizer.vocab_size), param)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        check_token_ids(ids, self.vocab_size, param)
        return ids

    def render_chat(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's token ids (the template writes BOS itself)."""
        dicts = [message_dict(m) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                dicts, tools=tools, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as error:
            raise InvalidRequest(f"cannot render the chat template: {error}", param="messages") from error
        if continue_final_message:
            text = _cut_after_final(text, dicts[-1]["content"] or "")
        return self.encode(text, add_special_tokens=False)


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it (text parts joined)."""
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text or "" for part in content)
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [_tool_call_dict(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    return out


def _tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": call.function.arguments}}


def _cut_after_final(text: str, final: str) -> str:
    """The rendered chat up to the end of the final (assistant) message's text, so the
    model continues it instead of starting a new turn."""
    end = text.rfind(final) if final else -1
    if end < 0:
        raise InvalidRequest("cannot find the final message in the rendered chat",
                             param="continue_final_message")
    return text[: end + len(final)]
