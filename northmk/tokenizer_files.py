"""Tokenizer files for checkpoints the project writes itself.

The real North Mini Code tokenizer cannot be downloaded here, so checkpoints get a
byte-level BPE of the same on-disk shape: `tokenizer.json` (loadable by `tokenizers` and
transformers), `tokenizer_config.json`, `special_tokens_map.json` and `chat_template.jinja`.

Id layout for a vocabulary of V ids:

    0..3              <PAD> <UNK> <BOS_TOKEN> <EOS_TOKEN>
    4..259            the 256 byte-level symbols, in byte order
    260..             merges learned from CORPUS below, in merge order
    ...               <unused_ID> reserved entries, only where needed to fill the id space
    CHAT_BASE..+15    the chat tokens of CHAT_TOKENS, in that order

CHAT_BASE is 255000 when the vocabulary reaches past the chat block there (the real
model's ids: <|END_OF_TURN_TOKEN|> = 255001), otherwise the top of the vocabulary, so tiny
vocabularies (512 ids and up) still hold every token. Reserved entries sit in the BPE
vocabulary without a merge that produces them: encoding never yields them, decoding
renders their name, and the file stays small (no 200k added tokens to match on load).
The merges come from an embedded corpus, so the same arguments give byte-identical files
on every machine; merges stop where the corpus runs out (a few hundred).
"""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache
from pathlib import Path

from tokenizers import pre_tokenizers

from .tokenizer.chat_template import BUILTIN_TEMPLATE_PATH

PAD, UNK, BOS, EOS = "<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>"
LOW_SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)
START_OF_TURN, END_OF_TURN = "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>"
CHAT_TOKENS = (
    START_OF_TURN,
    END_OF_TURN,
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
    "<|SYSTEM_TOKEN|>",
    "<|START_TEXT|>",
    "<|END_TEXT|>",
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    "<|START_ACTION|>",
    "<|END_ACTION|>",
    "<|START_TOOL_RESULT|>",
    "<|END_TOOL_RESULT|>",
    "<|START_RESPONSE|>",
    "<|END_RESPONSE|>",
    "<|IMG_PATCH|>",
)
REAL_CHAT_BASE = 255000  # <|START_OF_TURN_TOKEN|> in the real 262144-token vocabulary
NUM_BYTES = 256
MIN_VOCAB_SIZE = len(LOW_SPECIAL_TOKENS) + NUM_BYTES + len(CHAT_TOKENS)
MODEL_MAX_LENGTH = 262144

# Our own text: English prose and Python code in the style the model serves, so the
# merges look like a coding model's (indentation runs, keywords, common words).
CORPUS = '''
The quick brown fox jumps over the lazy dog. A serving engine reads a request, turns the
prompt into tokens, runs the model one step at a time and streams the text back to the
client. Each step reads every active weight once, so decoding is limited by memory
bandwidth, not by arithmetic. Batching several requests together lets one read of the
weights serve many tokens. The scheduler decides which requests run in the next step,
which wait, and which are preempted when the cache runs out of pages.

Please write a function that returns the sum of the squares of a list of numbers.
Here is a short explanation of how the code works, followed by an example and a test.
If the input is empty, the function returns zero. The result is an integer when every
number is an integer, and a float otherwise. Let me know if you have any questions!

What is the weather like in Paris today? It is sunny and warm, with a light breeze from
the west. Tomorrow will be cloudy in the morning and rainy in the afternoon.

def sum_of_squares(numbers: list[float]) -> float:
    """Return the sum of the squares of numbers."""
    total = 0
    for number in numbers:
        total += number * number
    return total


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int = 16):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def is_finished(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens


def read_config(path):
    with open(path, "r", encoding="utf-8") as f:
        config = json.load(f)
    if "hidden_size" not in config:
        raise ValueError(f"{path}: missing field 'hidden_size'")
    return config


import os
import sys
from dataclasses import dataclass, field


@dataclass
class Page:
    index: int
    ref_count: int = 0
    hash: int | None = None


def allocate(pages, free_list, count):
    if len(free_list) < count:
        return None
    taken = [free_list.pop() for _ in range(count)]
    for page in taken:
        pages[page].ref_count += 1
    return taken


async def handle(request):
    body = await request.json()
    messages = body.get("messages", [])
    if not isinstance(messages, list):
        return web.json_response({"error": "messages must be a list"}, status=400)
    result = await engine.generate(messages)
    return web.json_response({"id": result.id, "choices": result.choices})


for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    elif i % 3 == 0:
        print(i, "is odd and divisible by three")
    else:
        continue

try:
    value = int(text)
except ValueError as exc:
    raise SystemExit(f"not a number: {text!r}") from exc
finally:
    print("done")

x = [1, 2, 3, 4, 5]
y = {"a": 1, "b": 2, "c": None, "d": True, "e": False}
z = (x[0] + x[-1]) / 2.0
assert z == 3.0, "the mean of the ends"
numbers = sorted(set(x) | {7, 8}, reverse=True)

#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 0; i < argc; ++i) {
        printf("%d: %s\\n", i, argv[i]);
    }
    return 0;
}

SELECT name, COUNT(*) AS total FROM users WHERE active = 1 GROUP BY name ORDER BY total DESC;
git commit -m "Fix the off-by-one error in the page table" && git push origin main
{"model": "north-mini-code", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}
'''


def bytes_to_symbols() -> list[str]:
    """The byte-level alphabet: printable bytes map to themselves, the rest to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, extra = [], 0
    for b in range(NUM_BYTES):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(NUM_BYTES + extra))
            extra += 1
    return symbols


def chat_base(vocab_size: int) -> int:
    if vocab_size >= REAL_CHAT_BASE + len(CHAT_TOKENS):
        return REAL_CHAT_BASE
    return vocab_size - len(CHAT_TOKENS)


@lru_cache(maxsize=1)
def corpus_merges() -> tuple[tuple[str, str], ...]:
    """Byte-level BPE merges of CORPUS: most frequent pair first, ties to the smaller pair.

    Learned here rather than by `tokenizers`' trainer so the result cannot change with
    that library's version. Stops when no pair occurs twice.
    """
    splitter = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    lines = CORPUS.splitlines(keepends=True)
    counts = Counter(piece for line in lines for piece, _ in splitter.pre_tokenize_str(line))
    words = [(word, list(word), n) for word, n in sorted(counts.items()) if len(word) > 1]
    pairs: Counter[tuple[str, str]] = Counter()
    for _, symbols, n in words:
        _count_pairs(pairs, symbols, n)
    merges = []
    while pairs:
        best, count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merges.append(best)
        joined = best[0] + best[1]
        for word, symbols, n in words:
            if joined in word:  # a word's symbols always concatenate to the word itself
                _count_pairs(pairs, symbols, -n)
                _merge_in_place(symbols, best)
                _count_pairs(pairs, symbols, n)
    return tuple(merges)


def _count_pairs(pairs: Counter, symbols: list[str], n: int) -> None:
    for pair in zip(symbols, symbols[1:]):
        pairs[pair] += n
        if not pairs[pair]:
            del pairs[pair]


def _merge_in_place(symbols: list[str], pair: tuple[str, str]) -> None:
    i = 0
    while i < len(symbols) - 1:
        if (symbols[i], symbols[i + 1]) == pair:
            symbols[i : i + 2] = [pair[0] + pair[1]]
        i += 1


def build_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    base = chat_base(vocab_size)
    first_merge = len(LOW_SPECIAL_TOKENS) + NUM_BYTES
    merges = list(corpus_merges()[: max(0, base - first_merge)])
    tokens = [*LOW_SPECIAL_TOKENS, *bytes_to_symbols(), *(a + b for a, b in merges)]
    tokens += [f"<unused_{i}>" for i in range(len(tokens), base)]
    tokens += CHAT_TOKENS
    tokens += [f"<unused_{i}>" for i in range(len(tokens), vocab_size)]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == vocab_size, "every vocabulary entry is distinct"
    return vocab, merges


def tokenizer_json(vocab_size: int) -> dict:
    """tokenizer.json as `tokenizers` reads it, built directly: fast for 262k ids, and the
    bytes do not depend on the installed library's serializer."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an integer >= {MIN_VOCAB_SIZE} (specials + 256 bytes + chat tokens), "
            f"got {vocab_size!r}"
        )
    vocab, merges = build_vocab(vocab_size)
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for t in (*LOW_SPECIAL_TOKENS, *CHAT_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [vocab[BOS]], "tokens": [BOS]}},
        },
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab,
            "merges": [list(m) for m in merges],
        },
    }


def special_token_ids(vocab_size: int) -> dict[str, int]:
    base = chat_base(vocab_size)
    ids = {t: i for i, t in enumerate(LOW_SPECIAL_TOKENS)}
    ids.update({t: base + i for i, t in enumerate(CHAT_TOKENS)})
    return ids


def write_tokenizer_files(directory: str | Path, vocab_size: int) -> dict:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja.

    Returns the ids to put in config.json: bos_token_id, eos_token_id (end of turn),
    pad_token_id, and `special_tokens`, every special token's id by name.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = json.dumps(tokenizer_json(vocab_size), ensure_ascii=False, separators=(",", ":"))
    (directory / "tokenizer.json").write_text(tokenizer + "\n", encoding="utf-8")
    specials = {"bos_token": BOS, "eos_token": END_OF_TURN, "unk_token": UNK, "pad_token": PAD}
    config = {
        **specials,
        "add_bos_token": True,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(directory / "tokenizer_config.json", config)
    _write_json(directory / "special_tokens_map.json", specials)
    (directory / "chat_template.jinja").write_text(BUILTIN_TEMPLATE_PATH.read_text(encoding="utf-8"), encoding="utf-8")
    ids = special_token_ids(vocab_size)
    return {
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[END_OF_TURN],
        "pad_token_id": ids[PAD],
        "special_tokens": ids,
    }


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
