"""The incremental detokenizer: streamed text equals the full decode, never broken UTF-8."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from northmk.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from northmk.tokenizer_files import write_tokenizer_files

VOCAB = 512
MULTIBYTE = "é中🎉 naïve ✓ Ωmega 日本語 👩‍💻"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    directory = tmp_path_factory.mktemp("detok")
    write_tokenizer_files(directory, VOCAB)
    return Tokenizer.from_pretrained(directory)


def stream(tok, ids, skip_special_tokens=True):
    """Push ids one at a time; check the invariant after every push; return all released text."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    released = ""
    for k, token_id in enumerate(ids, start=1):
        released += detok.push(token_id)
        full = tok.decode(ids[:k], skip_special_tokens=skip_special_tokens)
        held = full[len(released):]
        assert full.startswith(released), "released text is always a prefix of the full decode"
        assert held == "" or held.endswith("\ufffd"), "text is held back only while a character is incomplete"
    return released + detok.flush()


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.characters(exclude_categories=("Cs",)), max_size=60))
def test_streaming_any_text_releases_exactly_that_text(tok, text):
    ids = tok.encode(text)
    assert stream(tok, ids, skip_special_tokens=False) == text


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB - 1), max_size=40), skip=st.booleans())
def test_streaming_any_ids_equals_the_full_decode(tok, ids, skip):
    """Arbitrary ids: special tokens, stray continuation bytes, truncated characters."""
    assert stream(tok, ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_multibyte_characters_split_across_tokens_are_held_until_complete(tok):
    ids = tok.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE), "the small vocabulary splits characters into byte tokens"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert "" in deltas, "some tokens end inside a character and release nothing"
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == MULTIBYTE


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(tok, skip):
    ids = tok.encode("<|START_TEXT|>Hé<|END_TEXT|><|END_OF_TURN_TOKEN|>")
    expected = "Hé" if skip else "<|START_TEXT|>Hé<|END_TEXT|><|END_OF_TURN_TOKEN|>"
    assert stream(tok, ids, skip_special_tokens=skip) == expected


def test_a_special_token_inside_a_character_keeps_both_sides(tok):
    first, second = tok.encode("é")
    ids = [first, tok.token_to_id("<|END_TEXT|>"), second, *tok.encode("ok")]
    assert stream(tok, ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)


def test_an_incomplete_character_at_the_end_is_flushed_not_dropped(tok):
    ids = tok.encode("ab🎉")[:-1]
    detok = IncrementalDetokenizer(tok)
    released = "".join(detok.push(i) for i in ids)
    tail = detok.flush()
    assert "\ufffd" not in released
    assert released + tail == tok.decode(ids) and tail.endswith("\ufffd")
    assert detok.flush() == "", "nothing is released twice"


def test_window_stays_small_over_long_generations(tok):
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("def f(x):\n    return x * 2  # é🎉\n" * 200)
    sizes = []
    for i in ids:
        detok.push(i)
        sizes.append(detok.window_size)
    assert max(sizes) <= 8, "each push decodes a few ids, not the whole sequence"
    assert detok.num_tokens == len(ids)


def test_prompt_context_does_not_leak_into_the_output(tok):
    prompt = tok.encode("Say hi: ")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    out = "".join(detok.push(i) for i in tok.encode("hi there")) + detok.flush()
    assert out == "hi there"


@pytest.mark.parametrize("bad", [-1, 2.0, None])
def test_values_that_are_not_token_ids_are_rejected(tok, bad):
    with pytest.raises(TokenizerError, match="not a non-negative integer"):
        IncrementalDetokenizer(tok).push(bad)


def test_ids_past_the_tokenizer_vocabulary_release_nothing(tok):
    first, second = tok.encode("é")
    assert stream(tok, [first, VOCAB, second, VOCAB + 100]) == "é"
