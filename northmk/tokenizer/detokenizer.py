"""Incremental detokenization: token ids in, text deltas out, one token at a time.

Decodes only a small window of recent ids per token (vLLM's prefix/read offsets): the
window starts at the last point where text was released, so a token that ends inside a
multi-byte character releases nothing until the character completes. Every character is
released exactly once; `flush()` releases whatever is held at the end (an incomplete
sequence decodes to U+FFFD there, as a full decode would).
"""

from __future__ import annotations

from .tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a decode yields for an incomplete UTF-8 sequence
PROMPT_CONTEXT = 4  # prompt ids kept before the first generated one (leading-space rules)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids or [])[-PROMPT_CONTEXT:]
        tokenizer.check_ids(context)
        self._ids = context  # the window: ids[:read] were released already, ids[read:] are held
        self._read = len(context)
        self.num_tokens = 0

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (possibly "")."""
        self.tokenizer.check_ids([token_id])
        self._ids.append(token_id)
        self.num_tokens += 1
        released, text = self._decode(self._ids[: self._read]), self._decode(self._ids)
        if len(text) <= len(released) or text.endswith(REPLACEMENT):
            return ""
        self._advance()
        return text[len(released):]

    def flush(self) -> str:
        """Release everything still held (call once generation has ended)."""
        released, text = self._decode(self._ids[: self._read]), self._decode(self._ids)
        self._advance()
        return text[len(released):]

    @property
    def window_size(self) -> int:
        """Ids decoded per push: the last released chunk plus the held ones."""
        return len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self) -> None:
        # Keep only the window: the last released chunk becomes the next prefix.
        del self._ids[: self._read]
        self._read = len(self._ids)
