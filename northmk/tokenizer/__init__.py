"""Tokenizer, chat template rendering and incremental detokenizer."""

from .chat_template import BUILTIN_TEMPLATE_PATH, ChatTemplateError
from .detokenizer import IncrementalDetokenizer
from .tokenizer import Tokenizer, TokenizerError

__all__ = ["BUILTIN_TEMPLATE_PATH", "ChatTemplateError", "IncrementalDetokenizer", "Tokenizer", "TokenizerError"]
